#pragma once
// The run: wick.train's loop, owned by the engine. It validates the options
// (train/run_options.hpp), applies command-line overrides, builds the loader
// and the trainer, resumes from a checkpoint, finds an automatic micro-batch,
// steps through epochs with save and evaluation cadence, stops on signals,
// and reports to observers (progress line, run folder, bindings). It knows
// no Lua.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "observe/observer.hpp"
#include "train/run_context.hpp"
#include "wick/data.hpp"
#include "wick/model.hpp"
#include "wick/optim.hpp"

namespace wick {

/// The objects a run trains with.
struct RunObjects {
  std::shared_ptr<Model> model;
  std::shared_ptr<Dataset> data;
  std::shared_ptr<Object> optim;     ///< must be an Optimizer
  std::shared_ptr<Object> schedule;  ///< a Schedule, or null (or named by the `schedule` option)
  std::shared_ptr<Dataset> eval_data;
};

/// What a callback answers: scalars to log (into the record it was given:
/// metrics.jsonl and TensorBoard; on_save's go with the next step's record),
/// and whether to stop the run after this step.
struct CallbackReply {
  std::vector<std::pair<std::string, double>> log;
  bool stop = false;
  std::string reason;
};

/// Functions the run calls (a recipe's on_step, on_eval, on_save): at each
/// step's end with its record (the numbers are then read every step), after
/// each evaluation with its record, and after each checkpoint with its
/// folder. On rank 0 only unless callbacks_every_rank; a stop asked on any
/// rank stops every rank after the same step. An exception fails the run.
struct RunCallbacks {
  std::function<CallbackReply(const nlohmann::json& record)> on_step, on_eval;
  std::function<CallbackReply(const std::string& checkpoint)> on_save;
  bool any() const { return on_step || on_eval || on_save; }
};

struct RunRequest {
  RunObjects objects;
  std::map<std::string, Value> options;  ///< plain values (see run_options())
  /// The command line's key=value pairs (none when null): those naming a
  /// run option override it, parsed as the option declares, and count as
  /// read; a key that is unread and names no option anywhere is named in a
  /// warning at the start. Not owned: the runtime's, alive during the call.
  RunContext* context = nullptr;
  std::string recipe;  ///< the recipe's path, for run.json and the ranks' fingerprint
  std::string label = "wick.train";
  /// Observers beyond the built-in progress line and run folder log.
  std::vector<std::shared_ptr<Observer>> observers;
  RunCallbacks callbacks;
};

/// The command-line keys this call takes as option overrides: those naming a
/// wick.train option, unless the recipe says overrides = false.
std::vector<std::string> taken_overrides(const RunRequest& request);

/// Runs training to its end (or a signal, or a stop: patience or a callback)
/// and returns the summary: status (finished, interrupted, stopped), steps,
/// skipped_steps, final_loss, best_loss, history (every step's record), eval,
/// checkpoint, micro_batch, accumulate, memory, peak_memory, seconds, comm,
/// host_reads; with monitor: best (metric, value, step, checkpoint); after a
/// stop: stopped (step, by, reason). Throws wick::Error (after marking the run
/// folder failed) when a step fails.
nlohmann::json run_training(const RunRequest& request);

/// `wick plan`: one optimizer step per setting on the recipe's data (the
/// weights change, nothing is saved), the peak memory held by tensors and the
/// time of each; then the fastest setting that fits `device_memory` bytes (0:
/// the device's own size). Prints its table to stdout.
void plan_training(const RunRequest& request, std::int64_t device_memory);

}  // namespace wick
