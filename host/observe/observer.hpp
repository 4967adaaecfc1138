#pragma once
// What a run reports, and to whom: the engine's run (train/run.hpp) calls its
// observers at the start, for every step record and evaluation, for notes
// between steps, and at the end. The progress line and the run folder's log
// are observers; so is anything a binding or a test attaches.

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace wick {

/// Facts fixed when the run starts.
struct RunStart {
  std::int64_t total_steps = 0;
  std::int64_t start_step = 0;   ///< > 0 when resumed
  std::string item_name;         ///< "samples", "tokens"
  std::string device;
  std::string recipe;            ///< the recipe's path ("" when none)
  nlohmann::json options;        ///< resolved options, plain values
  nlohmann::json extra;          ///< further run.json fields (precision, world_size, loss_scope, ...)
};

class Observer {
 public:
  virtual ~Observer() = default;
  virtual void on_start(const RunStart& start) { (void)start; }
  /// One optimizer step's record (step, loss, lr, grad_norm, items, memory,
  /// the model's metrics, ...), in step order. Records arrive in groups: the
  /// engine reads numbers from the device every `log_every` steps, or every
  /// step when an observer asks for it (wants_every_step).
  virtual void on_step(const nlohmann::json& record) { (void)record; }
  /// The end of a group of step records: what an observer buffered goes
  /// out now (a run log writes its files once per group, not per record).
  virtual void on_steps_delivered() {}
  /// An evaluation's record (loss, items, metrics, step, "eval": true).
  virtual void on_eval(const nlohmann::json& record) { (void)record; }
  /// The run's end: status, steps, final and best loss, memory breakdown, ...
  virtual void on_end(const nlohmann::json& summary) { (void)summary; }
  /// The run failed with `error` after on_start.
  virtual void on_failure(const std::string& error, const nlohmann::json& summary) { (void)error, (void)summary; }
  /// True: every step's numbers are needed as it ends (a progress line
  /// redrawn on a terminal), at one device read per step.
  virtual bool wants_every_step() const { return false; }
};

}  // namespace wick
