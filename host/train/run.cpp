#include "train/run.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <tuple>
#include <sstream>

#include "dist/group.hpp"
#include "observe/format.hpp"
#include "observe/progress.hpp"
#include "observe/runlog.hpp"
#include "plugin/registry.hpp"
#include "train/freeze.hpp"
#include "train/loader.hpp"
#include "train/run_folder.hpp"
#include "train/run_options.hpp"
#include "train/trainer.hpp"
#include "util/memory.hpp"
#include "util/system.hpp"
#include "wick/kit/json_fields.hpp"

namespace fs = std::filesystem;

namespace wick {
namespace {

void err_line(const std::string& s) {
  const std::string line = s + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

// A note between steps: on a terminal it first clears the redrawn progress line.
void note(const std::string& s) { err_line((::isatty(2) ? "\r\x1b[K" : "") + s); }

nlohmann::json to_json(const Value& v) {
  switch (v.v.index()) {
    case 0: return nullptr;
    case 1: return v.as_bool();
    case 2: return v.as_int();
    case 3: return v.as_double();
    case 4: return v.as_string();
    default: {
      auto a = nlohmann::json::array();
      for (const auto& x : v.as_list()) a.push_back(to_json(x));
      return a;
    }
  }
}

// FNV-1a of a string, as 8 hex digits.
std::string fnv1a(const std::string& s) {
  std::uint32_t h = 0x811c9dc5u;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x01000193u;
  }
  return strf("%08x", h);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  if (in) ss << in.rdbuf();
  return ss.str();
}

bool is_cuda(const std::string& device) { return device.rfind("cuda", 0) == 0; }

std::int64_t tensor_peak(bool cuda) {
  auto m = memory_stats(cuda);
  return cuda ? m["cuda_peak"] : m["cpu_tensors_peak"];
}

void reset_peaks() {
  reset_cpu_tensor_peak();
  reset_host_offload_peak();
  reset_cuda_peak();
}

// The bytes a run may use on `device`: a GPU's total memory, or on the CPU
// the tensor cap (0: none).
std::int64_t device_memory(const std::string& device) {
  if (is_cuda(device)) {
    const at::Device d(device);
    return cuda_total_memory(d.has_index() ? d.index() : 0);
  }
  return cpu_tensor_memory().limit;
}

std::vector<Batch> data_window(const Dataset& d, std::int64_t count, std::int64_t micro) {
  std::vector<Batch> w;
  for (std::int64_t i = 0; i < count; i += micro) {
    std::vector<std::int64_t> idx;
    for (std::int64_t j = i; j < std::min(i + micro, count); ++j) idx.push_back(j);
    w.push_back(d.get_batch(idx));
  }
  return w;
}

// Forward and backward of a micro-batch, no step; false when it ran out of memory.
bool probe(Trainer& t, const Batch& b, int times = 1) {
  try {
    t.probe(b, times);
  } catch (const c10::OutOfMemoryError&) {
    if (is_cuda(t.config().device)) cuda_empty_cache();
    return false;
  }
  return true;
}

// Options, overrides and objects checked; what the loop and the plan share.
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

}  // namespace

std::vector<std::string> taken_overrides(const RunRequest& req) {
  const auto ov = req.options.find("overrides");
  const bool apply = ov == req.options.end() || !ov->second.is_bool() || ov->second.as_bool();
  std::vector<std::string> out;
  if (!apply) return out;
  for (const auto& [k, text] : req.overrides) {
    if (k == "overrides") continue;  // the recipe's to say, not the command line's
    const bool known =
        std::any_of(run_options().begin(), run_options().end(), [&](const auto& o) { return o.name == k && o.run; });
    if (known && std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
  }
  return out;
}

namespace {

Resolved resolve(const RunRequest& req) {
  Resolved r;
  r.label = req.label;
  r.obj = req.objects;
  const std::string& L = r.label;
  std::map<std::string, Value> given = req.options;
  std::vector<std::string> objects;
  if (r.obj.model) objects.push_back("model");
  if (r.obj.data) objects.push_back("data");
  if (r.obj.optim) objects.push_back("optim");
  if (r.obj.schedule) objects.push_back("schedule");
  if (r.obj.eval_data) objects.push_back("eval_data");
  // command-line overrides: key=value naming an option, read as it declares
  std::vector<std::string> overridden;
  const auto taken = taken_overrides(req);
  for (const auto& [k, text] : req.overrides) {
    if (std::find(taken.begin(), taken.end(), k) == taken.end()) continue;
    Value v = parse_run_option(k, text);
    auto it = given.find(k);
    if (it != given.end() && it->second.repr() == v.repr()) continue;
    given[k] = v;
    overridden.push_back(k + "=" + text);
  }
  r.o = validate_run_options(L, given, objects);
  for (const auto& [name, obj] : std::vector<std::pair<const char*, bool>>{
           {"model", bool(r.obj.model)}, {"data", bool(r.obj.data)}, {"optim", bool(r.obj.optim)}})
    if (!obj) throw Error(L + ": option '" + name + "' is required");
  r.optim = std::dynamic_pointer_cast<Optimizer>(r.obj.optim);
  if (!r.optim || r.obj.optim->object_kind() != ObjectKind::Optimizer)
    throw Error(L + ": option 'optim': expected an optimizer (sgd, adamw, ...), got a " +
                (r.obj.optim->object_kind() == ObjectKind::Schedule ? "schedule" : "transform"));
  if (r.obj.schedule) {
    r.schedule = std::dynamic_pointer_cast<Schedule>(r.obj.schedule);
    if (!r.schedule) throw Error(L + ": option 'schedule': expected a schedule (wick.schedule), got another optim object");
  } else if (auto it = given.find("schedule"); it != given.end() && it->second.is_string()) {
    try {
      r.schedule = std::static_pointer_cast<Schedule>(registry().create(
          "schedule", PluginKind::Optim, {{"type", it->second}, {"warmup_steps", r.o.at("warmup_steps")}}));
    } catch (const Error& e) {
      throw Error(L + ": option 'schedule': " + e.what());
    }
  }
  r.quiet = r.o.get_bool("quiet");
  r.dist = dist_env();
  r.rank0 = r.dist.rank == 0;
  if (!r.rank0) r.quiet = true;
  // keys that no option takes and the recipe has not read (yet): a typo such
  // as epoch=3 is named before a long run, not after it
  if (r.rank0) {
    std::string unused;
    int n = 0;
    for (const auto& [k, text] : req.overrides)
      if (std::find(taken.begin(), taken.end(), k) == taken.end() && !req.args_read.count(k)) {
        unused += (unused.empty() ? "" : " ") + k + "=" + text;
        ++n;
      }
    if (n)
      err_line("wick: warning: " + L + ": command-line " + (n == 1 ? "key " : "keys ") + unused +
               (n == 1 ? " is" : " are") + " not used so far: no wick.train option has " +
               (n == 1 ? "its name" : "their names") + " and the recipe has not read " + (n == 1 ? "it" : "them") +
               " from wick.args (`wick describe train` lists the options)");
  }
  if (!overridden.empty() && !r.quiet) {
    std::sort(overridden.begin(), overridden.end());
    std::string s;
    for (const auto& x : overridden) s += (s.empty() ? "" : " ") + x;
    err_line(L + ": from the command line: " + s);
  }
  // checkpointing by name: every name a block of the model
  const auto blocks = r.obj.model->blocks();
  const Value& ck = r.o.at("checkpointing");
  if (ck.is_list()) {
    for (const auto& n : ck.as_list())
      if (std::find(blocks.begin(), blocks.end(), n.as_string()) == blocks.end()) {
        std::string known;
        for (const auto& b : blocks) known += (known.empty() ? "" : ", ") + b;
        throw Error(L + ": option 'checkpointing': the model has no block '" + n.as_string() + "' (its blocks: " +
                    (known.empty() ? "none" : known) + ")");
      }
  }
  if (!(ck.is_bool() && !ck.as_bool()) && blocks.empty())
    throw Error(L + ": option 'checkpointing': the model declares no blocks to checkpoint");
  if (r.o.get_bool("offload_activations") && ck.is_bool() && !ck.as_bool())
    throw Error(L + ": option 'offload_activations': it moves the checkpointed blocks' inputs to host memory, and "
                "checkpointing is false; set checkpointing = true (or k, or block names) too");
  const std::string precision = r.o.get_string("precision");
  const bool scale_given = std::any_of(given.begin(), given.end(), [](const auto& kv) {
    return kv.first.rfind("loss_scale", 0) == 0 && !kv.second.is_nil();
  });
  if (scale_given && precision != "fp16-mixed" && precision != "fp16-true" && r.rank0)
    err_line(L + ": loss_scale applies to fp16 precisions only; with " + precision + " it has no effect");
  // (a rank's device: LOCAL_RANK modulo the devices it sees; srun --gpus-per-task=1 shows each one)
  try {
    r.device = resolve_device(r.o.get_string("device"), r.dist.local_rank, r.dist.local_world_size, r.dist.world_size);
    (void)dist_backend(r.device);  // WICK_DIST_BACKEND checked before anything is touched
  } catch (const Error& e) {
    throw Error(L + ": option " + e.what());
  }
  r.micro_auto = r.o.at("micro_batch").is_string();
  r.micro_batch = r.micro_auto ? 0 : r.o.get_int("micro_batch");
  r.accumulate = r.o.get_int("accumulate");
  return r;
}

// The resolved options as plain JSON values (run.json, the ranks' fingerprint).
nlohmann::json options_json(const Resolved& r) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : r.o.values())
    if (!v.is_nil()) j[k] = to_json(v);
  j["device"] = r.device;
  return j;
}

// A digest of the data's first, middle and last samples (their names, dtypes,
// shapes and bytes): ranks whose data sets hold the same number of other
// samples (each rank reading its own file) would train on other data than
// one rank's run without a word. Randomness in samples is drawn from seeds
// and the index, so equal data gives equal samples on every rank.
std::string data_digest(const Dataset& data) {
  const std::int64_t n = data.size();
  std::uint64_t h = 1469598103934665603ULL;
  auto mix = [&h](const void* p, std::size_t len) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < len; ++i) h = (h ^ b[i]) * 1099511628211ULL;
  };
  for (const std::int64_t i : std::set<std::int64_t>{0, n / 2, n - 1}) {
    if (i < 0 || i >= n) continue;
    for (const auto& [k, t] : data.get(i)) {
      mix(k.data(), k.size());
      const auto c = t.to(at::kCPU).contiguous();
      const int dtype = static_cast<int>(c.scalar_type());
      mix(&dtype, sizeof dtype);
      for (const auto d : c.sizes()) mix(&d, sizeof d);
      mix(c.data_ptr(), c.nbytes());
    }
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string fingerprint(const Resolved& r, const std::string& recipe) {
  std::string keys;
  for (const auto& opt : run_options()) {
    if (opt.per_rank) continue;
    const Value& v = r.o.at(opt.name);
    if (v.is_nil()) continue;
    keys += (keys.empty() ? "" : " ") + opt.name + "=" + v.repr();
  }
  std::int64_t params = 0;
  for (const auto& p : r.obj.model->parameters()) params += p.numel();
  return strf("recipe %s, data %lld samples with data-digest %s (first, middle and last), model %lld parameters, ",
              fnv1a(recipe.empty() ? "" : read_text(recipe)).c_str(), static_cast<long long>(r.obj.data->size()),
              data_digest(*r.obj.data).c_str(), static_cast<long long>(params)) +
         keys;
}

TrainerConfig make_trainer_config(const Resolved& r, std::int64_t total_steps) {
  TrainerConfig c = trainer_config(r.o);
  c.total_steps = total_steps;
  c.device = r.device;
  c.group = Group::world(r.device);
  return c;
}

// micro_batch = "auto": the largest micro-batch dividing the rank's share of
// the batch whose forward and backward fit the device's memory (probed on the
// data's first samples), with 10% to spare and room for the optimizer state
// it will allocate and, with accumulation, for the summed gradients.
std::pair<std::int64_t, std::int64_t> fit_micro_batch(Trainer& trainer, const Resolved& r, std::int64_t per_rank,
                                                      std::int64_t batch_size) {
  double avail = static_cast<double>(device_memory(r.device));
  auto say = [&](const std::string& msg) {
    if (!r.quiet) err_line(r.label + ": micro_batch auto: " + msg);
  };
  if (trainer.partitioned()) {
    // a probe would gather weights on one rank alone; a window that runs out
    // of memory is halved with every rank (the same samples, the same result)
    if (r.o.get_string("on_oom") != "split")
      throw Error(r.label + ": micro_batch = 'auto' under shard = \"parameters\" starts from the whole batch and "
                  "halves the micro-batch where memory runs out, which on_oom = \"fail\" forbids; give micro_batch "
                  "as a number or drop on_oom");
    say(strf("shard = \"parameters\" probes nothing (each probe would gather weights on every rank): micro_batch "
             "%lld, halved with accumulate doubled wherever a window runs out of memory",
             static_cast<long long>(per_rank)));
    return {per_rank, 1};
  }
  if (avail == 0) {
    say(strf("no memory limit known on %s (WICK_CPU_MEMORY_LIMIT sets one): micro_batch %lld", r.device.c_str(),
             static_cast<long long>(per_rank)));
    return {per_rank, 1};
  }
  const double fraction = r.o.get_double("memory_fraction");
  if (fraction > 0) avail *= fraction;
  const double budget = avail * 0.9;
  std::vector<std::string> tried;
  auto joined = [&] {
    std::string s;
    for (const auto& t : tried) s += (s.empty() ? "" : ", ") + t;
    return s;
  };
  for (std::int64_t m = per_rank; m >= 1; --m) {
    if (per_rank % m != 0 || m > r.obj.data->size()) continue;
    const auto bd = trainer.memory_breakdown();
    // the optimizer's state is made by the first step; the summed gradients of
    // accumulation are measured: a second micro-batch runs beside the first's
    // gradients (counting them whole on top of one pass counted them twice, and
    // one sample "needed" more than the whole batch)
    const double opt_extra = static_cast<double>(std::max<std::int64_t>(0, bd.at("optimizer_expected") - bd.at("optimizer")));
    reset_peaks();
    const bool ok = probe(trainer, data_window(*r.obj.data, m, m).front(), m < per_rank ? 2 : 1);
    const double peak = static_cast<double>(tensor_peak(is_cuda(r.device)));
    if (ok && peak + opt_extra <= budget) {
      tried.push_back(strf("%lld fits (%s + %s optimizer state of %s)", static_cast<long long>(m), fmt_bytes(peak).c_str(),
                           fmt_bytes(opt_extra).c_str(), fmt_bytes(avail).c_str()));
      say(joined() + strf(": micro_batch %lld x accumulate %lld keeps the batch of %lld", static_cast<long long>(m),
                          static_cast<long long>(per_rank / m), static_cast<long long>(batch_size)));
      return {m, per_rank / m};
    }
    tried.push_back(ok ? strf("%lld needs %s", static_cast<long long>(m), fmt_bytes(peak + opt_extra).c_str())
                       : strf("%lld runs out of memory", static_cast<long long>(m)));
  }
  throw Error(r.label + ": micro_batch = 'auto': not even one sample fits in " + fmt_bytes(avail) + " on " + r.device +
              " (" + joined() + "); try precision = 'bf16-mixed' or checkpointing = true");
}

// The step record's memory fields: allocated, reserved and peak on CUDA;
// resident and peak resident, and the bytes held by tensors, on the CPU.
void add_memory(nlohmann::json& rec, std::map<std::string, std::int64_t>& m, bool cuda) {
  if (cuda) {
    rec["mem_allocated"] = m["cuda_allocated"];
    rec["mem_reserved"] = m["cuda_reserved"];
    rec["mem_peak"] = m["cuda_peak"];
    if (m.count("cuda_device_used")) rec["mem_device"] = m["cuda_device_used"];
  } else {
    rec["mem_resident"] = m["resident"];
    rec["mem_peak_resident"] = m["peak_resident"];
    rec["mem_tensors"] = m["cpu_tensors"];
    rec["mem_tensors_peak"] = m["cpu_tensors_peak"];
  }
}

// A step whose numbers may still be on the device, with what the host knew
// when it ended.
struct PendingStep {
  StepStats stats;
  std::int64_t epoch = 0;
  double time = 0;
  std::map<std::string, std::int64_t> memory;
};

nlohmann::json record_of(const PendingStep& p, bool cuda) {
  const StepStats& s = p.stats;
  nlohmann::json rec = {{"step", s.step},   {"loss", s.loss},   {"items", s.items},       {"micro_batches", s.micro_batches},
                        {"lr", s.lr},       {"grad_norm", s.grad_norm}, {"seconds", s.seconds}, {"epoch", p.epoch},
                        {"skipped", s.skipped}, {"time", p.time},
                        {"items_per_s", static_cast<double>(s.items) / std::max(s.seconds, 1e-9)}};
  if (s.loss_scale > 0) rec["loss_scale"] = s.loss_scale;
  if (s.split > 1) rec["split"] = s.split;
  if (s.oom_retries > 0) rec["oom_retries"] = s.oom_retries;
  for (const auto& [k, v] : s.metrics) rec[k] = v;
  for (const auto& [k, v] : s.group_lrs) rec[k] = v;
  auto mem = p.memory;
  add_memory(rec, mem, cuda);
  return rec;
}


// What an out folder already holds: a run's files, and its run.json.
struct PriorRun {
  bool holds = false;
  std::string what;
  nlohmann::json meta;
  std::string problem;  // run.json unreadable or of the wrong types: named, never guessed at
};

// The run.json fields a resume reads or hands back, of the types the run
// wrote; "" when they are.
std::string run_json_problem(const nlohmann::json& meta, const std::string& file) {
  try {
    constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
    const JsonFields j(meta, file);
    j.string("status", "");
    for (const char* k : {"steps", "start_step", "total_steps", "skipped_steps", "started", "ended", "micro_batch",
                          "accumulate", "world_size", "resumed"})
      j.integer(k, 0, 0, kMax);
    for (const char* k : {"final_loss", "best_loss", "peak_memory", "seconds", "loss_scale"})
      if (j.has(k) && !j.json()[k].is_number()) j.bad(k, "a number");
    for (const char* k : {"memory", "options", "eval", "best", "stopped", "logged"})
      if (j.has(k)) j.object(k);
    for (const char* k : {"checkpoint", "recipe", "precision", "device", "ema"}) j.string(k, "");
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

const char* const kRunFiles[] = {"run.json", "metrics.jsonl", "recipe.lua", "report.html", "checkpoints"};

PriorRun prior_run(const fs::path& out) {
  PriorRun p;
  std::error_code ec;
  std::vector<std::string> found;
  for (const char* f : kRunFiles)
    if (fs::exists(out / f, ec)) found.push_back(f);
  for (const auto& e : fs::directory_iterator(out, ec))
    if (e.path().filename().string().starts_with("events.out.tfevents.")) {
      found.push_back("TensorBoard events");
      break;
    }
  if (found.empty()) return p;
  p.holds = true;
  const std::string file = (out / "run.json").string();
  const std::string text = read_text(file);
  if (!text.empty()) {
    try {
      p.meta = nlohmann::json::parse(text);
      p.problem = run_json_problem(p.meta, file);
    } catch (const nlohmann::json::exception& e) {
      p.problem = file + " is not valid JSON: " + json_error_text(e);
    }
    if (!p.problem.empty()) p.meta = nlohmann::json();
  }
  if (p.meta.is_object() && p.meta.contains("status")) {
    const auto steps = p.meta.value("steps", p.meta.value("start_step", std::int64_t{0}));
    const std::string status = p.meta.value("status", std::string("?"));
    p.what = "status " + status + ", " + std::to_string(steps) + " of " +
             std::to_string(p.meta.value("total_steps", std::int64_t{0})) + " steps";
    // run.json is written as a run starts and ends: one still "running" that
    // no process holds was killed, and its checkpoints say how far it got
    if (status == "running") {
      std::string last;
      if (std::ifstream in(out / "checkpoints" / "last"); in) std::getline(in, last);
      p.what = "status running, but no process holds it: killed or crashed, " +
               (last.empty() ? std::string("no checkpoint") : "last checkpoint " + last) + ", of " +
               std::to_string(p.meta.value("total_steps", std::int64_t{0})) + " steps";
    }
  } else {
    p.meta = nlohmann::json();
    for (const auto& f : found) p.what += (p.what.empty() ? "" : ", ") + f;
  }
  return p;
}

// overwrite = true: the earlier run's files go; each is renamed first, so a
// kill halfway leaves no half-removed checkpoint that looks whole. The recipe
// being run is never one of them (out = its own folder, and it is recipe.lua).
void remove_run(const fs::path& out, const std::string& recipe) {
  std::error_code ec;
  std::vector<fs::path> doomed;
  for (const char* f : kRunFiles)
    if (fs::exists(out / f, ec) && !(!recipe.empty() && fs::equivalent(out / f, recipe, ec)))
      doomed.push_back(out / f);
  for (const auto& e : fs::directory_iterator(out, ec))
    if (e.path().filename().string().starts_with("events.out.tfevents.")) doomed.push_back(e.path());
  for (const auto& d : doomed) {
    const fs::path trash = out / (".trash-" + d.filename().string());
    fs::remove_all(trash, ec);
    fs::rename(d, trash, ec);
    if (ec) throw Error("overwrite: cannot remove " + d.string() + ": " + ec.message());
    fs::remove_all(trash, ec);
  }
}

}  // namespace

nlohmann::json run_training(const RunRequest& req) {
  // the first signal from here on stops the run after its step, with a checkpoint
  const StepLoopScope owns_signals;
  Resolved r = resolve(req);
  const std::string& L = r.label;
  const bool cuda = is_cuda(r.device);
  const int world = r.dist.world_size;
  Model& model = *r.obj.model;
  Dataset& data = *r.obj.data;
  const fs::path out = r.o.has("out") ? fs::path(r.o.get_string("out")) : fs::path();
  const fs::path ckpt_dir = out.empty() ? fs::path() : out / "checkpoints";
  // The checkpoint to resume from, read once. One made with another rank
  // count keeps its effective batch by changing accumulate.
  // A folder that holds a run is refused unless the recipe continues it
  // (resume) or replaces it (overwrite): nothing of a run is lost by reuse.
  PriorRun prior;
  // One writer per folder for the whole run: a second run (another process,
  // or one started from this run's callback) is refused, not interleaved.
  RunFolderLock lock;
  if (!out.empty() && r.rank0) lock = RunFolderLock(out, L);
  if (!out.empty()) {
    prior = prior_run(out);
    if (prior.holds && !r.o.get_bool("resume") && !r.o.get_bool("overwrite"))
      throw Error(L + ": out '" + out.string() + "' holds a run (" + prior.what +
                  "); resume = true continues it, overwrite = true replaces it, or give another out");
    if (prior.holds && r.o.get_bool("overwrite")) {
      if (r.rank0) {
        remove_run(out, req.recipe);
        err_line(L + ": overwrite = true: removed the run that was in " + out.string() + " (" + prior.what + ")");
      }
      prior = PriorRun();
    }
  }
  fs::path resume_from;
  nlohmann::json resume_state;
  if (r.o.get_bool("resume") && !prior.problem.empty())
    throw Error(L + ": resume = true, but " + prior.problem + " (mend it, or remove it to resume from the "
                "checkpoints alone)");
  if (r.o.get_bool("resume")) {
    std::vector<std::string> damaged;
    resume_from = find_checkpoint(ckpt_dir, &damaged);
    if (resume_from.empty() && !damaged.empty()) {
      std::string all;
      for (const auto& d : damaged) all += (all.empty() ? "" : "; ") + d;
      throw Error(L + ": resume = true, but no checkpoint in " + ckpt_dir.string() + " is intact: " + all);
    }
    if (r.rank0)
      for (const auto& d : damaged) err_line("wick: skipping a damaged checkpoint: " + d);
    if (!resume_from.empty()) {
      resume_state = read_checkpoint_state(resume_from);
      const auto e = resume_state.value("extra", nlohmann::json::object());
      // the loop's position: wick.train always writes it, and a checkpoint
      // without it would restart the epoch without a word
      for (const char* k : {"epoch", "window"})
        if (!e.contains(k))
          throw Error(strf("%s: checkpoint %s has no extra.%s in its state.json (wick.train writes the run's position "
                           "there): it was edited, or written by a custom loop; resume it there, or start over",
                           L.c_str(), resume_from.c_str(), k));
      // the same data: a window's position means other samples in another data set
      if (e.contains("samples") && e["samples"].is_number_integer() &&
          e["samples"].get<std::int64_t>() != static_cast<std::int64_t>(data.size()))
        throw Error(strf("%s: checkpoint %s was written training on %lld samples, this run's data holds %lld: its "
                         "position would point at other samples; resume with the same data, or start over "
                         "(overwrite = true)",
                         L.c_str(), resume_from.c_str(), static_cast<long long>(e["samples"].get<std::int64_t>()),
                         static_cast<long long>(data.size())));
      // mid-epoch, the order of the epoch's samples: another seed or shuffle
      // would repeat some of them and skip others
      if (e.value("window", std::int64_t{0}) > 0 && e.contains("shuffle") && e["shuffle"].is_boolean() &&
          e.contains("seed") && e["seed"].is_number_integer()) {
        const bool was_shuffled = e["shuffle"].get<bool>(), shuffled = r.o.get_bool("shuffle");
        const auto was_seed = e["seed"].get<std::int64_t>(), seed = r.o.get_int("seed");
        if (was_shuffled != shuffled || (shuffled && was_seed != seed))
          throw Error(strf("%s: checkpoint %s stopped in the middle of an epoch whose samples were %s; this run's "
                           "are %s: its position would repeat some samples and skip others; resume with %s, or "
                           "start over (overwrite = true)",
                           L.c_str(), resume_from.c_str(),
                           was_shuffled ? strf("shuffled with seed %lld", static_cast<long long>(was_seed)).c_str()
                                        : "in order (shuffle = false)",
                           shuffled ? strf("shuffled with seed %lld", static_cast<long long>(seed)).c_str()
                                    : "in order (shuffle = false)",
                           was_shuffled ? strf("shuffle = true, seed = %lld", static_cast<long long>(was_seed)).c_str()
                                        : "shuffle = false"));
      }
      const int ckpt_world = e.value("world_size", world);
      // on the same ranks, a window of another size would repeat or skip samples
      if (ckpt_world == world && !r.micro_auto && e.contains("micro_batch") && e.contains("accumulate")) {
        const std::int64_t was = e["micro_batch"].get<std::int64_t>() * e["accumulate"].get<std::int64_t>();
        if (was != r.micro_batch * r.accumulate)
          throw Error(strf("%s: checkpoint %s was written with windows of micro_batch %lld x accumulate %lld = %lld "
                           "samples per rank, this run's hold %lld x %lld = %lld: its position would repeat or skip "
                           "samples; resume with windows of %lld (micro_batch x accumulate), or start over "
                           "(overwrite = true)",
                           L.c_str(), resume_from.c_str(), static_cast<long long>(e["micro_batch"].get<std::int64_t>()),
                           static_cast<long long>(e["accumulate"].get<std::int64_t>()), static_cast<long long>(was),
                           static_cast<long long>(r.micro_batch), static_cast<long long>(r.accumulate),
                           static_cast<long long>(r.micro_batch * r.accumulate), static_cast<long long>(was)));
      }
      if (ckpt_world != world && !r.micro_auto) {
        const std::int64_t effective = e.value("micro_batch", std::int64_t{1}) * e.value("accumulate", std::int64_t{1}) * ckpt_world;
        const std::int64_t per = r.micro_batch * world;
        if (effective % per != 0)
          throw Error(strf("%s: cannot resume a run of effective batch %lld (micro %lld x accumulate %lld x %d ranks) "
                           "with micro_batch %lld on %d ranks: %lld is not a multiple of %lld",
                           L.c_str(), static_cast<long long>(effective),
                           static_cast<long long>(e.value("micro_batch", std::int64_t{1})),
                           static_cast<long long>(e.value("accumulate", std::int64_t{1})), ckpt_world,
                           static_cast<long long>(r.micro_batch), world, static_cast<long long>(effective),
                           static_cast<long long>(per)));
        if (r.rank0)
          err_line(strf("%s: the checkpoint was made by %d ranks, this run has %d: accumulate %lld -> %lld keeps the "
                        "effective batch of %lld",
                        L.c_str(), ckpt_world, world, static_cast<long long>(r.accumulate),
                        static_cast<long long>(effective / per), static_cast<long long>(effective)));
        r.accumulate = effective / per;
      }
    }
  }
  if (world > 1)
    if (auto g = Group::world(r.device)) g->check_same("recipe and wick.train options", fingerprint(r, req.recipe));
  at::manual_seed(static_cast<std::uint64_t>(r.o.get_int("seed")));
  std::int64_t per_rank_batch = 0;
  if (r.micro_auto) {
    const std::int64_t bs = r.o.get_int("batch_size");
    if (bs % world != 0) throw Error(strf("%s: option 'batch_size': %lld is not a multiple of the %d ranks", L.c_str(),
                                          static_cast<long long>(bs), world));
    per_rank_batch = bs / world;
  }
  auto loader_config = [&](std::int64_t micro, std::int64_t acc) {
    LoaderConfig c;
    c.micro_batch = micro;
    c.accumulate = acc;
    c.shuffle = r.o.get_bool("shuffle");
    c.seed = static_cast<std::uint64_t>(r.o.get_int("seed"));
    c.drop_last = r.o.get_bool("drop_last");
    c.workers = static_cast<int>(r.o.get_int("workers"));
    c.prefetch = static_cast<int>(r.o.get_int("prefetch"));
    c.rank = r.dist.rank;
    c.world_size = world;
    c.pin_memory = cuda;
    return c;
  };
  // windows per epoch depend on the effective batch only, not on its split
  const std::int64_t per_epoch =
      Loader(r.obj.data, loader_config(r.micro_auto ? per_rank_batch : r.micro_batch, r.micro_auto ? 1 : r.accumulate))
          .windows_per_epoch();
  if (per_epoch == 0)
    throw Error(strf("%s: the data (%lld samples) fill no window of %s x %lld with drop_last = true", L.c_str(),
                     static_cast<long long>(data.size()),
                     r.micro_auto ? "auto" : std::to_string(r.micro_batch).c_str(), static_cast<long long>(r.accumulate)));
  const std::int64_t epochs = r.o.get_int("epochs");
  std::int64_t total = per_epoch * epochs;
  if (r.o.get_int("max_steps") > 0 && r.o.get_int("max_steps") < total) total = r.o.get_int("max_steps");
  Trainer trainer(r.obj.model, r.optim, r.schedule, make_trainer_config(r, total));
  // the parameters its optimizer holds: model:unfreeze in a callback may not
  // add one, which would report itself trainable and never train
  const TrainedParameters trained(model, [&] {
    std::vector<at::Tensor> held;
    for (const auto& p : model.parameters()) if (p.requires_grad()) held.push_back(p);
    return held;
  }());
  if (!cuda && (r.o.get_int("empty_cache_every") > 0 || r.o.get_double("memory_fraction") > 0) && !r.quiet)
    err_line(L + ": empty_cache_every and memory_fraction act on CUDA memory; on " + r.device + " they have no effect");
  const bool coupled = coupled_windows(model) != nullptr;
  if (coupled && !r.quiet)
    err_line(strf("%s: the model's loss couples the samples of a window: computed exactly over each window of "
                  "micro_batch x accumulate x %d ranks, embeddings first, then backward per micro-batch (two forward "
                  "passes each)",
                  L.c_str(), world));
  if (r.micro_auto) std::tie(r.micro_batch, r.accumulate) = fit_micro_batch(trainer, r, per_rank_batch, r.o.get_int("batch_size"));
  // evaluation holds no gradients, but runs the training micro-batch unless told
  const std::int64_t eval_micro = r.o.has("eval_micro_batch") ? r.o.get_int("eval_micro_batch") : r.micro_batch;
  Loader loader(r.obj.data, loader_config(r.micro_batch, r.accumulate));
  Group* group = trainer.group();
  const std::int64_t coll0 = group ? group->collectives() : 0, bytes0 = group ? group->bytes() : 0,
                     sent0 = group ? group->sent() : 0;
  std::int64_t epoch = 0, first_window = 0;
  if (!out.empty() && r.rank0) {
    std::error_code ec;
    fs::create_directories(out, ec);
    if (ec) throw Error(L + ": cannot create run folder " + out.string() + ": " + ec.message());
  }
  if (r.o.get_bool("resume")) {
    if (!resume_from.empty()) {
      const auto extra = trainer.load(resume_from, resume_state);
      epoch = extra.value("epoch", std::int64_t{0});
      first_window = extra.value("window", std::int64_t{0});
      const std::string prior_status = prior.meta.is_object() ? prior.meta.value("status", "") : "";
      if (prior_status == "stopped") {
        // stopped on purpose (patience, or a callback): it ended there
        if (!r.quiet)
          err_line(strf("wick: the run in %s stopped at step %lld (%s): nothing to resume (overwrite = true starts it "
                        "again); its files are unchanged",
                        out.c_str(), static_cast<long long>(trainer.steps()),
                        prior.meta.contains("stopped") && prior.meta["stopped"].is_object()
                            ? prior.meta["stopped"].value("by", std::string("?")).c_str()
                            : "?"));
        nlohmann::json done = {{"status", "stopped"}, {"steps", trainer.steps()}, {"history", nlohmann::json::array()},
                               {"skipped_steps", trainer.skipped_steps()}, {"checkpoint", resume_from.string()},
                               {"out", out.string()}, {"already_finished", true}};
        for (const char* k : {"final_loss", "best_loss", "eval", "micro_batch", "accumulate", "memory", "peak_memory",
                              "seconds", "loss_scale", "split", "skipped_files", "skipped_items", "best", "stopped"})
          if (prior.meta.contains(k)) done[k] = prior.meta[k];
        return done;
      }
      if (prior_status == "finished" && trainer.steps() >= total) {
        // a finished run stays as it was; the model holds its final weights
        if (!r.quiet)
          err_line(strf("wick: the run in %s finished at step %lld of %lld: nothing to resume (raise epochs or "
                        "max_steps to train further); its files are unchanged",
                        out.c_str(), static_cast<long long>(trainer.steps()), static_cast<long long>(total)));
        nlohmann::json done = {{"status", "finished"}, {"steps", trainer.steps()}, {"history", nlohmann::json::array()},
                               {"skipped_steps", trainer.skipped_steps()}, {"checkpoint", resume_from.string()},
                               {"out", out.string()}, {"already_finished", true}};
        for (const char* k : {"final_loss", "best_loss", "eval", "micro_batch", "accumulate", "memory", "peak_memory",
                              "seconds", "loss_scale", "split", "skipped_files", "skipped_items"})
          if (prior.meta.contains(k)) done[k] = prior.meta[k];
        return done;
      }
      if (!r.quiet)
        err_line(strf("wick: resuming from %s (step %lld)", resume_from.c_str(), static_cast<long long>(trainer.steps())));
    } else if (!r.quiet) {
      err_line("wick: resume = true but " + ckpt_dir.string() + " holds no checkpoint; starting fresh");
    }
  }

  // The monitored evaluation metric: the best checkpoints and early stopping.
  // Its count rides in every checkpoint, so a resume goes on counting.
  struct Monitor {
    std::string name, mode;
    int keep_best = 1;
    std::int64_t patience = 0;
    double min_delta = 0;
    std::optional<double> best;
    std::int64_t best_step = 0, bad = 0;
  };
  std::optional<Monitor> mon;
  if (r.o.has("monitor")) {
    Monitor m;
    m.name = r.o.get_string("monitor");
    const bool loss = m.name.size() >= 4 && m.name.compare(m.name.size() - 4, 4, "loss") == 0;
    m.mode = r.o.has("monitor_mode") ? r.o.get_string("monitor_mode") : (loss ? "min" : "max");
    m.keep_best = static_cast<int>(r.o.get_int("keep_best"));
    m.patience = r.o.get_int("patience");
    m.min_delta = r.o.get_double("min_delta");
    const auto e = resume_state.is_object() ? resume_state.value("extra", nlohmann::json::object()) : nlohmann::json::object();
    if (e.contains("monitor") && e["monitor"].value("name", "") == m.name && e["monitor"].value("mode", "") == m.mode &&
        e["monitor"].contains("best")) {
      m.best = e["monitor"]["best"].get<double>();
      m.best_step = e["monitor"].value("best_step", std::int64_t{0});
      m.bad = e["monitor"].value("bad_evals", std::int64_t{0});
    }
    mon = m;
  }
  // the recipe's callbacks: on rank 0 unless asked for on every rank
  const RunCallbacks& cb = req.callbacks;
  const bool call_here = r.rank0 || r.o.get_bool("callbacks_every_rank");
  std::optional<nlohmann::json> stop_request;  // {by, reason, step} from a callback or patience
  std::vector<std::pair<std::string, double>> save_log;  // on_save's scalars, for the next step's record
  auto take_reply = [&](const CallbackReply& reply, const char* by, nlohmann::json* rec) {
    for (const auto& [k, v] : reply.log) {
      if (!rec) {
        save_log.emplace_back(k, v);
        continue;
      }
      if (rec->contains(k))
        throw Error(strf("%s: %s logged '%s', which the record holds already (its own %s)", L.c_str(), by, k.c_str(),
                         k.c_str()));
      (*rec)[k] = v;
    }
    if (reply.stop && !stop_request)
      stop_request = nlohmann::json{{"by", by}, {"reason", reply.reason}, {"step", trainer.steps()}};
  };
  // a stop asked on one rank (a callback's; patience's, from evaluations each
  // rank makes alike), agreed by all: every rank calls this at the same points
  auto agreed_stop = [&] {
    bool s = stop_request.has_value();
    if (world > 1) s = group->sum(s ? 1 : 0, "agreeing on a stop (a callback's, or patience's)") > 0;
    if (s && !stop_request) stop_request = nlohmann::json{{"by", "another rank's callback"}, {"reason", ""},
                                                          {"step", trainer.steps()}};
    return s;
  };

  // observers: the run folder (rank 0), the progress line, the caller's
  std::vector<std::shared_ptr<Observer>> observers;
  std::shared_ptr<ProgressObserver> progress;
  if (!out.empty() && r.rank0) observers.push_back(std::make_shared<RunLogObserver>(out.string()));
  if (!r.quiet) {
    progress = std::make_shared<ProgressObserver>(r.o.get_int("log_every"));
    observers.push_back(progress);
  }
  for (const auto& o : req.observers) observers.push_back(o);
  // on_step sees each step as it ends: its numbers are read every step
  const bool every_step = static_cast<bool>(cb.on_step) ||
                          std::any_of(observers.begin(), observers.end(), [](const auto& o) { return o->wants_every_step(); });

  RunStart start;
  start.total_steps = total;
  start.start_step = trainer.steps();
  start.item_name = model.item_name();
  start.device = r.device;
  start.recipe = req.recipe;
  start.options = options_json(r);
  std::int64_t params = 0;
  for (const auto& p : model.parameters()) params += p.numel();
  start.options["micro_batch"] = r.micro_batch;
  start.options["accumulate"] = r.accumulate;
  start.options["parameters"] = params;
  start.options["samples"] = data.size();
  start.options["world_size"] = world;
  start.extra = {{"device", r.device}, {"precision", r.o.get_string("precision")}, {"world_size", world},
                 {"item_name", model.item_name()}, {"loss_scope", coupled ? "window" : "micro_batch"}};

  nlohmann::json run = {{"status", "running"}, {"history", nlohmann::json::array()}};
  if (!out.empty()) run["out"] = out.string();
  const double t_start = now_seconds();
  std::int64_t peak = 0, step_peak = 0, offload_peak = 0;
  std::vector<PendingStep> pending;
  nlohmann::json last;
  std::optional<double> best;
  bool started = false;

  // Reads the pending steps' numbers in one device read and hands their
  // records to the observers, in order.
  auto flush = [&] {
    if (pending.empty()) return;
    std::vector<StepStats*> ptrs;
    for (auto& p : pending) ptrs.push_back(&p.stats);
    trainer.resolve(ptrs);
    for (auto& p : pending) {
      nlohmann::json rec = record_of(p, cuda);
      if (!p.stats.skipped && std::isfinite(p.stats.loss) && (!best || p.stats.loss < *best)) best = p.stats.loss;
      for (const auto& [k, v] : save_log)
        if (!rec.contains(k)) rec[k] = v;
      save_log.clear();
      if (cb.on_step && call_here) take_reply(cb.on_step(rec), "on_step", &rec);
      for (auto& o : observers) o->on_step(rec);
      run["history"].push_back(std::move(rec));
    }
    if (!pending.empty()) last = run["history"].back();
    for (auto& o : observers) o->on_steps_delivered();
    pending.clear();
  };
  // value: the monitored metric of an evaluation just made (a checkpoint after it)
  auto save = [&](const char* why, std::optional<double> value = std::nullopt) {
    if (ckpt_dir.empty()) return;
    flush();
    std::int64_t e = loader.epoch(), w = loader.window();
    if (w >= per_epoch) e += 1, w = 0;
    nlohmann::json extra = {{"epoch", e}, {"window", w}, {"reason", why}, {"world_size", world},
                            {"micro_batch", r.micro_batch}, {"accumulate", r.accumulate},
                            {"samples", static_cast<std::int64_t>(data.size())},
                            {"shuffle", r.o.get_bool("shuffle")}, {"seed", r.o.get_int("seed")}};
    if (mon) {
      nlohmann::json m = {{"name", mon->name}, {"mode", mon->mode}, {"bad_evals", mon->bad}};
      if (value && std::isfinite(*value)) m["value"] = *value;
      if (mon->best) m["best"] = *mon->best, m["best_step"] = mon->best_step;
      extra["monitor"] = m;
    }
    run["checkpoint"] = trainer
                            .save(ckpt_dir, extra, static_cast<int>(r.o.get_int("keep_checkpoints")),
                                  mon ? mon->keep_best : 0)
                            .string();
    if (cb.on_save) {
      if (call_here) take_reply(cb.on_save(run["checkpoint"].get<std::string>()), "on_save", nullptr);
    }
  };
  // the monitored metric of an evaluation record; true: patience ran out
  auto watch = [&](const nlohmann::json& rec) {
    std::string key = mon->name;
    if (!rec.contains(key) && key.rfind("eval_", 0) == 0) key = key.substr(5);
    if (!rec.contains(key) || !rec[key].is_number()) {
      std::string have;
      for (auto it = rec.begin(); it != rec.end(); ++it)
        if (it->is_number() && it.key() != "step" && it.key() != "items")
          have += (have.empty() ? "eval_" : ", eval_") + it.key();
      throw Error(L + ": option 'monitor': the evaluation has no metric '" + mon->name + "' (it has " + have + ")");
    }
    const double v = rec[key].get<double>();
    const bool improved = std::isfinite(v) && (!mon->best || (mon->mode == "min" ? v < *mon->best - mon->min_delta
                                                                                  : v > *mon->best + mon->min_delta));
    if (improved) {
      mon->best = v;
      mon->best_step = trainer.steps();
      mon->bad = 0;
    } else {
      ++mon->bad;
    }
    save("eval", v);
    if (mon->patience > 0 && mon->bad >= mon->patience && !stop_request) {
      stop_request = nlohmann::json{
          {"by", "patience"},
          {"reason", strf("%s did not improve on %.6g (step %lld) in %lld evaluations", mon->name.c_str(), *mon->best,
                          static_cast<long long>(mon->best_step), static_cast<long long>(mon->bad))},
          {"step", trainer.steps()}};
    }
  };
  auto do_eval = [&] {
    flush();
    EvalStats s = trainer.evaluate(r.obj.eval_data, eval_micro);
    nlohmann::json rec = {{"loss", s.loss}, {"items", s.items}, {"step", trainer.steps()}, {"eval", true}};
    if (s.oom_retries > 0) {
      rec["oom_retries"] = s.oom_retries;
      if (!r.quiet)
        err_line(strf("%s: evaluation ran out of memory at micro-batch %lld: it ran in %lld parts of each", L.c_str(),
                      static_cast<long long>(eval_micro), static_cast<long long>(s.split)));
    }
    for (const auto& [k, v] : s.metrics) rec[k] = v;
    if (r.o.get_bool("eval_ema")) {
      // the same data with the averaged weights
      EvalStats e;
      trainer.with_ema([&] { e = trainer.evaluate(r.obj.eval_data, eval_micro); });
      rec["ema_loss"] = e.loss;
      for (const auto& [k, v] : e.metrics) rec["ema_" + k] = v;
    }
    if (cb.on_eval && call_here) take_reply(cb.on_eval(rec), "on_eval", &rec);
    run["eval"] = rec;
    for (auto& o : observers) o->on_eval(rec);
    if (mon) watch(rec);
  };
  auto summary_so_far = [&] {
    nlohmann::json s = {{"steps", trainer.steps()}, {"seconds", now_seconds() - t_start}};
    if (last.is_object()) s["final_loss"] = last["loss"];
    return s;
  };

  bool interrupted_run = false;
  int signal = 0;
  std::int64_t held_before = 0;
  std::pair<std::int64_t, std::int64_t> resident_now{0, 0};  // the last read of the process's memory
  try {
    for (auto& o : observers) o->on_start(start);
    started = true;
    reset_peaks();  // the run's peak, from its first step
    {
      // tensors held before the first step besides weights and optimizer
      // state (data sets loaded in memory, ...): not activations
      const auto bd = trainer.memory_breakdown();
      auto m = memory_stats(cuda);
      held_before = std::max<std::int64_t>(0, (cuda ? m["cuda_allocated"] : m["cpu_tensors"]) - bd.at("weights") -
                                                  bd.at("gradients") - bd.at("optimizer"));
    }
    {
      auto m0 = memory_stats(false);
      resident_now = {m0["resident"], m0["peak_resident"]};
    }
    const std::int64_t log_every = r.o.get_int("log_every");
    const std::int64_t save_every = r.o.get_int("save_every"), eval_every = r.o.get_int("eval_every");
    while (trainer.steps() < total && epoch < epochs) {
      loader.start_epoch(epoch, first_window);
      first_window = 0;
      while (trainer.steps() < total) {
        auto window = loader.next_window();
        if (!window) break;
        const std::int64_t split_before = trainer.split();
        reset_peaks();  // each step's own peak; evaluation and saving between steps are not training memory
        PendingStep p;
        p.stats = trainer.step(*window, /*resolve_now=*/false);
        window.reset();  // now: a window can be large
        p.epoch = epoch;
        p.time = now_seconds() - t_start;
        // the process's figures (a read of /proc) only on steps whose numbers are read now
        const std::int64_t n = p.stats.step;
        const bool read_now = every_step || n % log_every == 0 || n == 1 || p.stats.stop || n == total;
        p.memory = memory_stats(cuda, read_now || cuda);
        if (!cuda) {
          if (read_now) resident_now = {p.memory["resident"], p.memory["peak_resident"]};
          p.memory["resident"] = resident_now.first;
          p.memory["peak_resident"] = resident_now.second;
        }
        const std::int64_t now_peak = cuda ? p.memory["cuda_peak"] : p.memory["peak_resident"];
        peak = std::max(peak, now_peak);
        step_peak = std::max(step_peak, cuda ? p.memory["cuda_peak"] : p.memory["cpu_tensors_peak"]);
        offload_peak = std::max(offload_peak, host_offload_memory().peak);
        const StepStats& s = p.stats;
        if (s.split > split_before && r.rank0)
          note(strf("%s: out of memory in step %lld: micro_batch %lld -> %s, accumulate %lld -> %lld (the same batch); "
                    "the window was redone from its start",
                    L.c_str(), static_cast<long long>(s.step), static_cast<long long>(r.micro_batch),
                    r.micro_batch % s.split == 0 ? std::to_string(r.micro_batch / s.split).c_str()
                                                 : ("~" + std::to_string((r.micro_batch + s.split - 1) / s.split)).c_str(),
                    static_cast<long long>(r.accumulate), static_cast<long long>(r.accumulate * s.split)));
        const bool stop = s.stop;
        const std::int64_t step = s.step;
        const bool skipped = s.skipped;
        pending.push_back(std::move(p));
        if (read_now) flush();
        if (skipped && r.rank0 && !r.quiet) {
          flush();
          note(strf("%s: step %lld skipped: inf/nan gradients at loss scale %g", L.c_str(), static_cast<long long>(step),
                    last.value("loss_scale", 0.0)));
        }
        // agreed over all ranks inside trainer.step, so every rank stops after the same step
        if (stop) {
          interrupted_run = true;
          signal = interrupt_signal();
          break;
        }
        const bool eval_now = r.obj.eval_data && eval_every > 0 && step % eval_every == 0 && step < total;
        // with a monitor, the evaluation saves (with its metric) in place of a plain save
        if (save_every > 0 && step % save_every == 0 && step < total && !(mon && eval_now)) save("every");
        if (eval_now) do_eval();
        // every rank reaches this with the same condition: the agreement is a collective
        if ((cb.any() || (mon && eval_now)) && agreed_stop()) break;
      }
      if (interrupted_run || stop_request) break;
      ++epoch;
    }
    flush();
    if (progress) progress->finish_line();
    if (interrupted_run) {
      signal_honoured();
      save("interrupted");
      run["status"] = "interrupted";
      if (r.rank0)
        err_line(strf("wick: %s at step %lld%s",
                      signal == 15 ? "SIGTERM" : signal == 2 ? "SIGINT" : "a signal on another rank",
                      static_cast<long long>(trainer.steps()),
                      run.contains("checkpoint") ? ("; checkpoint saved to " + run["checkpoint"].get<std::string>()).c_str() : ""));
    } else if (stop_request && (*stop_request)["by"] == "patience") {
      // the evaluation that ran out of patience saved its checkpoint
      run["status"] = "stopped";
    } else {
      const bool stopped = stop_request.has_value();
      if (r.obj.eval_data) do_eval();
      if (!mon) save("end");  // with a monitor the evaluation saved
      if (!stopped) stop_request.reset();  // at the end, patience and callbacks have nothing left to stop
      run["status"] = stopped ? "stopped" : "finished";
    }
    for (const auto& [k, v] : save_log) run["logged"][k] = v;  // on_save's, after the last step
    if (stop_request) {
      run["stopped"] = *stop_request;
      if (r.rank0 && !r.quiet)
        err_line(strf("%s: stopped after step %lld by %s%s%s", L.c_str(),
                      static_cast<long long>((*stop_request)["step"].get<std::int64_t>()),
                      (*stop_request)["by"].get<std::string>().c_str(),
                      (*stop_request)["reason"].get<std::string>().empty() ? "" : ": ",
                      (*stop_request)["reason"].get<std::string>().c_str()));
    }
    if (trainer.has_ema() && !out.empty()) {
      // the averaged weights, loadable by model:load (fp32 where they train)
      // (ZeRO-3: every rank sends its pieces of the average, rank 0 writes)
      if (r.rank0 || trainer.partitioned()) trainer.save_ema(out / "ema.safetensors");
      run["ema"] = (out / "ema.safetensors").string();
    }
    if (mon && mon->best) {
      run["best"] = {{"metric", mon->name}, {"mode", mon->mode}, {"value", *mon->best}, {"step", mon->best_step}};
      std::error_code ec;
      std::string name;
      if (std::ifstream in(ckpt_dir / "best"); in && std::getline(in, name) && fs::exists(ckpt_dir / name, ec))
        run["best"]["checkpoint"] = (ckpt_dir / name).string();
      run["best_step"] = mon->best_step;
    }
  } catch (const c10::Error& e) {
    if (started)
      for (auto& o : observers) o->on_failure(e.what_without_backtrace(), summary_so_far());
    throw Error(e.what_without_backtrace());
  } catch (const std::exception& e) {
    if (started)
      for (auto& o : observers) o->on_failure(e.what(), summary_so_far());
    throw;
  }

  run["steps"] = trainer.steps();
  run["skipped_steps"] = trainer.skipped_steps();
  if (trainer.loss_scale() > 0) run["loss_scale"] = trainer.loss_scale();
  // after out-of-memory splits: the micro-batch and accumulation actually used
  run["micro_batch"] = (r.micro_batch + trainer.split() - 1) / trainer.split();
  run["accumulate"] = r.accumulate * trainer.split();
  if (trainer.split() > 1) run["split"] = trainer.split();
  {
    // Where the peak went: weights, gradients, optimizer state, data buffers,
    // and activations (the rest of the peak).
    const auto bd = trainer.memory_breakdown();
    auto m = memory_stats(cuda);
    const std::int64_t data_bytes = loader.buffered_bytes();
    const std::int64_t held =
        bd.at("weights") + bd.at("gradients") + bd.at("optimizer") + (cuda ? 0 : data_bytes) + held_before;
    run["memory"] = {{"device", r.device},           {"peak", step_peak},
                     {"weights", bd.at("weights")},  {"master_weights", bd.at("master_weights")},
                     {"gradients", bd.at("gradients")},
                     {"optimizer", bd.at("optimizer")}, {"data", data_bytes},
                     {"other", held_before},         {"activations", std::max<std::int64_t>(0, step_peak - held)},
                     // offload_activations: the block inputs that waited in host memory, at their most
                     {"offloaded", offload_peak},
                     {"resident_peak", m["peak_resident"]},
                     // CUDA: the allocator's most reserved, and the process's whole device
                     // memory at that moment (context and workspaces outside the allocator
                     // counted as they stand at the end of the run)
                     {"reserved_peak", m["cuda_reserved_peak"]},
                     {"device_peak", m.count("cuda_device_used")
                                         ? m["cuda_device_used"] - m["cuda_reserved"] + m["cuda_reserved_peak"]
                                         : 0},
                     // one rank's own figures: with shard, its part of the optimizer state and gradients
                     {"rank", group ? group->rank() : 0},
                     {"ranks", group ? group->size() : 1}};
  }
  // media data sets count the files they skipped (each named once when it
  // happened), the text data set the documents with nothing to learn from
  const auto attrs = data.attributes();
  for (const char* k : {"skipped_files", "skipped_items"})
    if (auto it = attrs.find(k); it != attrs.end() && it->second.is_number() && it->second.as_double() > 0)
      run[k] = it->second.as_double();
  if (last.is_object()) run["final_loss"] = last["loss"];
  if (best) run["best_loss"] = *best;
  run["peak_memory"] = peak;
  run["seconds"] = now_seconds() - t_start;
  run["interrupted"] = interrupted_run;
  run["comm"] = {{"collectives", group ? group->collectives() - coll0 : 0},
                 {"bytes", group ? group->bytes() - bytes0 : 0},
                 {"sent", group ? group->sent() - sent0 : 0}};
  run["shard"] = group ? to_string(trainer.config().shard) : "none";
  run["epochs"] = epochs;
  run["seed"] = r.o.get_int("seed");
  const auto ck = trainer.checkpointed_blocks();
  run["checkpointing"] = ck.empty() ? nlohmann::json(false) : nlohmann::json(ck);
  run["host_reads"] = trainer.host_reads();
  trainer.gather_weights_back();  // shard = "parameters": every rank, here, at once
  for (auto& o : observers) o->on_end(run);
  return run;
}

void plan_training(const RunRequest& req, std::int64_t device_memory_given) {
  Resolved r = resolve(req);
  const std::string L = "wick plan";
  // --ranks N: every rank measures; the figures are those of the rank whose
  // peak is highest, and only rank 0 prints
  const std::shared_ptr<Group> group = Group::world(r.device);
  const bool rank0 = !group || group->rank() == 0;
  const int world = group ? group->size() : 1;
  const std::string given_shard = r.o.get_string("shard");
  const bool cuda = is_cuda(r.device);
  const std::int64_t per_rank = r.micro_auto ? r.o.get_int("batch_size") : r.micro_batch * r.accumulate;
  const std::int64_t micro = r.micro_auto ? per_rank : r.micro_batch;
  const double avail = static_cast<double>(device_memory_given > 0 ? device_memory_given : device_memory(r.device));
  const auto blocks = r.obj.model->blocks();
  const std::string precision = r.o.get_string("precision");
  // bf16-true and fp16-true convert the weights as the first row's trainer
  // is made: every row keeps that precision (no row tries another), so the
  // rows after it meet the weights as the recipe would train them
  const Value given_ck = r.o.at("checkpointing");
  struct Setting {
    std::string precision;
    Value checkpointing;
    std::int64_t micro;
    std::string shard;
  };
  struct Row {
    std::string name;
    Setting o;
    bool ok = false;
    std::string err;
    double peak = 0, seconds = 0;
    std::map<std::string, std::int64_t> breakdown;
  };
  std::vector<Row> rows;
  std::optional<std::int64_t> host_only;
  auto measure = [&](Row& row) {
    std::map<std::string, Value> opts = r.o.values();
    opts["precision"] = Value(row.o.precision);
    opts["checkpointing"] = row.o.checkpointing;
    opts["shard"] = Value(row.o.shard);
    opts["on_oom"] = Value("fail");
    Options o = validate_run_options(L, [&] {
      std::map<std::string, Value> g;
      for (const auto& opt : run_options())
        if (opt.run && !opts[opt.name].is_nil()) g[opt.name] = opts[opt.name];
      return g;
    }(), {}, false);
    Resolved rr = r;
    rr.o = o;
    Trainer trainer(r.obj.model, r.optim, nullptr, make_trainer_config(rr, 1));
    // each row from no optimizer state: a shard row's pieces must not meet the
    // whole tensors' state an earlier row left in the shared optimizer
    r.optim->load_state({});
    if (!host_only) {
      const auto b0 = trainer.memory_breakdown();
      auto m0 = memory_stats(cuda);
      host_only = cuda ? 0 : std::max<std::int64_t>(0, m0["cpu_tensors"] - b0.at("weights") - b0.at("optimizer"));
    }
    // two micro-batches when the recipe accumulates: the second holds the
    // summed gradients beside its own, as in training
    const std::int64_t m = std::min(row.o.micro, r.obj.data->size());
    const std::int64_t n = std::min(per_rank / row.o.micro > 1 ? 2 * m : m, r.obj.data->size());
    const auto window = data_window(*r.obj.data, n, m);
    trainer.step(window);  // first: allocates the optimizer state
    reset_peaks();
    // the median of three steps: one step's noise (another process on the
    // core) must not decide between settings
    std::vector<double> times;
    for (int k = 0; k < 3; ++k) {
      const double t0 = now_seconds();
      try {
        trainer.step(window);
        row.ok = true;
      } catch (const c10::Error& e) {
        row.ok = false;
        row.err = e.what_without_backtrace();
      } catch (const std::exception& e) {
        row.ok = false;
        row.err = e.what();
      }
      times.push_back(now_seconds() - t0);
    }
    std::sort(times.begin(), times.end());
    const double dt = times[1];
    row.breakdown = trainer.memory_breakdown();
    row.peak = static_cast<double>(tensor_peak(cuda) - *host_only);
    trainer.gather_weights_back();  // a shard = "parameters" row: the model whole again for the next row
    row.seconds = dt / static_cast<double>(n) * static_cast<double>(per_rank);
    if (group) {  // the rank holding the most: its peak and breakdown; the slowest rank's time
      const auto& bd = row.breakdown;
      at::Tensor mine = at::tensor({row.ok ? 1.0 : 0.0, row.peak, static_cast<double>(bd.at("weights")),
                                    static_cast<double>(bd.at("gradients")), static_cast<double>(bd.at("optimizer")),
                                    static_cast<double>(bd.at("master_weights")), row.seconds},
                                   at::kDouble)
                             .to(group->device());
      at::Tensor all = at::empty({world * mine.numel()}, mine.options());
      group->all_gather(all, mine, "wick plan: gathering the ranks' figures");
      all = all.cpu().view({world, mine.numel()});
      const auto most = all.select(1, 1).argmax().item<std::int64_t>();
      const auto f = [&](int k) { return all[most][k].item<double>(); };
      const auto failed = all.select(1, 0).argmin().item<std::int64_t>();
      if (all[failed][0].item<double>() == 0 && row.ok) {
        row.ok = false;
        row.err = "failed on rank " + std::to_string(failed);
      }
      row.peak = f(1);
      row.breakdown["weights"] = static_cast<std::int64_t>(f(2));
      row.breakdown["gradients"] = static_cast<std::int64_t>(f(3));
      row.breakdown["optimizer"] = static_cast<std::int64_t>(f(4));
      row.breakdown["master_weights"] = static_cast<std::int64_t>(f(5));
      row.breakdown["rank"] = most;
      // the state column: the most any rank holds (weights + gradients +
      // optimizer), whichever rank had the highest peak (that one varies with
      // transient buffers, and with uneven pieces its state by a few KiB)
      row.breakdown["state"] = static_cast<std::int64_t>(
          (all.select(1, 2) + all.select(1, 3) + all.select(1, 4)).max().item<double>());
      row.seconds = all.select(1, 6).max().item<double>();
    }
  };
  auto add_row = [&](const std::string& name, Setting o) -> Row& {
    rows.push_back(Row{name, std::move(o)});
    Row& row = rows.back();
    try {
      measure(row);
    } catch (const c10::Error& e) {
      row.ok = false;
      row.err = e.what_without_backtrace();
    } catch (const std::exception& e) {
      row.ok = false;
      row.err = e.what();
    }
    return row;
  };
  rows.reserve(64);
  const std::string S = given_shard;
  const Row base = add_row("as given", {precision, given_ck, micro, S});
  if (!base.ok) throw Error(L + ": one step of the recipe as given failed: " + base.err);
  if (precision == "fp32") add_row("precision = \"bf16-mixed\"", {"bf16-mixed", given_ck, micro, S});
  const bool ck_all = given_ck.is_bool() && given_ck.as_bool();
  if (!blocks.empty() && !ck_all) add_row("checkpointing = true", {precision, Value(true), micro, S});
  const bool halve = micro > 1 && micro % 2 == 0;
  if (halve)
    add_row(strf("micro_batch = %lld, accumulate x 2", static_cast<long long>(micro / 2)), {precision, given_ck, micro / 2, S});
  // several ranks: each setting of shard the recipe does not use
  for (const char* sh : {"none", "optimizer", "gradients", "parameters"})
    if (world > 1 && sh != S) add_row(strf("shard = \"%s\"", sh), {precision, given_ck, micro, sh});
  const std::string mixed = precision == "fp32" ? "bf16-mixed" : precision;
  const Value all_ck = blocks.empty() ? given_ck : Value(true);
  // the shard setting that holds the least
  const std::string least = world > 1 ? "parameters" : S;
  add_row("all of these", {mixed, all_ck, halve ? micro / 2 : micro, least});

  const auto& bd = base.breakdown;
  // every rank measures the same rows (candidates below too); rank 0 prints
  if (rank0) std::printf("wick plan: %s on %s, micro_batch %lld x accumulate %lld (batch %lld per rank), precision %s\n",
        req.recipe.empty() ? "recipe" : req.recipe.c_str(), r.device.c_str(), static_cast<long long>(micro),
        static_cast<long long>(per_rank / micro), static_cast<long long>(per_rank), precision.c_str());
  if (world > 1 && rank0)
    std::printf("  measured on %d ranks, shard = \"%s\": each figure is the rank holding the most (rank %lld as given)\n",
          world, S.c_str(), static_cast<long long>(bd.at("rank")));
  if (rank0) std::printf("  one step as given: peak %s = weights %s + gradients %s + optimizer %s + activations and data %s\n",
              fmt_bytes(base.peak).c_str(), fmt_bytes(static_cast<double>(bd.at("weights"))).c_str(),
              fmt_bytes(static_cast<double>(bd.at("gradients"))).c_str(),
              fmt_bytes(static_cast<double>(bd.at("optimizer"))).c_str(),
              fmt_bytes(std::max(0.0, base.peak - static_cast<double>(bd.at("weights") + bd.at("gradients") +
                                                                       bd.at("optimizer"))))
                  .c_str());
  if (rank0) std::printf("  estimate as given: %lld bytes on the device\n", static_cast<long long>(base.peak));
  // state: weights, gradients and optimizer state held at the step (what shard divides)
  auto state_of = [](const Row& row) {
    const auto& b = row.breakdown;
    if (const auto it = b.find("state"); it != b.end()) return static_cast<double>(it->second);
    return static_cast<double>(b.at("weights") + b.at("gradients") + b.at("optimizer"));
  };
  if (rank0) std::printf("  %-44s %12s %8s %14s %12s\n", "setting", "peak", "saving", "time per batch", "state");
  for (const auto& row : rows) {
    if (!rank0) break;
    if (row.ok)
      std::printf("  %-44s %12s %7.0f%% %13.2fx %12s\n", row.name.c_str(), fmt_bytes(row.peak).c_str(),
                  100 * (1 - row.peak / base.peak), row.seconds / base.seconds, fmt_bytes(state_of(row)).c_str());
    else
      std::printf("  %-44s failed: %s\n", row.name.c_str(), row.err.substr(0, row.err.find('\n')).c_str());
  }
  if (avail > 0) {
    const double budget = 0.9 * avail;
    // every candidate that keeps the batch, measured; the fastest that fits wins
    auto find = [&](const Setting& o) -> const Row& {
      for (const auto& x : rows)
        if (x.o.precision == o.precision && x.o.checkpointing.repr() == o.checkpointing.repr() && x.o.micro == o.micro &&
            x.o.shard == o.shard)
          return x;
      return add_row("candidate", o);
    };
    std::vector<Setting> cands;
    // each with the recipe's shard, then (several ranks) with ZeRO-2's (no
    // more traffic than none) and ZeRO-3's (the least memory)
    auto cand = [&](const std::string& prec, const Value& ck, std::int64_t m) {
      cands.push_back({prec, ck, m, S});
      for (const std::string sh : {"gradients", "parameters"})
        if (world > 1 && sh != S) cands.push_back({prec, ck, m, sh});
    };
    cand(precision, given_ck, micro);
    cand(mixed, given_ck, micro);
    if (!blocks.empty()) {
      cand(precision, Value(true), micro);
      cand(mixed, Value(true), micro);
    }
    for (std::int64_t m = micro; m > 1;) {
      m = m / 2;
      while (per_rank % m != 0) --m;
      cand(precision, given_ck, m);
      cand(mixed, all_ck, m);
    }
    if (rank0 && base.ok && base.peak <= budget)
      std::printf("the recipe as given fits %s (90%%: %s): peak %s\n", fmt_bytes(avail).c_str(),
                  fmt_bytes(budget).c_str(), fmt_bytes(base.peak).c_str());
    std::optional<Row> choice;
    for (const auto& o : cands) {
      const Row x = find(o);
      // another setting wins only when clearly faster: the settings as given
      // (the first candidate) keep a tie
      if (x.ok && x.peak <= budget && (!choice || x.seconds < 0.9 * choice->seconds)) choice = x;
      // smaller micro-batches only get slower: stop once one fits
      if (choice && o.micro < micro) break;
    }
    if (choice) {
      const Value& ck = choice->o.checkpointing;
      std::string cks = ck.is_list() ? "{ " : ck.repr();
      if (ck.is_list()) {
        for (std::size_t i = 0; i < ck.as_list().size(); ++i) cks += (i ? ", " : "") + ck.as_list()[i].as_string();
        cks += " }";
      }
      const std::string shard_text = world > 1 ? ", shard = \"" + choice->o.shard + "\"" : "";
      if (rank0)
        std::printf("fastest that fits %s (90%%: %s): precision = \"%s\", checkpointing = %s, micro_batch = %lld, "
                    "accumulate = %lld%s (peak %s, the batch of %lld kept)\n",
                    fmt_bytes(avail).c_str(), fmt_bytes(budget).c_str(), choice->o.precision.c_str(), cks.c_str(),
                    static_cast<long long>(choice->o.micro), static_cast<long long>(per_rank / choice->o.micro),
                    shard_text.c_str(), fmt_bytes(choice->peak).c_str(), static_cast<long long>(per_rank));
    } else {
      if (rank0)
        std::printf("nothing tried fits %s: even one sample with bf16-mixed and checkpointing needs more; train fewer "
                  "parameters (lora), shorten sequences or shrink images\n",
                  fmt_bytes(avail).c_str());
    }
  } else {
    if (rank0) std::printf("no device memory given: --device-memory 8GiB suggests settings that fit\n");
  }
  std::fflush(stdout);
}

}  // namespace wick
