#include "train/run_options.hpp"

#include <algorithm>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "distributed/group.hpp"
#include "distributed/reducer.hpp"
#include "plugin/registry.hpp"
#include "util/args.hpp"
#include "util/system.hpp"

namespace wick {
namespace {

// One option of wick.train, declared with the SDK's builder as a plugin
// declares its own: the builder's default and doc are the option's, and
// or_form adds a further form, tried in order (micro_batch: an integer >= 1,
// or "auto"). The forms are optional: presence and defaults are the
// RunOption's business.
struct Declare {
  RunOption o;
  Declare& or_form(OptionBuilder f) {
    f.spec.name = o.name;
    f.spec.default_value = Value();
    f.spec.doc.clear();
    f.spec.optional = true;
    o.forms.push_back(std::move(f.spec));
    return *this;
  }
  Declare& trainer() { o.trainer = true; return *this; }      // wick.trainer takes it too
  Declare& trainer_only() { o.trainer = true; o.run = false; return *this; }
  Declare& per_rank() { o.per_rank = true; return *this; }   // may differ between ranks
  operator RunOption() const { return o; }
};
Declare option(const OptionBuilder& first) {
  Declare d;
  d.o.name = first.spec.name;
  d.o.default_value = first.spec.default_value;
  d.o.doc = first.spec.doc;
  return d.or_form(first);
}
// a form after the first: its type, range and choices
OptionBuilder form(OptionType t) { return opt("", t, Value(), ""); }

bool takes(const RunOption& o, bool trainer_only) { return trainer_only ? o.trainer : o.run; }

std::string join(const std::vector<std::string>& xs, const char* sep = ", ") {
  std::string out;
  for (std::size_t i = 0; i < xs.size(); ++i) out += (i ? sep : "") + xs[i];
  return out;
}

bool is_list_type(OptionType t) {
  return t == OptionType::IntList || t == OptionType::NumberList || t == OptionType::StringList;
}

// Whether `v` has a type `t` accepts (a scalar stands for a one-item list).
bool type_fits(OptionType t, const Value& v) {
  auto scalar = [&](const Value& x) {
    switch (t) {
      case OptionType::Bool: return x.is_bool();
      case OptionType::Int: case OptionType::IntList: return x.is_int();
      case OptionType::Number: case OptionType::NumberList: return x.is_number();
      case OptionType::String: case OptionType::StringList: return x.is_string();
    }
    return false;
  };
  if (is_list_type(t) && v.is_list()) {
    for (const auto& x : v.as_list())
      if (!scalar(x)) return false;
    return true;
  }
  return scalar(v);
}

// "[0, 1]", "(0, 1)", ">= 1", "> 0": a form's range as the option declares it
std::string range_text(const OptionSpec& f) {
  if (f.min && f.max)
    return (f.min_open ? "(" : "[") + Value(*f.min).repr() + ", " + Value(*f.max).repr() + (f.max_open ? ")" : "]");
  if (f.min) return (f.min_open ? "> " : ">= ") + Value(*f.min).repr();
  if (f.max) return (f.max_open ? "< " : "<= ") + Value(*f.max).repr();
  return "";
}

std::string form_text(const OptionSpec& f) {
  std::string s = to_string(f.type);
  if (f.min && f.max) s += " in " + range_text(f);
  else if (f.min || f.max) s += " " + range_text(f);
  if (!f.choices.empty()) s += " (" + join(f.choices, " | ") + ")";
  return s;
}

// The data and the loop: batches, epochs, workers.
std::vector<RunOption> loop_options() {
  using T = OptionType;
  return {
      option(opt_int("warmup_steps", 0, "warmup steps when schedule is given by name").at_least(0)),
      option(opt_int("micro_batch", 1,
                     "samples per micro-batch (per rank), or 'auto': the largest that fits, found by probing (needs "
                     "batch_size)")
                 .at_least(1))
          .or_form(form(T::String).one_of({"auto"})),
      option(opt_int("accumulate", 1, "micro-batches per optimizer step").at_least(1)),
      option(opt_int("batch_size", Value(),
                     "effective batch (micro_batch x accumulate x ranks) that micro_batch = 'auto' keeps")
                 .at_least(1)),
      option(opt_int("epochs", 1, "passes over the data").at_least(1)),
      option(opt_int("max_steps", 0, "stop after this many optimizer steps (0: no limit)").at_least(0)),
      option(opt_bool("drop_last", false,
                      "drop an epoch's last short window instead of stepping with its true item count")),
      option(opt_bool("shuffle", true, "shuffle the data each epoch (by seed and epoch)")),
      option(opt_int("seed", 0, "seed for data order and random layers").at_least(0)),
      option(opt_int("workers", 0, "data worker threads (0: load on the training thread)").range(0, 1024)),
      option(opt_int("prefetch", 2, "micro-batches loaded ahead, at most").range(1, 1 << 20)),
  };
}

// The step: precision, the average, loss scaling, activation checkpointing, memory, ranks
// (wick.trainer's too, all but eval_ema).
std::vector<RunOption> trainer_options() {
  using T = OptionType;
  return {
      option(opt_string(
                 "precision", "fp32",
                 "fp32, bf16-mixed, fp16-mixed (autocast, fp32 master weights), bf16-true, fp16-true (half-precision "
                 "weights)")
                 .one_of(enum_names(kPrecisionNames)))
          .trainer(),
      option(
          opt_bool("master_weights", false,
                   "bf16-true, fp16-true: the optimizer steps fp32 copies of the trainable weights and their fp32 "
                   "gradients, summed over the window (6 bytes more per trainable parameter than plain bf16-true: 18 "
                   "with AdamW against 12, and 2 more during each backward)"))
          .trainer(),
      option(opt_number(
                 "ema", 0.0,
                 "an exponential moving average of the trainable weights with this decay (0.999; 0: none), in fp32 "
                 "beside the weights (4 bytes per trainable parameter), in checkpoints, written to out/ema.safetensors")
                 .at_least(0)
                 .below(1))
          .trainer(),
      option(opt_int("ema_start", 0, "the average copies the weights until this step, and averages from it on")
                 .at_least(0))
          .trainer(),
      option(opt_bool("eval_ema", false,
                      "each evaluation also runs with the averaged weights: ema_loss and ema_<metric> in its record "
                      "(monitor = \"eval_ema_loss\" keeps the best averaged checkpoints)")),
      option(
          opt_number("loss_scale", Value(),
                    "fp16: a fixed loss scale (the default is dynamic; a recipe may also give a table {init, growth, "
                    "backoff, interval}, the loss_scale_* options)")
              .above(0)
              .at_most(1e30))
          .trainer(),
      option(opt_number("loss_scale_init", 65536.0, "fp16, dynamic scaling: the first scale").above(0).at_most(1e30))
          .trainer(),
      option(opt_number("loss_scale_growth", 2.0, "fp16, dynamic scaling: the factor after `interval` clean steps")
                 .above(1)
                 .at_most(1e6))
          .trainer(),
      option(
          opt_number("loss_scale_backoff", 0.5, "fp16, dynamic scaling: the factor after an overflow").above(0).below(1))
          .trainer(),
      option(
          opt_int("loss_scale_interval", 2000, "fp16, dynamic scaling: clean steps before the scale grows").at_least(1))
          .trainer(),
      option(
          opt_bool(
              "checkpointing", false,
              "activation checkpointing: false, true (every block the model declares), k (every k-th block) or a list "
              "of block names"))
          .or_form(form(T::Int).at_least(1))
          .or_form(form(T::StringList))
          .trainer(),
      option(opt_bool(
                 "offload_activations", false,
                 "with checkpointing: each checkpointed block's input waits for backward in host memory (pinned, on a "
                 "GPU, copied on a side stream) instead of on the device, and comes back for the block's "
                 "recomputation, started by the backward of the block after it (the same gradients; each input "
                 "crosses the bus twice a step)"))
          .trainer(),
      option(opt_bool(
                 "offload_embeddings", false,
                 "the model's frozen input embedding (an untied decoder's embed_tokens) stays in host memory: each "
                 "lookup runs there and only the looked-up rows go to the device (the same results; a LLaMA-2-7B "
                 "table is 0.24 GiB in bf16)"))
          .trainer(),
      option(opt_number("clip_grad_norm", 0.0,
                       "clip the global gradient norm to this, after unscaling (0: off; the norm is logged anyway)")
                 .at_least(0))
          .trainer(),
      option(opt_number("clip_grad_value", 0.0, "clamp every gradient element to [-v, v], after unscaling (0: off)")
                 .at_least(0))
          .trainer(),
      option(opt_string(
                 "on_oom", "split",
                 "out of memory in a window: 'split' halves the micro-batch, doubles accumulate and redoes the window; "
                 "'fail' stops")
                 .one_of(enum_names(kOnOomNames)))
          .trainer(),
      option(opt_int("empty_cache_every", 0,
                     "CUDA: return cached memory to the device every N steps (0: never; no effect on cpu)")
                 .at_least(0))
          .trainer(),
      option(opt_number("memory_fraction", 0.0,
                       "CUDA: cap this process at this fraction of the device's memory (0: no cap; no effect on cpu)")
                 .range(0, 1))
          .trainer(),
      option(opt_string("device", "auto", "cpu, cuda, cuda:N or auto (cuda:LOCAL_RANK with several ranks)"))
          .trainer()
          .per_rank(),
      option(opt_number("bucket_mb", 25.0, "gradient all-reduce bucket size across ranks, MiB").range(1e-6, 1e6))
          .trainer(),
      option(
          opt_string(
              "sync", "window",
              "gradients cross ranks once per 'window' (with the last backward) or every 'micro_batch' (same result, "
              "more traffic)")
              .one_of(enum_names(kSyncNames)))
          .trainer(),
      option(opt_string(
                 "shard", "none",
                 "several ranks: 'optimizer' partitions the optimizer state across them (ZeRO-1), 'gradients' the "
                 "optimizer state and the reduced gradients (ZeRO-2), 'parameters' the weights too (ZeRO-3: a block's "
                 "weights gathered while it computes); each rank steps its part; the result equals 'none' (every rank "
                 "holds everything)")
                 .one_of(enum_names(kShardModeNames)))
          .trainer(),
      option(opt_int("total_steps", 0, "the steps the schedule spans (wick.train counts them itself)").at_least(0))
          .trainer_only(),
  };
}

// The run folder, evaluation, the monitor and what is printed.
std::vector<RunOption> folder_options() {
  using T = OptionType;
  return {
      option(opt_string("out", Value(), "run folder: metrics.jsonl, checkpoints/, run.json (nil: nothing written)")),
      option(opt_int("save_every", 0, "checkpoint every N steps (0: only at the end); needs out").at_least(0)),
      option(opt_string("return_weights", "gathered",
                        "shard = \"parameters\" on several ranks: 'gathered' puts the trained weights back whole in "
                        "every rank's model; 'file' writes them to out/model.safetensors a unit at a time (rank 0 "
                        "writing) and returns the model deferred from that file on every rank, read when used (a "
                        "save copies it a tensor at a time, a divided run makes its chunks from it), so no rank ever "
                        "holds the whole model; needs out")
                 .one_of({"gathered", "file"})),
      option(opt_int("keep_checkpoints", 3, "newest checkpoints kept").at_least(1)),
      option(opt_bool("resume", false,
                      "continue from the newest intact checkpoint in out/checkpoints (a finished run stays as it is)")),
      option(
          opt_bool("overwrite", false,
                   "replace the run an existing out folder holds (its checkpoints, metrics, events, run.json); without "
                   "this or resume, such a folder is refused")),
      option(opt_int("eval_every", 0, "evaluate every N steps (0: only at the end)").at_least(0)),
      option(opt_int("eval_micro_batch", Value(),
                     "micro-batch for evaluation (default: micro_batch); it runs under the training precision and "
                     "halves on out-of-memory as training does")
                 .at_least(1)),
      option(opt_string(
          "monitor", Value(),
          "an evaluation metric (\"eval_loss\", \"eval_accuracy\", or the eval record's own key): a checkpoint "
          "after each evaluation, the best keep_best of them kept beside the newest, checkpoints/best naming the "
          "best; needs eval_data and out")),
      option(opt_string("monitor_mode", Value(),
                        "whether lower or higher is better (default: min for a loss, max for any other metric)")
                 .one_of(enum_names(kMonitorModeNames))),
      option(opt_int("keep_best", 1, "best checkpoints by the monitored metric kept beside the newest keep_checkpoints")
                 .at_least(1)),
      option(opt_int("patience", 0,
                     "stop after this many evaluations in a row that do not improve the monitored metric by min_delta "
                     "(0: never stop early)")
                 .at_least(0)),
      option(opt_number("min_delta", 0.0, "the least change of the monitored metric that counts as an improvement")
                 .at_least(0.0)),
      option(opt_bool("callbacks_every_rank", false,
                      "run on_step, on_eval and on_save on every rank (default: rank 0 only)")),
      option(opt_int("log_every", 10,
                     "numbers read from the device and written every N steps (a progress line when stderr is not a "
                     "terminal; metrics.jsonl records in groups of N)")
                 .at_least(1))
          .per_rank(),
      option(opt_bool("overrides", true,
                      "command-line key=value pairs naming an option override it in this call (false: the recipe reads "
                      "wick.args itself, as a recipe of several stages with folders of their own does)")),
      option(opt_bool("quiet", false, "no progress line or summary (ranks other than 0 are always quiet)")).per_rank(),
      option(opt_bool("profile", false,
                      "record optimizer steps with PyTorch's profiler: true (steps 2 to 4: after a warm-up step) or "
                      "{first, last}; writes out/profile.json (a trace for Perfetto or chrome://tracing; other ranks "
                      "profile-rank<N>.json) and puts where the steps' time went (the phases, the host's operators "
                      "by self time, the GPU's kernels) in run.json and the run's table; needs out"))
          .or_form(form(T::IntList))
          .per_rank(),
  };
}
}  // namespace

const std::vector<RunOption>& run_options() {
  static const std::vector<RunOption> opts = [] {
    std::vector<RunOption> all;
    for (auto group : {loop_options(), trainer_options(), folder_options()})
      all.insert(all.end(), group.begin(), group.end());
    return all;
  }();
  return opts;
}

const std::vector<RunObjectSpec>& run_objects() {
  static const std::vector<RunObjectSpec> objs = {
      {"model", "model", true, true, "model (wick.model); required"},
      {"data", "data", true, false, "training data (wick.data); required"},
      {"optim", "optimizer", true, true, "optimizer (wick.optim); required"},
      {"schedule", "schedule", false, true,
       "schedule object (wick.schedule), or a name: 'constant' | 'linear' | 'cosine' (with warmup_steps)"},
      {"eval_data", "data", false, false, "evaluation data (wick.data)"},
  };
  return objs;
}

namespace {

// One form's check, the plugins' validation (type, finiteness, range,
// choices). Returns the value converted as the form declares it.
Value check_form(const std::string& label, const RunOption& o, const OptionSpec& f, const Value& v) {
  return validate_options(label, {f}, {{o.name, v}}).at(o.name);
}

// The first form whose type fits `v` decides; none: the forms' types named.
Value check_value(const std::string& label, const RunOption& o, const Value& v) {
  for (const auto& f : o.forms)
    if (type_fits(f.type, v)) return check_form(label, o, f, v);
  std::vector<std::string> types;
  for (const auto& f : o.forms) types.push_back(to_string(f.type));
  throw Error(label + ": option '" + o.name + "': expected " + join(types, " or ") + ", got " + v.type_name() + " " +
              v.repr() + v.not_exact_note());
}

Error unknown_option(const std::string& label, const std::string& key, const std::vector<std::string>& known) {
  return Error(label + ": unknown option '" + key + "' (known options: " + join(known) + ")");
}

bool is_run_object(const std::string& key) {
  return std::any_of(run_objects().begin(), run_objects().end(), [&](const auto& o) { return o.name == key; });
}
bool is_run_option(const std::string& key) {
  return std::any_of(run_options().begin(), run_options().end(), [&](const auto& o) { return o.name == key; });
}

// Every key known (an object or an option this call takes); a key naming an
// object holds one (or, for schedule, a name).
void check_keys(const std::string& label, const std::map<std::string, Value>& given,
                const std::vector<std::string>& objects, bool trainer_only) {
  std::vector<std::string> known;
  for (const auto& o : run_objects())
    if (!trainer_only || o.trainer) known.push_back(o.name);
  for (const auto& o : run_options())
    if (takes(o, trainer_only)) known.push_back(o.name);
  auto is_known = [&](const std::string& k) { return std::find(known.begin(), known.end(), k) != known.end(); };
  for (const auto& n : objects)
    if (!is_known(n)) throw unknown_option(label, n, known);
  for (const auto& [key, v] : given) {
    if (!is_known(key)) throw unknown_option(label, key, known);
    if (is_run_object(key) && !is_run_option(key) && !(key == "schedule" && v.is_string()) && !v.is_nil())
      throw Error(label + ": option '" + key + "': expected a wick object, got " + v.type_name() + " " + v.repr());
  }
}

using Checked = std::map<std::string, Value>;
bool has(const Checked& out, const char* k) { return !out.at(k).is_nil(); }

// micro_batch = "auto" with batch_size, or micro_batch and accumulate given
void check_batch_rules(const std::string& label, const Checked& out) {
  const bool automatic = out.at("micro_batch").is_string();
  if (automatic && !has(out, "batch_size"))
    throw Error(label + ": option 'micro_batch': 'auto' needs batch_size, the effective batch to keep "
                "(micro_batch x accumulate x ranks)");
  if (!automatic && has(out, "batch_size"))
    throw Error(label + ": option 'batch_size' goes with micro_batch = 'auto'; with micro_batch given, set accumulate");
  if (automatic && out.at("accumulate").as_int() != 1)
    throw Error(label + ": option 'accumulate' goes with a micro_batch given: micro_batch = 'auto' finds accumulate "
                "itself from batch_size (micro_batch x accumulate x ranks)");
}

// out: a path; resume, overwrite and save_every need it
void check_folder_rules(const std::string& label, const Checked& out) {
  if (has(out, "out") && out.at("out").as_string().empty())
    throw Error(label + ": option 'out': expected a run folder's path, got \"\" (leave out unset to write nothing)");
  if (out.at("resume").as_bool() && out.at("overwrite").as_bool())
    throw Error(label + ": options 'resume' and 'overwrite' exclude each other: continue the run in out, or replace it");
  if (out.at("overwrite").as_bool() && !has(out, "out"))
    throw Error(label + ": option 'overwrite' needs 'out', the run folder to replace");
  if (out.at("resume").as_bool() && !has(out, "out"))
    throw Error(label + ": option 'resume' needs 'out', the run folder to resume from");
  if (out.at("save_every").as_int() > 0 && !has(out, "out"))
    throw Error(label + ": option 'save_every' needs 'out', the run folder to save in");
  if (const Value& p = out.at("profile"); !p.is_nil() && !(p.is_bool() && !p.as_bool())) {
    if (!has(out, "out"))
      throw Error(label + ": option 'profile' needs 'out', the run folder to write the trace (profile.json) in");
    if (!p.is_bool()) {
      const std::vector<Value> steps = p.is_list() ? p.as_list() : std::vector<Value>{p};
      if (steps.size() != 2 || steps[0].as_int() < 1 || steps[1].as_int() < steps[0].as_int())
        throw Error(label + ": option 'profile': expected true or {first, last}, the optimizer steps to record (1 <= "
                    "first <= last), got " + (steps.size() == 1 ? steps[0].repr() + " (one step: {" + steps[0].repr() +
                                              ", " + steps[0].repr() + "})" : p.repr()));
    }
  }
  if (out.at("return_weights").as_string() == "file") {
    if (!has(out, "out"))
      throw Error(label + ": option 'return_weights': \"file\" needs 'out', the run folder to write model.safetensors in");
    if (parse_shard(out.at("shard").as_string()) != ShardMode::Parameters)
      throw Error(label + ": option 'return_weights': \"file\" is for shard = \"parameters\" (the weights divided); "
                  "with shard = \"" + out.at("shard").as_string() + "\" every rank holds them whole already");
  }
}

// monitor needs eval_data and out; its companions need monitor
void check_monitor_rules(const std::string& label, const Checked& out, bool eval_data) {
  if (has(out, "monitor")) {
    if (out.at("monitor").as_string().empty())
      throw Error(label + ": option 'monitor': expected a metric's name such as \"eval_loss\", got \"\"");
    if (!eval_data) throw Error(label + ": option 'monitor' needs 'eval_data': it watches an evaluation metric");
    if (!has(out, "out"))
      throw Error(label + ": option 'monitor' needs 'out', the run folder that keeps the best checkpoints");
  } else {
    // (a resolved table, as wick plan passes, holds their defaults: only a setting that acts is refused)
    const bool acts[] = {has(out, "monitor_mode"), out.at("patience").as_int() > 0,
                         out.at("min_delta").as_number() > 0, out.at("keep_best").as_int() != 1};
    const char* names[] = {"monitor_mode", "patience", "min_delta", "keep_best"};
    for (int i = 0; i < 4; ++i)
      if (acts[i]) throw Error(label + ": option '" + names[i] + "' needs 'monitor', the evaluation metric it is about");
  }
  if (out.at("patience").as_int() > 0 && out.at("eval_every").as_int() == 0)
    throw Error(label + ": option 'patience' needs eval_every > 0: without it there is one evaluation, at the end");
}

// ema_start and eval_ema need ema
void check_ema_rules(const std::string& label, const Checked& out) {
  const bool ema = out.at("ema").as_number() > 0;
  if (out.at("ema_start").as_int() > 0 && !ema)
    throw Error(label + ": option 'ema_start' needs 'ema', the average's decay (0.999, ...)");
  if (out.at("eval_ema").as_bool() && !ema)
    throw Error(label + ": option 'eval_ema' needs 'ema', the average's decay (0.999, ...)");
}

// The rules between a trainer's options (wick.train's, wick.trainer's and a
// TrainerConfig's): a fixed loss scale or dynamic scaling; master weights
// with a half-precision model only; one gradient exchange per window under
// shard and with master weights; offloading what checkpointing keeps.
void check_trainer_rules(const std::string& label, const Checked& out, const std::map<std::string, Value>& given) {
  if (has(out, "loss_scale"))
    for (const char* k : {"loss_scale_init", "loss_scale_growth", "loss_scale_backoff", "loss_scale_interval"})
      if (auto g = given.find(k); g != given.end() && !g->second.is_nil())
        throw Error(label + ": option 'loss_scale': a fixed scale and " + std::string(k) +
                    " (dynamic scaling) exclude each other");
  const Precision precision = parse_precision(out.at("precision").as_string());
  const bool master = out.at("master_weights").as_bool();
  const bool per_micro_batch = parse_enum(kSyncNames, out.at("sync").as_string(), "sync");
  if (master && !true_half(precision))
    throw Error(label + ": option 'master_weights': only with precision = \"bf16-true\" or \"fp16-true\" (" +
                to_string(precision) +
                (precision == Precision::FP32 ? " weights are fp32 already)" : " keeps fp32 weights already)"));
  if (const ShardMode shard = parse_shard(out.at("shard").as_string()); shard != ShardMode::None && per_micro_batch)
    throw Error(label + ": option 'sync': shard = \"" + to_string(shard) + "\": gradients are reduce-scattered once per window, "
                "with the last backward; sync = \"micro_batch\" cannot be used with it");
  const Value& ck = out.at("checkpointing");
  const bool no_names = ck.is_list() && ck.as_list().empty();
  if (out.at("offload_activations").as_bool() && ((ck.is_bool() && !ck.as_bool()) || no_names))
    throw Error(label + ": option 'offload_activations': it moves the checkpointed blocks' inputs to host memory, and "
                "checkpointing " + (no_names ? "names no block" : "is false") +
                "; set checkpointing = true (or k, or block names) too");
  if (master && per_micro_batch)
    throw Error(label + ": option 'sync': master_weights: gradients are summed in fp32 over the window and cross "
                "ranks once, at its end; sync = \"micro_batch\" cannot be used with it");
}

}  // namespace

Options validate_run_options(const std::string& label, const std::map<std::string, Value>& given,
                             const std::vector<std::string>& objects, bool trainer_only) {
  check_keys(label, given, objects, trainer_only);
  Checked out;
  for (const auto& o : run_options()) {
    auto it = given.find(o.name);
    const bool present = takes(o, trainer_only) && it != given.end() && !it->second.is_nil();
    // an option this call does not take is readable too, as its default
    out[o.name] = present ? check_value(label, o, it->second) : o.default_value;
  }
  if (!trainer_only) {
    check_batch_rules(label, out);
    check_folder_rules(label, out);
    check_monitor_rules(label, out, std::find(objects.begin(), objects.end(), "eval_data") != objects.end());
    check_ema_rules(label, out);
  }
  check_trainer_rules(label, out, given);
  return Options(std::move(out));
}

Options validate_loader_options(const std::string& label, const std::map<std::string, Value>& given) {
  // the run's own declarations; micro_batch's whole-number form alone ("auto" is wick.train's)
  static const std::vector<RunOption> opts = [] {
    std::vector<RunOption> v;
    for (const char* name : {"micro_batch", "accumulate", "shuffle", "seed", "drop_last", "workers", "prefetch"})
      for (const auto& o : run_options())
        if (o.name == name) v.push_back(o);
    auto& mb = v.front().forms;
    mb.erase(std::remove_if(mb.begin(), mb.end(), [](const auto& f) { return f.type == OptionType::String; }), mb.end());
    v.push_back(option(opt_int("rank", Value(), "this loader's rank (default: the process's)").range(0, 1 << 20)));
    v.push_back(option(opt_int("world_size", Value(), "the ranks the data is divided among (default: the process's world)")
                           .range(1, 1 << 20)));
    v.push_back(option(opt_bool("pin_memory", false, "page-lock batches for fast, asynchronous copies to a GPU")));
    return v;
  }();
  std::vector<std::string> known;
  for (const auto& o : opts) known.push_back(o.name);
  for (const auto& [key, v] : given)
    if (std::find(known.begin(), known.end(), key) == known.end()) throw unknown_option(label, key, known);
  Checked out;
  for (const auto& o : opts) {
    auto it = given.find(o.name);
    out[o.name] = it != given.end() && !it->second.is_nil() ? check_value(label, o, it->second) : o.default_value;
  }
  return Options(std::move(out));
}

Value parse_run_option(const std::string& name, const std::string& text) {
  const RunOption* opt = nullptr;
  for (const auto& o : run_options())
    if (o.name == name) opt = &o;
  if (!opt) throw Error("'" + name + "' is not a wick.train option");
  // numbers as the command line spells them (util/args.hpp): no nan, inf or hex
  auto as_int = [](const std::string& s, Value& out) {
    const Value v = parse_arg_value(s);
    if (!v.is_int()) return false;
    out = v;
    return true;
  };
  auto as_float = [](const std::string& s, Value& out) {
    const Value v = parse_arg_value(s);
    if (!v.is_number()) return false;
    out = Value(v.as_number());
    return true;
  };
  // a number the form's range refuses (seed=-1) goes on to the next form and,
  // failing all, to the error below that names every form with its range
  auto in_range = [&](const OptionSpec& f, const Value& v) {
    try {
      check_form(name, *opt, f, v);
      return true;
    } catch (const Error&) {
      return false;
    }
  };
  for (const auto& f : opt->forms) {
    Value v;
    switch (f.type) {
      case OptionType::Bool:
        if (text == "true" || text == "false") return Value(text == "true");
        break;
      case OptionType::Int:
        if (as_int(text, v) && in_range(f, v)) return v;
        break;
      case OptionType::Number:
        if (as_float(text, v) && in_range(f, v)) return v;
        break;
      case OptionType::String:
        if (f.choices.empty() || std::find(f.choices.begin(), f.choices.end(), text) != f.choices.end())
          return Value(text);
        break;
      case OptionType::IntList: case OptionType::NumberList: case OptionType::StringList: {
        List l;
        std::stringstream ss(text);
        std::string item;
        bool ok = !text.empty();
        while (ok && std::getline(ss, item, ',')) {
          Value x;
          if (f.type == OptionType::StringList) x = Value(item);
          else if (f.type == OptionType::IntList ? !as_int(item, x) : !as_float(item, x)) ok = false;
          l.push_back(x);
        }
        if (ok && in_range(f, Value(l))) return Value(l);
        break;
      }
    }
  }
  std::vector<std::string> forms;
  for (const auto& f : opt->forms) forms.push_back(form_text(f));
  throw Error("command line: " + name + "=" + text + ": expected " + join(forms, " or "));
}

TrainerConfig trainer_config(const Options& o) {
  TrainerConfig c;
  c.clip_grad_norm = o.get_number("clip_grad_norm");
  c.clip_grad_value = o.get_number("clip_grad_value");
  c.precision = parse_precision(o.get_string("precision"));
  c.master_weights = o.get_bool("master_weights");
  c.ema = o.get_number("ema");
  c.ema_start = o.get_int("ema_start");
  if (o.has("loss_scale")) {
    c.loss_scale.init = o.get_number("loss_scale");
    c.loss_scale.dynamic = false;
  } else {
    c.loss_scale.init = o.get_number("loss_scale_init");
    c.loss_scale.growth = o.get_number("loss_scale_growth");
    c.loss_scale.backoff = o.get_number("loss_scale_backoff");
    c.loss_scale.interval = o.get_int("loss_scale_interval");
  }
  const Value& ck = o.at("checkpointing");
  if (ck.is_bool()) {
    c.checkpointing.mode = ck.as_bool() ? CheckpointingConfig::Mode::All : CheckpointingConfig::Mode::None;
  } else if (ck.is_int()) {
    c.checkpointing.mode = CheckpointingConfig::Mode::EveryK;
    c.checkpointing.k = ck.as_int();
  } else {
    c.checkpointing.mode = CheckpointingConfig::Mode::Names;
    for (const auto& n : ck.as_list()) c.checkpointing.names.push_back(n.as_string());
  }
  c.checkpointing.offload = o.get_bool("offload_activations");
  c.offload_embeddings = o.get_bool("offload_embeddings");
  c.split_on_oom = parse_enum(kOnOomNames, o.get_string("on_oom"), "on_oom");
  c.empty_cache_every = o.get_int("empty_cache_every");
  c.memory_fraction = o.get_number("memory_fraction");
  c.total_steps = o.get_int("total_steps");
  c.device = o.get_string("device");
  c.bucket_mb = o.get_number("bucket_mb");
  c.sync_every_micro_batch = parse_enum(kSyncNames, o.get_string("sync"), "sync");
  c.shard = parse_shard(o.get_string("shard"));
  return c;
}

void check_loader_config(const LoaderConfig& c) {
  validate_loader_options("LoaderConfig", {{"micro_batch", Value(c.micro_batch)},
                                           {"accumulate", Value(c.accumulate)},
                                           {"workers", Value(c.workers)},
                                           {"prefetch", Value(c.prefetch)},
                                           {"rank", Value(c.rank)},
                                           {"world_size", Value(c.world_size)}});
}

void check_trainer_config(const TrainerConfig& c) {
  std::map<std::string, Value> given = {
      {"clip_grad_norm", Value(c.clip_grad_norm)},
      {"clip_grad_value", Value(c.clip_grad_value)},
      {"precision", Value(to_string(c.precision))},
      {"master_weights", Value(c.master_weights)},
      {"ema", Value(c.ema)},
      {"ema_start", Value(c.ema_start)},
      {"offload_activations", Value(c.checkpointing.offload)},
      {"offload_embeddings", Value(c.offload_embeddings)},
      {"on_oom", Value(std::string(enum_name(kOnOomNames, c.split_on_oom)))},
      {"empty_cache_every", Value(c.empty_cache_every)},
      {"memory_fraction", Value(c.memory_fraction)},
      {"total_steps", Value(c.total_steps)},
      {"device", Value(c.device)},
      {"bucket_mb", Value(c.bucket_mb)},
      {"sync", Value(std::string(enum_name(kSyncNames, c.sync_every_micro_batch)))},
      {"shard", Value(to_string(c.shard))},
  };
  if (c.loss_scale.dynamic) {
    given["loss_scale_init"] = Value(c.loss_scale.init);
    given["loss_scale_growth"] = Value(c.loss_scale.growth);
    given["loss_scale_backoff"] = Value(c.loss_scale.backoff);
    given["loss_scale_interval"] = Value(c.loss_scale.interval);
  } else {
    given["loss_scale"] = Value(c.loss_scale.init);
  }
  using Mode = CheckpointingConfig::Mode;
  switch (c.checkpointing.mode) {
    case Mode::None: given["checkpointing"] = Value(false); break;
    case Mode::All: given["checkpointing"] = Value(true); break;
    case Mode::EveryK: given["checkpointing"] = Value(c.checkpointing.k); break;
    case Mode::Names: {
      List names;
      for (const auto& n : c.checkpointing.names) names.push_back(Value(n));
      given["checkpointing"] = Value(names);
      break;
    }
  }
  validate_run_options("TrainerConfig", given, {}, /*trainer_only=*/true);
}

std::string resolve_device_option(const std::string& label, const std::string& device, const DistEnv& env) {
  // (a rank's device: LOCAL_RANK modulo the devices it sees; srun --gpus-per-task=1 shows each one)
  try {
    const std::string d = resolve_device(device, env.local_rank, env.local_world_size, env.world_size);
    (void)dist_backend(d);  // WICK_DIST_BACKEND checked before anything is touched
    return d;
  } catch (const Error& e) {
    throw Error(label + ": option " + e.what());
  }
}

std::string describe_run_options() {
  std::ostringstream s;
  s << "wick.train options (wick.trainer takes those marked [trainer]); every option can be given on the command\n"
       "line as key=value (lists comma-separated), which overrides the recipe:\n\n";
  s << "objects:\n";
  for (const auto& o : run_objects()) {
    char line[256];
    std::snprintf(line, sizeof line, "  %-20s %-30s %s%s\n      %s\n", o.name.c_str(), o.kind.c_str(),
                  o.required ? "(required)" : "(optional)", o.trainer ? " [trainer]" : "", o.doc.c_str());
    s << line;
  }
  s << "\noptions:\n";
  for (const auto& o : run_options()) {
    std::vector<std::string> forms;
    for (const auto& f : o.forms) forms.push_back(form_text(f));
    const std::string def = o.default_value.is_nil() ? "(none)" : o.default_value.repr();
    char line[512];
    std::snprintf(line, sizeof line, "  %-20s %-30s default %s%s\n      %s\n", o.name.c_str(), join(forms, " or ").c_str(),
                  def.c_str(), !o.run ? " [trainer only]" : o.trainer ? " [trainer]" : "", o.doc.c_str());
    s << line;
  }
  return s.str();
}

}  // namespace wick
