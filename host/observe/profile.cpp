#include "observe/profile.hpp"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
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
  static const std::map<std::string, std::string> m = {{"wick::data", "data"},
                                                       {"wick::forward", "forward"},
                                                       {"wick::backward", "backward"},
                                                       {"wick::optimizer", "optimizer"},
                                                       {"wick::step", "step"}};
  return m;
}

struct Span {
  const prof::KinetoEvent* e;
  std::uint64_t start, end;
  std::uint64_t children = 0;  // the direct children's time
};

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
    nlohmann::json r = {{"name", name}, {"calls", s.calls}, {"ms", s.total_ms / n}};
    if (with_self) r["self_ms"] = s.self_ms / n;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace

StepProfiler::~StepProfiler() {
  if (!active_) return;
  try {
    prof::disableProfiler();
  } catch (...) {
  }
}

void StepProfiler::start(bool cuda) {
  // Kineto (a CUDA build) asks for the GPUs when it starts and logs an ERROR
  // line where there are none; a run on the CPU leaves its logging to errors
  // of its own (kept if the user set the level)
  if (!cuda) ::setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
  std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
  if (cuda) activities.insert(impl::ActivityType::CUDA);
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO, /*report_input_shapes=*/false,
                                    /*profile_memory=*/false, /*with_stack=*/false, /*with_flops=*/false,
                                    /*with_modules=*/false);
  try {
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
  } catch (const c10::Error& e) {
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
    throw Error(std::string("option 'profile': PyTorch's profiler did not stop: ") + e.what_without_backtrace());
  }
  // the trace, whole or not at all
  const fs::path path(trace);
  const fs::path tmp = path.string() + ".partial." + std::to_string(::getpid());
  try {
    result->save(tmp.string());
  } catch (const c10::Error& e) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw Error("option 'profile': cannot write the trace " + trace + ": " + e.what_without_backtrace());
  }
  std::error_code ec;
  if (!fs::exists(tmp, ec)) throw Error("option 'profile': the profiler wrote no trace to " + tmp.string());
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw Error("option 'profile': cannot write the trace " + trace + ": " + ec.message());
  }

  // Host operators: nested by time on each thread; an operator's self time is
  // its own less its direct children's. Device work: kernels, copies and
  // sets, which do not nest.
  std::map<std::uint64_t, std::vector<Span>> threads;
  std::map<std::string, Sum> host, device, phases;
  double device_ms = 0;
  for (const auto& e : result->events()) {
    if (e.isAsync() || e.endNs() < e.startNs()) continue;
    const double ms = static_cast<double>(e.durationNs()) / 1e6;
    if (e.deviceType() != c10::DeviceType::CPU) {
      Sum& s = device[e.name()];
      ++s.calls;
      s.total_ms += ms;
      device_ms += ms;
      continue;
    }
    threads[e.startThreadId()].push_back(Span{&e, e.startNs(), e.endNs()});
  }
  for (auto& [tid, spans] : threads) {
    std::sort(spans.begin(), spans.end(),
              [](const Span& a, const Span& b) { return a.start != b.start ? a.start < b.start : a.end > b.end; });
    std::vector<Span*> stack;
    for (auto& sp : spans) {
      while (!stack.empty() && stack.back()->end <= sp.start) stack.pop_back();
      if (!stack.empty()) stack.back()->children += sp.end - sp.start;
      stack.push_back(&sp);
    }
    for (const auto& sp : spans) {
      const std::string name = sp.e->name();
      const double total = static_cast<double>(sp.end - sp.start) / 1e6;
      const double self = static_cast<double>(sp.end - sp.start - std::min(sp.children, sp.end - sp.start)) / 1e6;
      if (auto ph = phase_of().find(name); ph != phase_of().end()) {
        Sum& s = phases[ph->second];
        ++s.calls;
        s.total_ms += total;
        continue;
      }
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
  nlohmann::json out = {{"steps", steps},
                        {"seconds_per_step", seconds / n},
                        {"phases_ms", ph},
                        {"host_ops", top_rows(host, steps, true, 20)},
                        {"trace", trace}};
  if (cuda_) {
    out["device_ops"] = top_rows(device, steps, false, 20);
    out["device_ms_per_step"] = device_ms / n;
  }
  return out;
}

std::string profile_lines(const nlohmann::json& s, int top) {
  std::string out;
  const auto& ph = s.at("phases_ms");
  out += strf("  per step: %.1f ms; data %.1f, forward %.1f, backward %.1f, optimizer %.1f (host time)",
              s.value("seconds_per_step", 0.0) * 1e3, ph.value("data", 0.0), ph.value("forward", 0.0),
              ph.value("backward", 0.0), ph.value("optimizer", 0.0));
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
      out += strf("  %-52s %10.2f %8.0f\n", name.c_str(), r.value(self ? "self_ms" : "ms", 0.0),
                  static_cast<double>(r.value("calls", std::int64_t{0})) / std::max<double>(s.value("steps", 1.0), 1.0));
    }
  };
  table("host operators (per step)", s.at("host_ops"), true);
  if (s.contains("device_ops")) table("device kernels and copies (per step)", s["device_ops"], false);
  return out;
}

}  // namespace wick
