#pragma once
// Process-level facts and controls: memory, signals, versions.

#include <cstdint>
#include <map>
#include <string>

namespace wick {

/// Memory in bytes: "resident" and "peak_resident" (the process), and
/// "cpu_tensors", "cpu_tensors_peak" (bytes held by CPU tensors, see
/// util/memory.hpp) always; with CUDA in use,
/// "cuda_allocated", "cuda_reserved", "cuda_peak" for the current device.
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
void install_signal_handlers();
bool interrupted();
int interrupt_signal();

/// Silences LibTorch's internal log lines unless TORCH_CPP_LOG_LEVEL is set.
void quiet_torch_logs();

bool cuda_available();
int cuda_device_count();
/// wick, LibTorch, CUDA runtime and NCCL versions, and whether CUDA is usable.
std::map<std::string, std::string> versions();

}  // namespace wick
