#include "observe/profile.hpp"

#include <kineto/ActivityType.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <chrono>
#include <filesystem>
#include <map>
#include <set>
#include <unistd.h>
#include <vector>

#ifdef WICK_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "observe/format.hpp"
#include "wick/options.hpp"  // Error

namespace fs = std::filesystem;
namespace prof = torch::autograd::profiler;
namespace impl = torch::profiler::impl;

namespace wick {
namespace {

double wall_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The engine's scopes (RECORD_USER_SCOPE in run.cpp, trainer.cpp, window.cpp)
// and the phase each stands for.
const std::map<std::string, std::string>& phase_of() {
  static const std::map<std::string, std::string> m = {
      {"wick::data", "data"},           {"wick::forward", "forward"}, {"wick::backward", "backward"},
      {"wick::optimizer", "optimizer"}, {"wick::step", "step"},       {"wick::eval", "eval"},
      {"wick::save", "save"}};
  return m;
}

// An evaluation or a checkpoint that falls among the recorded steps: its
// time is said (phases) but its operators are not the steps'.
bool aside(const std::string& name) { return name == "wick::eval" || name == "wick::save"; }

// One profiler in the process: Kineto's state is the process's, so a second
// (a callback's wick.train inside a profiled run) would end the first's.
std::atomic<bool> g_profiling{false};

using libkineto::ActivityType;

struct Span {
  const prof::KinetoEvent* e;
  std::uint64_t start, end;
  std::uint64_t children = 0;  // the direct children's time
  bool aside = false;          // within an evaluation or a save
  unsigned phases = 0;         // the phases of its ancestors (bit i: phase_bit's)
};

// a phase's bit: a scope within a scope of the same phase (a callback's
// wick.train inside a step) is not counted twice
unsigned phase_bit(const std::string& name) {
  unsigned i = 0;
  for (const auto& [scope, phase] : phase_of()) {
    if (scope == name) return 1u << i;
    ++i;
  }
  return 0;
}

struct Sum {
  std::int64_t calls = 0;
  double self_ms = 0, total_ms = 0;
};

nlohmann::json top_rows(const std::map<std::string, Sum>& sums, std::int64_t steps, bool with_self, std::size_t top) {
  std::vector<std::pair<std::string, Sum>> rows(sums.begin(), sums.end());
  std::sort(rows.begin(), rows.end(), [&](const auto& a, const auto& b) {
    const double ka = with_self ? a.second.self_ms : a.second.total_ms, kb = with_self ? b.second.self_ms : b.second.total_ms;
    return ka != kb ? ka > kb : a.first < b.first;
  });
  if (rows.size() > top) rows.resize(top);
  nlohmann::json out = nlohmann::json::array();
  const double n = static_cast<double>(std::max<std::int64_t>(steps, 1));
  for (const auto& [name, s] : rows) {
    nlohmann::json r = {{"name", name}, {"calls", static_cast<double>(s.calls) / n}, {"ms", s.total_ms / n}};
    if (with_self) r["self_ms"] = s.self_ms / n;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace

bool profiler_in_use() { return g_profiling.load() || prof::isProfilerEnabledInMainThread(); }

void quiet_kineto_on_cpu() {
  // Kineto (a CUDA build) asks for the GPUs when it starts and logs an ERROR
  // line where there are none; a run on the CPU leaves its logging to errors
  // of its own (kept if the user set the level). Called before the run's
  // threads start: setenv is not safe beside a getenv.
  ::setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
}

StepProfiler::~StepProfiler() {
  if (!active_) return;
  try {
    prof::disableProfiler();
  } catch (...) {
  }
  g_profiling = false;
}

void StepProfiler::start(bool cuda) {
  bool expected = false;
  if (!g_profiling.compare_exchange_strong(expected, true))
    throw Error("option 'profile': another run in this process is being profiled (a callback's wick.train inside a "
                "profiled run?); PyTorch's profiler records one at a time: profile one of them");
  std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  if (cuda) activities.insert(impl::ActivityType::CUDA);
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/false,
                                    /*profile_memory=*/false, /*with_stack=*/false, /*with_flops=*/false,
                                    /*with_modules=*/false);
  try {
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
  } catch (const c10::Error& e) {
    g_profiling = false;
    throw Error(std::string("option 'profile': PyTorch's profiler did not start: ") + e.what_without_backtrace());
  }
  active_ = true;
  cuda_ = cuda;
  t0_ = wall_now();
}

nlohmann::json StepProfiler::stop(const std::string& trace, std::int64_t steps) {
  if (!active_) throw Error("option 'profile': the profiler was not started");
#ifdef WICK_WITH_CUDA
  if (cuda_) c10::cuda::device_synchronize();  // the steps' kernels ended, so CUPTI has them
#endif
  const double seconds = wall_now() - t0_;
  active_ = false;
  std::unique_ptr<prof::ProfilerResult> result;
  try {
    result = prof::disableProfiler();
  } catch (const c10::Error& e) {
    g_profiling = false;
    throw Error(std::string("option 'profile': PyTorch's profiler did not stop: ") + e.what_without_backtrace());
  }
  g_profiling = false;
  // The trace, whole or not at all. One that cannot be written is said (in
  // the summary, for the run to print) and the run goes on: a trace is not
  // worth the training.
  std::string trace_error;
  if (!trace.empty()) {  // (none asked: the summary alone)
    const fs::path path(trace);
    const fs::path tmp = path.string() + ".partial." + std::to_string(::getpid());
    const fs::path kineto_tmp = tmp.string() + ".tmp";  // Kineto's own, renamed to tmp when whole
    std::error_code ec;
    if (path.has_parent_path()) fs::create_directories(path.parent_path(), ec);  // (a rank on another node)
    try {
      result->save(tmp.string());
    } catch (const c10::Error& e) {
      trace_error = e.what_without_backtrace();
    }
    if (trace_error.empty() && !fs::exists(tmp, ec))
      trace_error = "the profiler wrote nothing" + (ec ? ": " + ec.message() : std::string());
    if (trace_error.empty()) {
      fs::rename(tmp, path, ec);
      if (ec) trace_error = ec.message();
    }
    if (!trace_error.empty()) {
      std::error_code ignored;
      fs::remove(tmp, ignored);
      fs::remove(kineto_tmp, ignored);
    }
  }

  // Host operators: nested by time on each thread; an operator's self time is
  // its own less its direct children's. Device work: kernels, copies and
  // sets, which do not nest.
  std::map<std::uint64_t, std::vector<Span>> threads;
  std::map<std::string, Sum> host, device, phases;
  double device_ms = 0;
  std::map<std::string, Sum> runtime;  // CUDA runtime and driver calls (launches, copies, syncs)
  std::map<int, std::vector<std::pair<std::uint64_t, std::uint64_t>>> busy;  // device -> its work's intervals
  for (const auto& e : result->events()) {
    if (e.isAsync() || e.endNs() < e.startNs()) continue;
    const auto type = static_cast<ActivityType>(e.activityType());
    const double ms = static_cast<double>(e.durationNs()) / 1e6;
    switch (type) {
      case ActivityType::CPU_OP:
      case ActivityType::USER_ANNOTATION:
        threads[e.startThreadId()].push_back(Span{&e, e.startNs(), e.endNs()});
        break;
      case ActivityType::CONCURRENT_KERNEL:
      case ActivityType::GPU_MEMCPY:
      case ActivityType::GPU_MEMSET: {
        Sum& s = device[e.name()];
        ++s.calls;
        s.total_ms += ms;
        busy[e.deviceIndex()].emplace_back(e.startNs(), e.endNs());
        break;
      }
      case ActivityType::CUDA_RUNTIME:
      case ActivityType::CUDA_DRIVER: {
        // on the host, but not nested in the operators by thread: Kineto gives
        // those not tied to one the id of the thread that stopped it
        Sum& s = runtime[e.name()];
        ++s.calls;
        s.total_ms += ms;
        break;
      }
      default:  // the GPU's copies of the scopes (GPU_USER_ANNOTATION), correlations, overhead
        break;
    }
  }
  // the device's busy time: the union of its work's intervals (kernels on
  // several streams at once count once)
  for (auto& [dev, iv] : busy) {
    std::sort(iv.begin(), iv.end());
    std::uint64_t lo = 0, hi = 0;
    bool open = false;
    for (const auto& [a, b] : iv) {
      if (!open || a > hi) {
        if (open) device_ms += static_cast<double>(hi - lo) / 1e6;
        lo = a, hi = b, open = true;
      } else {
        hi = std::max(hi, b);
      }
    }
    if (open) device_ms += static_cast<double>(hi - lo) / 1e6;
  }
  for (auto& [tid, spans] : threads) {
    std::sort(spans.begin(), spans.end(),
              [](const Span& a, const Span& b) { return a.start != b.start ? a.start < b.start : a.end > b.end; });
    std::vector<Span*> stack;
    for (auto& sp : spans) {
      while (!stack.empty() && stack.back()->end <= sp.start) stack.pop_back();
      if (!stack.empty()) {
        Span& parent = *stack.back();
        parent.children += sp.end - sp.start;
        const std::string pname = parent.e->name();
        sp.aside = parent.aside || aside(pname);
        sp.phases = parent.phases | phase_bit(pname);
      }
      stack.push_back(&sp);
    }
    for (const auto& sp : spans) {
      const std::string name = sp.e->name();
      const double total = static_cast<double>(sp.end - sp.start) / 1e6;
      const double self = static_cast<double>(sp.end - sp.start - std::min(sp.children, sp.end - sp.start)) / 1e6;
      if (auto ph = phase_of().find(name); ph != phase_of().end()) {
        if (sp.phases & phase_bit(name)) continue;
        Sum& s = phases[ph->second];
        ++s.calls;
        s.total_ms += total;
        continue;
      }
      if (sp.aside) continue;
      Sum& s = host[name];
      ++s.calls;
      s.total_ms += total;
      s.self_ms += self;
    }
  }
  const double n = static_cast<double>(std::max<std::int64_t>(steps, 1));
  nlohmann::json ph = nlohmann::json::object();
  for (const char* k : {"data", "forward", "backward", "optimizer", "step"})
    ph[k] = phases.count(k) ? phases[k].total_ms / n : 0.0;
  for (const char* k : {"eval", "save"})  // only where one fell among the steps
    if (phases.count(k)) ph[k] = phases[k].total_ms / n;
  nlohmann::json out = {{"steps", steps},
                        {"seconds_per_step", seconds / n},
                        {"phases_ms", ph},
                        {"host_ops", top_rows(host, steps, true, 20)},
                        {"trace", trace_error.empty() && !trace.empty() ? nlohmann::json(trace) : nlohmann::json(nullptr)}};
  if (!trace_error.empty()) out["trace_error"] = "cannot write " + trace + ": " + trace_error;
  if (cuda_) {
    out["device_ops"] = top_rows(device, steps, false, 20);
    out["device_ms_per_step"] = device_ms / n;
    out["cuda_runtime"] = top_rows(runtime, steps, false, 10);
  }
  return out;
}

std::string profile_lines(const nlohmann::json& s, int top) {
  std::string out;
  const auto& ph = s.at("phases_ms");
  out += strf("  per step: %.1f ms; data %.1f, forward %.1f, backward %.1f, optimizer %.1f", s.value("seconds_per_step", 0.0) * 1e3,
              ph.value("data", 0.0), ph.value("forward", 0.0), ph.value("backward", 0.0), ph.value("optimizer", 0.0));
  if (ph.contains("eval")) out += strf(", evaluation %.1f", ph["eval"].get<double>());
  if (ph.contains("save")) out += strf(", saving %.1f", ph["save"].get<double>());
  out += " (host time)";
  if (s.contains("device_ms_per_step")) out += strf("; device busy %.1f ms", s["device_ms_per_step"].get<double>());
  out += "\n";
  auto table = [&](const char* title, const nlohmann::json& rows, bool self) {
    if (rows.empty()) return;
    out += strf("  %-52s %10s %8s\n", title, self ? "self ms" : "ms", "calls");
    int k = 0;
    for (const auto& r : rows) {
      if (k++ >= top) break;
      std::string name = r.value("name", "");
      if (name.size() > 52) name = name.substr(0, 49) + "...";
      out += strf("  %-52s %10.2f %8.4g\n", name.c_str(), r.value(self ? "self_ms" : "ms", 0.0),
                  r.value("calls", 0.0));
    }
  };
  table("host operators (per step)", s.at("host_ops"), true);
  if (s.contains("device_ops")) table("device kernels and copies (per step)", s["device_ops"], false);
  return out;
}

}  // namespace wick
