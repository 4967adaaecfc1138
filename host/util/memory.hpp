#pragma once
// CPU memory accounting for LibTorch tensors: every CPU tensor allocation goes
// through a counting allocator, so the host knows the bytes tensors hold now
// and at their peak (what the CUDA caching allocator reports for GPUs), and
// can cap them. A cap makes an allocation fail with c10::OutOfMemoryError, the
// error a full GPU raises, so out-of-memory handling is exercised on the CPU
// through the same code.

#include <cstddef>
#include <cstdint>
#include <string>

namespace wick {

struct CpuTensorMemory {
  std::int64_t allocated = 0;  // bytes held by CPU tensors now
  std::int64_t peak = 0;       // most held since the last reset
  std::int64_t limit = 0;      // cap (0: none)
  std::int64_t failures = 0;   // allocations refused by the cap
};

/// Installs the counting allocator (idempotent; done when wick_core loads).
void install_memory_tracking();
CpuTensorMemory cpu_tensor_memory();
/// Peak := current.
void reset_cpu_tensor_peak();
/// Caps CPU tensor bytes (0: no cap). Also read from WICK_CPU_MEMORY_LIMIT
/// (bytes, or with a K/M/G/KiB/MiB/GiB suffix) when the library loads.
void set_cpu_memory_limit(std::int64_t bytes);

/// While one lives, this thread's CPU tensor allocations are counted but not
/// capped: a collective's own buffers (a GPU's NCCL keeps them outside the
/// allocator the cap stands for). Refused inside a collective, a rank would
/// leave the others waiting on it. gloo's worker threads are never capped.
struct CollectiveAllocations {
  CollectiveAllocations();
  ~CollectiveAllocations();
  CollectiveAllocations(const CollectiveAllocations&) = delete;
  CollectiveAllocations& operator=(const CollectiveAllocations&) = delete;
};

/// Host memory holding tensors moved off the device (offloaded activations,
/// train/activation_checkpoint.hpp), counted apart from the device's tensors. On a CPU
/// run, where the counting allocator stands for the device, these buffers
/// come from outside it, as a GPU run's pinned host buffers lie outside its
/// device memory.
struct HostOffloadMemory {
  std::int64_t held = 0;  // bytes held now
  std::int64_t peak = 0;  // most held since the last reset
};
HostOffloadMemory host_offload_memory();
void reset_host_offload_peak();
/// Counts bytes of host memory that hold an offloaded tensor (+) or no longer do (-).
void count_host_offload(std::int64_t bytes);
/// `bytes` of CPU memory outside the counting allocator (nullptr when the
/// system has none), released with free_host_offload; both count it.
void* alloc_host_offload(std::size_t bytes);
void free_host_offload(void* p, std::size_t bytes);

/// With WICK_MEMORY_PEAK_TRACE=1 set, prints to stderr the tensors held at
/// the peak since the last reset_cpu_tensor_peak() (within 1 MiB), summed by
/// where they were allocated: where a step's memory goes. Otherwise nothing.
void report_memory_trace();

/// "8GiB", "512MB", "1e9" -> bytes; throws wick::Error naming `what` otherwise.
std::int64_t parse_bytes(const std::string& text, const std::string& what, bool need_unit = false);

}  // namespace wick
