// wick.train's options resolved for a run: the command line's overrides, the
// objects typed, the device chosen, the ranks' fingerprint, and an automatic
// micro-batch measured on the device.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>

#include "observe/format.hpp"
#include "plugin/registry.hpp"
#include "train/run_internal.hpp"
#include "train/run_options.hpp"
#include "util/memory.hpp"
#include "util/system.hpp"

namespace wick {

void err_line(const std::string& s) {
  const std::string line = s + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

// A note between steps: on a terminal it first clears the redrawn progress line.
void note(const std::string& s) { err_line((::isatty(2) ? "\r\x1b[K" : "") + s); }

bool is_cuda(const std::string& device) { return device.rfind("cuda", 0) == 0; }

std::int64_t tensor_peak(bool cuda) {
  auto m = memory_stats(cuda, /*resident=*/false);
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

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  if (in) ss << in.rdbuf();
  return ss.str();
}

namespace {

nlohmann::json to_json(const Value& v) {
  switch (v.v.index()) {
    case 0: return nullptr;
    case 1: return v.as_bool();
    case 2: return v.as_int();
    case 3: return v.as_number();
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

}  // namespace

std::vector<std::string> taken_overrides(const RunRequest& req) {
  const auto ov = req.options.find("overrides");
  const bool apply = ov == req.options.end() || !ov->second.is_bool() || ov->second.as_bool();
  std::vector<std::string> out;
  if (!apply || !req.context) return out;
  for (const auto& [k, text] : req.context->args()) {
    if (k == "overrides") continue;  // the recipe's to say, not the command line's
    const bool known =
        std::any_of(run_options().begin(), run_options().end(), [&](const auto& o) { return o.name == k && o.run; });
    if (known && std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
  }
  return out;
}

namespace {

// The objects given, by their option names.
std::vector<std::string> object_names(const RunObjects& obj) {
  std::vector<std::string> objects;
  if (obj.model) objects.push_back("model");
  if (obj.data) objects.push_back("data");
  if (obj.optim) objects.push_back("optim");
  if (obj.schedule) objects.push_back("schedule");
  if (obj.eval_data) objects.push_back("eval_data");
  return objects;
}

// Command-line key=value pairs naming an option, read as it declares, over
// the recipe's values; returns those that changed a value ("k=v").
std::vector<std::string> apply_overrides(const RunRequest& req, const std::vector<std::string>& taken,
                                         std::map<std::string, Value>& given) {
  std::vector<std::string> overridden;
  if (!req.context) return overridden;
  for (const auto& [k, text] : req.context->args()) {
    if (std::find(taken.begin(), taken.end(), k) == taken.end()) continue;
    Value v = parse_run_option(k, text);
    auto it = given.find(k);
    if (it != given.end() && it->second.repr() == v.repr()) continue;
    given[k] = v;
    overridden.push_back(k + "=" + text);
  }
  return overridden;
}

// model, data and optim present; optim an optimizer, schedule a schedule
// (or a name, made here with warmup_steps).
void type_objects(Resolved& r, const std::map<std::string, Value>& given) {
  const std::string& L = r.label;
  for (const auto& [name, obj] : std::vector<std::pair<const char*, bool>>{
           {"model", bool(r.obj.model)}, {"data", bool(r.obj.data)}, {"optim", bool(r.obj.optim)}})
    if (!obj) throw Error(L + ": option '" + name + "' is required");
  r.optim = std::dynamic_pointer_cast<Optimizer>(r.obj.optim);
  if (!r.optim || r.obj.optim->object_kind() != ObjectKind::Optimizer)
    throw Error(L + ": option 'optim': expected an optimizer (sgd, adamw, ...), got a " +
                to_string(r.obj.optim->object_kind()));
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
}

// Whether some option names `key`: wick.train's or wick.trainer's, or a
// plugin's (any plugin found or named by path: a recipe may read a model's
// option after the run).
bool names_an_option(const std::string& key) {
  const auto& run = run_options();
  if (std::any_of(run.begin(), run.end(), [&](const auto& o) { return o.name == key; })) return true;
  for (const PluginDescriptor* d : registry().descriptors())
    if (std::any_of(d->options.begin(), d->options.end(), [&](const auto& o) { return o.name == key; })) return true;
  return false;
}

// A run starts: the keys it takes count as read by it, and the keys that are
// unread and name no option anywhere (a typo such as epoch=3) are named now,
// before a long run, not only after it. A key the recipe may still read
// (one naming some option) waits for the recipe's end.
void note_run_start(const RunRequest& req, const std::vector<std::string>& taken, bool rank0, const std::string& L) {
  if (!req.context) return;
  for (const auto& k : taken) req.context->read(k, RunContext::Reader::Run);
  const auto typos = req.context->report_unread([](const std::string& k) { return !names_an_option(k); });
  req.context->start_run();
  if (typos.empty() || !rank0) return;
  const bool one = typos.size() == 1;
  err_line("wick: warning: " + L + ": command-line " + (one ? "key " : "keys ") + join_pairs(typos) +
           (one ? " is" : " are") + " not used so far: no option of wick.train or of a plugin has " +
           (one ? "its name" : "their names") + " and the recipe has not read " + (one ? "it" : "them") +
           " from wick.args (`wick describe train` lists the options)");
}

void say_overrides(std::vector<std::string> overridden, const std::string& L) {
  if (overridden.empty()) return;
  std::sort(overridden.begin(), overridden.end());
  std::string s;
  for (const auto& x : overridden) s += (s.empty() ? "" : " ") + x;
  err_line(L + ": from the command line: " + s);
}

// Checkpointing against the model: every name a block of it, some block to
// checkpoint at all. (The rule between the options, offload_activations
// needing checkpointing, is the schema's.)
void check_checkpointing(const Resolved& r) {
  const auto blocks = r.obj.model->blocks();
  const Value& ck = r.o.at("checkpointing");
  if (ck.is_list()) {
    for (const auto& n : ck.as_list())
      if (std::find(blocks.begin(), blocks.end(), n.as_string()) == blocks.end()) {
        std::string known;
        for (const auto& b : blocks) known += (known.empty() ? "" : ", ") + b;
        throw Error(r.label + ": option 'checkpointing': the model has no block '" + n.as_string() + "' (its blocks: " +
                    (known.empty() ? "none" : known) + ")");
      }
  }
  if (!(ck.is_bool() && !ck.as_bool()) && blocks.empty())
    throw Error(r.label + ": option 'checkpointing': the model declares no blocks to checkpoint");
}

void warn_loss_scale(const Resolved& r, const std::map<std::string, Value>& given) {
  const Precision precision = parse_precision(r.o.get_string("precision"));
  const bool scale_given = std::any_of(given.begin(), given.end(), [](const auto& kv) {
    return kv.first.rfind("loss_scale", 0) == 0 && !kv.second.is_nil();
  });
  const bool fp16 = precision == Precision::FP16Mixed || precision == Precision::FP16True;
  if (scale_given && !fp16 && r.rank0)
    err_line(r.label + ": loss_scale applies to fp16 precisions only; with " + to_string(precision) +
             " it has no effect");
}

}  // namespace

Resolved resolve(const RunRequest& req) {
  Resolved r;
  r.label = req.label;
  r.obj = req.objects;
  std::map<std::string, Value> given = req.options;
  const auto taken = taken_overrides(req);
  const auto overridden = apply_overrides(req, taken, given);
  r.o = validate_run_options(r.label, given, object_names(r.obj));
  type_objects(r, given);
  r.dist = dist_env();
  r.rank0 = r.dist.rank == 0;
  r.quiet = r.o.get_bool("quiet") || !r.rank0;
  note_run_start(req, taken, r.rank0, r.label);
  if (!r.quiet) say_overrides(overridden, r.label);
  check_checkpointing(r);
  warn_loss_scale(r, given);
  r.device = resolve_device_option(r.label, r.o.get_string("device"), r.dist);
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
    if (!parse_enum(kOnOomNames, r.o.get_string("on_oom"), "on_oom"))
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
  const double fraction = r.o.get_number("memory_fraction");
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

}  // namespace wick
