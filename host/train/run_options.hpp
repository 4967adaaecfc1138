#pragma once
// wick.train's options: one schema, declared with the SDK's OptionBuilder as
// the plugins declare theirs and checked by the same validation
// (validate_options, open ranges included). It serves
// the run (wick.train), the trainer (wick.trainer, a subset), `wick describe
// train` and the command line's key=value overrides.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "train/loader.hpp"
#include "train/trainer.hpp"
#include "wick/kit/enum_names.hpp"
#include "wick/options.hpp"

namespace wick {

struct DistEnv;

/// One option: the forms it accepts, tried in order (micro_batch is an
/// integer >= 1 or the string "auto": two forms), each an OptionSpec with the
/// option's name.
struct RunOption {
  std::string name;
  std::vector<OptionSpec> forms;
  Value default_value;   ///< nil: optional (absent unless given)
  std::string doc;
  bool trainer = false;  ///< also an option of wick.trainer{...}
  bool per_rank = false; ///< may differ between ranks (not in the ranks' fingerprint)
  bool run = true;       ///< an option of wick.train (false: wick.trainer's alone)
};

/// The objects a run takes besides its options (model, data, optim, schedule, eval_data).
struct RunObjectSpec {
  std::string name;
  std::string kind;  ///< "model", "data", "optimizer", "schedule"
  bool required;
  bool trainer;      ///< also taken by wick.trainer{...}
  std::string doc;
};

const std::vector<RunOption>& run_options();

/// The two-way choices a TrainerConfig keeps as a bool: on_oom
/// (split_on_oom) and sync (sync_every_micro_batch).
inline constexpr EnumName<bool> kOnOomNames[] = {{true, "split"}, {false, "fail"}};
inline constexpr EnumName<bool> kSyncNames[] = {{false, "window"}, {true, "micro_batch"}};
/// monitor_mode, true where higher is better (the Monitor and checkpoints keep the word).
inline constexpr EnumName<bool> kMonitorModeNames[] = {{false, "min"}, {true, "max"}};
const std::vector<RunObjectSpec>& run_objects();

/// Checks `given` against the run's options (or the trainer's, a subset):
/// unknown keys (`objects` names keys given as objects, which are known too),
/// types, ranges and choices, each form through validate_options. Returns
/// every option, defaults filled (optional ones absent stay nil). Errors read
/// "<label>: option 'k': expected ..., got ...".
Options validate_run_options(const std::string& label, const std::map<std::string, Value>& given,
                             const std::vector<std::string>& objects = {}, bool trainer_only = false);

/// wick.loader{...}: the run's data options (micro_batch, here a whole number
/// only, accumulate, shuffle, seed, drop_last, workers, prefetch) checked by
/// their declarations in run_options(), as wick.train checks them, beside the
/// loader's own (rank, world_size, pin_memory). Unknown keys are refused.
/// rank and world_size stay nil unless given.
Options validate_loader_options(const std::string& label, const std::map<std::string, Value>& given);

/// The same checks for a LoaderConfig built in C++ (run.cpp's, the tests'):
/// "LoaderConfig: option 'micro_batch': expected a value >= 1, got integer 0".
/// The Loader's constructor calls it.
void check_loader_config(const LoaderConfig& c);

/// The schema's checks for a TrainerConfig built in C++ (the tests', a custom
/// host's): its values read back as wick.trainer's options and validated as
/// they are (ranges, choices, the rules between options). Errors read
/// "TrainerConfig: option 'k': expected ...". The Trainer's constructor calls it.
void check_trainer_config(const TrainerConfig& c);

/// A command-line value ("4", "auto", "false", "cosine", "a,b") read as the
/// option `name` declares it, trying its forms in order; throws wick::Error
/// naming the key when no form takes it. Lists are comma-separated.
Value parse_run_option(const std::string& name, const std::string& text);

/// The TrainerConfig part of validated options (precision, loss scaling,
/// checkpointing, clipping, on_oom, CUDA memory controls, device, sync).
TrainerConfig trainer_config(const Options& o);

/// The device option resolved for this process, the one way wick.train and
/// wick.trainer take: "auto" is this rank's GPU (cuda:LOCAL_RANK with several
/// ranks) or the CPU without one (resolve_device), and the backend its ranks
/// would meet through is checked. Errors read "<label>: option device '...': ...".
std::string resolve_device_option(const std::string& label, const std::string& device, const DistEnv& env);

/// `wick describe train`: every object and option with its types, default,
/// range or choices and doc.
std::string describe_run_options();

}  // namespace wick
