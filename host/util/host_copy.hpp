// A tensor copied into host memory that the counting allocator does not see:
// what offload_activations (block inputs) and offload_embeddings (frozen
// tables) keep on the host when the "device" is a CPU, so that the device's
// figures drop by what moved, as they do on a GPU.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <string>

#include "util/memory.hpp"

namespace wick {

/// `t` (any device) copied into memory from alloc_host_offload, freed when
/// the last user of the copy lets go; counted as offloaded while it lives.
/// No memory: an out-of-memory error, `what` (the option and the tensor)
/// followed by the bytes asked for.
inline at::Tensor copy_to_host_offload(const at::Tensor& t, const std::string& what) {
  const std::size_t n = t.nbytes();
  void* p = alloc_host_offload(n);
  if (!p) throw c10::OutOfMemoryError(what + " (" + std::to_string(n) + " bytes)");
  at::Tensor host = at::from_blob(p, t.sizes(), [n](void* q) { free_host_offload(q, n); }, t.options().device(at::kCPU));
  host.copy_(t);
  return host;
}

}  // namespace wick
