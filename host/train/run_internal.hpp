#pragma once
// What the run's files share (run.cpp's loop, run_resolve.cpp's options,
// resume.cpp's checks, plan.cpp's table); not part of the engine's API.

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "distributed/group.hpp"
#include "train/run_folder.hpp"
#include "train/run.hpp"
#include "train/trainer.hpp"
#include "wick/options.hpp"

namespace wick {

/// One line to stderr, flushed.
void err_line(const std::string& s);
/// A note between steps: on a terminal it first clears the redrawn progress line.
void note(const std::string& s);

bool is_cuda(const std::string& device);
/// The peak bytes held by tensors on the device (CUDA) or the CPU since the last reset.
std::int64_t tensor_peak(bool cuda);
/// Resets the CPU tensor, host offload and CUDA peaks.
void reset_peaks();
/// The bytes a run may use on `device`: a GPU's total memory, or on the CPU
/// the tensor cap (0: none).
std::int64_t device_memory(const std::string& device);
/// A file's bytes ("" when it cannot be read).
std::string read_text(const std::string& path);
/// The first `count` samples of `d` as micro-batches of `micro`.
std::vector<Batch> data_window(const Dataset& d, std::int64_t count, std::int64_t micro);

/// Options, overrides and objects checked; what the loop and the plan share.
struct Resolved {
  Options o;
  RunObjects obj;
  std::shared_ptr<Optimizer> optim;
  std::shared_ptr<Schedule> schedule;
  std::string label, device;
  DistEnv dist;
  bool quiet = false, rank0 = true;
  bool micro_auto = false;
  std::int64_t micro_batch = 1, accumulate = 1;
};

/// wick.train's options with the command line's overrides, checked, the
/// objects typed, the device chosen; warns of command-line keys nothing uses.
Resolved resolve(const RunRequest& req);
/// The resolved options as plain JSON values (run.json, the ranks' fingerprint).
nlohmann::json options_json(const Resolved& r);
/// What every rank must agree on: the recipe, the data, the model's size and
/// every option that is not per rank.
std::string fingerprint(const Resolved& r, const std::string& recipe);
TrainerConfig make_trainer_config(const Resolved& r, std::int64_t total_steps);
/// micro_batch = "auto": {micro_batch, accumulate} for a rank's share of the batch.
std::pair<std::int64_t, std::int64_t> fit_micro_batch(Trainer& trainer, const Resolved& r, std::int64_t per_rank,
                                                      std::int64_t batch_size);

/// Where a resumed run starts: the checkpoint and its state.json (empty path:
/// none, start fresh).
struct ResumePoint {
  std::filesystem::path checkpoint;
  nlohmann::json state;
};
/// resume = true: the newest intact checkpoint under `ckpt_dir`, checked
/// against this run (data, order, window size; another rank count changes
/// r.accumulate to keep the effective batch). Throws Error naming what differs.
ResumePoint find_resume_point(Resolved& r, const PriorRun& prior, const std::filesystem::path& ckpt_dir,
                              std::int64_t samples);
/// A run resumed that had already ended (stopped on purpose, or finished all
/// its steps): the summary to return, its files unchanged; nothing otherwise.
std::optional<nlohmann::json> already_ended(const Resolved& r, const PriorRun& prior, const Trainer& trainer,
                                            const ResumePoint& from, const std::filesystem::path& out,
                                            std::int64_t total);

/// The monitored evaluation metric (`monitor`): the best checkpoints and
/// early stopping. Its count rides in every checkpoint, so a resume goes on
/// counting.
struct Monitor {
  std::string name, mode;  ///< mode: "min" or "max"
  int keep_best = 1;
  std::int64_t patience = 0;
  double min_delta = 0;
  std::optional<double> best;
  std::int64_t best_step = 0, bad = 0;  ///< bad: evaluations in a row without improving

  /// The run's monitor (none without the option), its count taken from the
  /// checkpoint being resumed when that watched the same metric the same way.
  static std::optional<Monitor> of(const Options& o, const nlohmann::json& resume_state);
  /// The metric in an evaluation record ("eval_loss" or "loss"); throws Error
  /// naming the metrics the record has.
  double value_in(const nlohmann::json& rec, const std::string& label) const;
  /// Counts an evaluation's value made at `step`.
  void record(double v, std::int64_t step);
  bool out_of_patience() const { return patience > 0 && bad >= patience; }
  std::string patience_reason() const;
  /// What a checkpoint keeps of it (with the value of the evaluation that made it).
  nlohmann::json state(std::optional<double> value) const;
};

}  // namespace wick
