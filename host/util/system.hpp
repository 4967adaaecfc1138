#pragma once
// Process-level facts and controls: memory, signals, versions.

#include <cstdint>
#include <functional>
#include <map>
#include <string>

namespace wick {

/// Memory in bytes: "resident" and "peak_resident" (the process), and
/// "cpu_tensors", "cpu_tensors_peak" (bytes held by CPU tensors, see
/// util/memory.hpp) always; with CUDA in use,
/// "cuda_allocated", "cuda_reserved", "cuda_peak", "cuda_reserved_peak" for
/// the current device, and "cuda_device_used", "cuda_device_total" (the whole
/// device as cudaMemGetInfo sees it: the context and workspaces too).
/// resident = false skips the process's figures (a read of /proc): the
/// tensor and CUDA figures alone, cheap enough for every step.
std::map<std::string, std::int64_t> memory_stats(bool cuda, bool resident = true);
void reset_cuda_peak();
/// CUDA caching allocator controls for the current device; no effect without CUDA.
void cuda_empty_cache();
void cuda_set_memory_fraction(double fraction, int device);
/// Total memory of CUDA device `device` in bytes (0 without CUDA).
std::int64_t cuda_total_memory(int device);

/// SIGINT and SIGTERM set a flag instead of killing the process, so the
/// training loop can finish its step, save and exit. A second signal kills.
/// With no step to finish (recipe code, data being built or tokenized, a
/// callback that does not return) the first signal ends the recipe: the
/// interrupt hook (the Lua binding's, which raises an error in the running
/// Lua code) is called from the handler, and a process still stuck in C++
/// code after the grace below ends, saying so. SIGXFSZ is ignored so that
/// a write over `ulimit -f` fails with EFBIG and is reported like a full disk.
void install_signal_handlers();
bool interrupted();
int interrupt_signal();
/// "SIGINT", "SIGTERM" or "signal N".
std::string signal_name(int sig);

/// While one lives, a training loop owns the first signal: it stops after the
/// step it is in. Lua code running meanwhile (a callback) gets
/// kCallbackGraceSeconds to return before it is interrupted.
class StepLoopScope {
 public:
  StepLoopScope();
  ~StepLoopScope();
  StepLoopScope(const StepLoopScope&) = delete;
  StepLoopScope& operator=(const StepLoopScope&) = delete;
};
constexpr double kCallbackGraceSeconds = 10;
/// While one lives, the loop runs Lua code of the recipe's (a callback): a
/// signal it does not answer within its grace (a JIT-compiled loop never
/// meets the hook) ends the process, as code outside a loop does.
class CallbackScope {
 public:
  CallbackScope();
  ~CallbackScope();
  CallbackScope(const CallbackScope&) = delete;
  CallbackScope& operator=(const CallbackScope&) = delete;
};
/// The signal has been acted on (a loop stopped and saved for it): nothing
/// else ends the recipe for it; interrupted() stays true.
void signal_honoured();
/// A recipe asked interrupted(): it watches for the signal in its own loop,
/// so its Lua code gets the same grace as a callback.
void signal_polled();
/// Whether the running Lua code should be ended now for the signal (called by
/// the interrupt hook; false while a grace runs or once the signal was honoured).
bool interrupt_due();
/// Called (from the watcher's thread) before the process ends by itself for a
/// signal it did not answer: a live run marks its run.json interrupted.
/// nullptr clears it; one at a time.
void set_forced_exit_note(std::function<void(const std::string& why)> note);
/// Called from the signal handler (async-signal-safe work only) on the first
/// signal; the Lua binding sets one that arms a hook in its state.
void set_interrupt_hook(void (*hook)(int sig));

/// Silences LibTorch's internal log lines unless TORCH_CPP_LOG_LEVEL is set.
void quiet_torch_logs();

/// Whether a tool attached to this process may collect what it measured as
/// the process exits, in its exit handlers or destructors: Nsight Systems,
/// Nsight Compute and other CUPTI tools inject through CUDA_INJECTION64_PATH,
/// others preload (LD_PRELOAD). wick then ends through exit(), not
/// std::_Exit (host/cli/main.cpp), so that their data is written.
bool exit_collectors_attached();

/// The device a run computes on: "auto" is this rank's CUDA device (LOCAL_RANK
/// modulo the devices it sees; "cuda" on one rank) or "cpu"; a CUDA device
/// asked for that this process cannot use is an error saying why (built
/// without CUDA, no driver, no device, or no device of that index), not
/// LibTorch's lines from deep inside the first tensor sent there.
std::string resolve_device(const std::string& given, int local_rank, int local_world_size, int world_size);

bool cuda_available();
int cuda_device_count();
/// wick, LibTorch, CUDA runtime and NCCL versions, and whether CUDA is usable.
std::map<std::string, std::string> versions();

}  // namespace wick
