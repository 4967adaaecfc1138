#include "util/system.hpp"
#include "util/memory.hpp"
#include "distributed/group.hpp"

#include <atomic>
#include <csignal>
#include <ctime>
#include <mutex>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include <c10/util/Logging.h>
#include <torch/version.h>
#include <unistd.h>

#ifdef WICK_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

#include "wick/plugin.hpp"

namespace wick {
namespace {
volatile std::sig_atomic_t g_signal = 0;
std::atomic<int> g_loops{0};           // StepLoopScopes alive
std::atomic<int> g_callbacks{0};       // CallbackScopes alive
std::atomic<bool> g_honoured{false};   // a loop stopped for the signal
std::atomic<bool> g_polled{false};     // the recipe watches interrupted() itself
std::atomic<bool> g_hook_fired{false}; // Lua code was interrupted
std::atomic<double> g_signal_at{0};    // monotonic seconds
std::atomic<void (*)(int)> g_hook{nullptr};
std::mutex g_note_mu;
std::function<void(const std::string&)> g_note;

double monotonic_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

void on_signal(int sig) {
  if (g_signal) {
    // Second signal: the user means it.
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_signal_at = monotonic_seconds();
  g_signal = sig;
  if (auto hook = g_hook.load()) hook(sig);
}

// Seconds the signal may go unanswered before the process ends by itself:
// Lua code answers at once (its hook), a loop at its step's end, a callback
// within its grace; what is left is C++ code that never looks (a plugin
// tokenizing or building a data set, a model's constructor).
constexpr double kStuckSeconds = 3;

void watch_for_stuck_interrupt() {
  for (;;) {
    ::usleep(200 * 1000);
    const int sig = g_signal;
    if (!sig || g_honoured || g_hook_fired) continue;
    const bool owned = g_loops > 0 || g_polled;
    // a loop's step may take minutes: it is only cut short in its callbacks
    if (g_loops > 0 && g_callbacks == 0) continue;
    const double grace = owned ? kCallbackGraceSeconds + kStuckSeconds : kStuckSeconds;
    if (monotonic_seconds() - g_signal_at.load() < grace) continue;
    const std::string msg = "wick: " + signal_name(sig) + ": the recipe was in code that does not stop by itself " +
                            std::string(g_callbacks > 0 ? "(a callback that did not return within its grace)"
                                                        : "(a plugin building data or a model, or a compiled loop)") +
                            "; ended without finishing it\n";
    if (::write(2, msg.data(), msg.size()) < 0) {
    }
    std::function<void(const std::string&)> note;
    {
      std::lock_guard<std::mutex> lock(g_note_mu);
      note = g_note;
    }
    try {
      if (note) note(msg.substr(6, msg.size() - 7));  // (the note clears itself: not under the lock)
    } catch (...) {
    }
    std::_Exit(128 + sig);
  }
}

// VmRSS and VmHWM in bytes, from one read of /proc/self/status (once per step).
std::pair<std::int64_t, std::int64_t> resident_and_peak() {
  std::ifstream in("/proc/self/status");
  std::string line;
  std::int64_t rss = 0, hwm = 0;
  while (std::getline(in, line) && !(rss && hwm)) {
    if (line.compare(0, 6, "VmRSS:") == 0) rss = std::stoll(line.substr(6)) * 1024;
    else if (line.compare(0, 6, "VmHWM:") == 0) hwm = std::stoll(line.substr(6)) * 1024;
  }
  return {rss, hwm};
}
}  // namespace

void quiet_torch_logs() {
  // LibTorch's own warnings (c10d socket retries with C++ frames) would bury
  // wick's message, which already says what failed; TORCH_CPP_LOG_LEVEL keeps them.
  if (!std::getenv("TORCH_CPP_LOG_LEVEL")) FLAGS_caffe2_log_level = 3;
}

bool exit_collectors_attached() {
  for (const char* name : {"CUDA_INJECTION64_PATH", "LD_PRELOAD"})
    if (const char* v = std::getenv(name); v && *v) return true;
  return false;
}

void install_signal_handlers() {
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  std::signal(SIGXFSZ, SIG_IGN);
  static std::once_flag watcher;
  std::call_once(watcher, [] { std::thread(watch_for_stuck_interrupt).detach(); });
}

bool interrupted() { return g_signal != 0; }
int interrupt_signal() { return g_signal; }

std::string signal_name(int sig) {
  return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "signal " + std::to_string(sig);
}

StepLoopScope::StepLoopScope() { ++g_loops; }
StepLoopScope::~StepLoopScope() { --g_loops; }
CallbackScope::CallbackScope() { ++g_callbacks; }
CallbackScope::~CallbackScope() { --g_callbacks; }
void signal_honoured() { g_honoured = true; }
void signal_polled() { g_polled = true; }

bool interrupt_due() {
  if (!g_signal || g_honoured) return false;
  if ((g_loops > 0 || g_polled) && monotonic_seconds() - g_signal_at.load() < kCallbackGraceSeconds) return false;
  g_hook_fired = true;
  return true;
}

void set_interrupt_hook(void (*hook)(int sig)) { g_hook = hook; }

void set_forced_exit_note(std::function<void(const std::string& why)> note) {
  std::lock_guard<std::mutex> lock(g_note_mu);
  g_note = std::move(note);
}

std::map<std::string, std::int64_t> memory_stats(bool cuda, bool resident) {
  std::map<std::string, std::int64_t> m;
  if (resident) {
    const auto [rss, hwm] = resident_and_peak();
    m["resident"] = rss;
    m["peak_resident"] = hwm;
  }
  const CpuTensorMemory t = cpu_tensor_memory();
  m["cpu_tensors"] = t.allocated;
  m["cpu_tensors_peak"] = t.peak;
  if (t.limit > 0) m["cpu_limit"] = t.limit;
#ifdef WICK_WITH_CUDA
  if (cuda && cuda_available()) {
    using namespace c10::cuda::CUDACachingAllocator;
    const auto dev = c10::cuda::current_device();
    const auto st = getDeviceStats(dev);
    const auto agg = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    m["cuda_allocated"] = st.allocated_bytes[agg].current;
    m["cuda_reserved"] = st.reserved_bytes[agg].current;
    m["cuda_peak"] = st.allocated_bytes[agg].peak;
    m["cuda_reserved_peak"] = st.reserved_bytes[agg].peak;
    // the whole device as the driver sees it: this process's context, cuBLAS
    // and NCCL workspaces, the allocator's reserve (and any other process's)
    std::size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
      m["cuda_device_used"] = static_cast<std::int64_t>(total_b - free_b);
      m["cuda_device_total"] = static_cast<std::int64_t>(total_b);
    } else {
      (void)cudaGetLastError();
    }
  }
#else
  (void)cuda;
#endif
  return m;
}

void reset_cuda_peak() {
#ifdef WICK_WITH_CUDA
  if (cuda_available()) c10::cuda::CUDACachingAllocator::resetPeakStats(c10::cuda::current_device());
#endif
}

void cuda_empty_cache() {
#ifdef WICK_WITH_CUDA
  if (cuda_available()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

void cuda_set_memory_fraction(double fraction, int device) {
#ifdef WICK_WITH_CUDA
  if (cuda_available()) c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, static_cast<c10::DeviceIndex>(device));
#else
  (void)fraction, (void)device;
#endif
}

std::int64_t cuda_total_memory(int device) {
#ifdef WICK_WITH_CUDA
  cudaDeviceProp prop{};
  if (cuda_available() && cudaGetDeviceProperties(&prop, device) == cudaSuccess)
    return static_cast<std::int64_t>(prop.totalGlobalMem);
  cudaGetLastError();
#else
  (void)device;
#endif
  return 0;
}

int cuda_device_count() {
#ifdef WICK_WITH_CUDA
  // asked once: the training loop checks it every step (peak resets), and the
  // devices a process sees do not change while it runs
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  }();
  return count;
#else
  return 0;
#endif
}

bool cuda_available() { return cuda_device_count() > 0; }

std::string resolve_device(const std::string& given, int local_rank, int local_world_size, int world_size) {
  const int n = cuda_device_count();
  if (given == "auto") {
    if (n == 0) return "cpu";
    const int d = rank_cuda_device(local_rank, local_world_size, n);
    return world_size > 1 ? "cuda:" + std::to_string(d) : "cuda";
  }
  if (given.rfind("cuda", 0) != 0) return given;
  // "cuda" with several ranks: each rank's own device, as "auto" picks it
  // (the NCCL group takes the same one)
  if (given == "cuda" && world_size > 1 && n > 0)
    return "cuda:" + std::to_string(rank_cuda_device(local_rank, local_world_size, n));
  if (n == 0) {
#ifdef WICK_WITH_CUDA
    int count = 0;
    const cudaError_t e = cudaGetDeviceCount(&count);
    cudaGetLastError();
    const std::string why = e == cudaSuccess ? "the CUDA driver sees no device"
                                             : std::string("CUDA says: ") + cudaGetErrorString(e);
#else
    const std::string why = "this wick was built without CUDA (WICK_CUDA=OFF)";
#endif
    throw Error("device '" + given + "': no CUDA device can be used (" + why + "); set device = \"cpu\", or "
                "\"auto\" to take a GPU when there is one");
  }
  if (const auto colon = given.find(':'); colon != std::string::npos) {
    const std::string idx = given.substr(colon + 1);
    const bool digits = !idx.empty() && idx.size() < 4 && idx.find_first_not_of("0123456789") == std::string::npos;
    if (!digits || std::stoi(idx) >= n)
      throw Error("device '" + given + "': expected cuda or cuda:N with N below " + std::to_string(n) +
                  " (the devices this process sees)");
  }
  return given;
}

std::map<std::string, std::string> versions() {
  std::map<std::string, std::string> v;
  v["wick"] = WICK_VERSION_STRING;
  v["plugin_abi"] = std::to_string(kAbiVersion);
  v["libtorch"] = TORCH_VERSION;
#ifdef WICK_WITH_CUDA
  int rt = 0;
  cudaRuntimeGetVersion(&rt);
  v["cuda_runtime"] = std::to_string(rt / 1000) + "." + std::to_string((rt % 1000) / 10);
  int drv = 0;
  if (cudaDriverGetVersion(&drv) == cudaSuccess && drv > 0)
    v["cuda_driver"] = std::to_string(drv / 1000) + "." + std::to_string((drv % 1000) / 10);
  else
    v["cuda_driver"] = "none";
  int nccl = 0;
  ncclGetVersion(&nccl);
  v["nccl"] = std::to_string(nccl / 10000) + "." + std::to_string((nccl % 10000) / 100) + "." +
              std::to_string(nccl % 100);
  const int n = cuda_device_count();
  v["cuda_usable"] = n > 0 ? "yes (" + std::to_string(n) + " device" + (n > 1 ? "s" : "") + ")" : "no";
#else
  v["cuda_runtime"] = "not built";
  v["nccl"] = "not built";
  v["cuda_usable"] = "no (built without CUDA)";
#endif
  return v;
}

}  // namespace wick
