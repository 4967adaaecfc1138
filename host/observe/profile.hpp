// wick.train's `profile` option: a few optimizer steps under PyTorch's
// profiler (Kineto; on a GPU its kernels through CUPTI), their trace written
// for Perfetto or chrome://tracing, and where their time went summed up per
// step: the run's phases (wick::data, wick::forward, wick::backward,
// wick::optimizer, the scopes the engine records), the host's operators by
// self time and, on a GPU, the device's kernels and copies.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace wick {

/// Whether a profiler records in this process now (a run's, or one started
/// by other code in the main thread).
bool profiler_in_use();

/// On a CPU run: Kineto's probe of absent GPUs kept off stderr (set before
/// the run's threads start).
void quiet_kineto_on_cpu();

class StepProfiler {
 public:
  StepProfiler() = default;
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;
  /// A profiler still running (the run failed in a profiled step) is stopped
  /// and its events dropped.
  ~StepProfiler();

  /// Starts recording this thread (and the autograd engine's, which inherits
  /// it): operators, the engine's scopes, and on CUDA the device's work.
  void start(bool cuda);
  bool active() const { return active_; }
  /// Stops (after the device's work has ended), writes the trace to `trace`
  /// whole (a temporary file renamed into place; one that cannot be written
  /// leaves nothing, trace null and trace_error saying why; "": no trace,
  /// trace null) and returns the
  /// summary of `steps` steps: {seconds_per_step, phases_ms, host_ops,
  /// device_ops, device_ms_per_step, cuda_runtime}, times and calls per step.
  nlohmann::json stop(const std::string& trace, std::int64_t steps);

 private:
  bool active_ = false;
  bool cuda_ = false;
  double t0_ = 0;
};

/// The summary as lines for the terminal: the phases, then the `top` host
/// operators by self time and, on a GPU, the `top` device kernels.
std::string profile_lines(const nlohmann::json& summary, int top);

}  // namespace wick
