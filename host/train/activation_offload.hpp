#pragma once
/// \file activation_offload.hpp
/// offload_activations' copies: one checkpointed block's inputs in host
/// memory between its forward and its backward.
///
/// On a GPU the copies leave the compute stream alone. The copy to the host
/// runs on a side stream that first waits for the compute stream (the input
/// is ready), and the allocator is told that the side stream reads the
/// input, so its memory is not handed out again before the copy ends. The
/// copy back is queued on the same side stream (after the first copy, so the
/// host memory is whole), into memory allocated for that stream; the compute
/// stream waits on its event only when the block's backward needs the input,
/// and the allocator is told the compute stream uses it. The backward of a
/// block starts the copy back of the block that ran before it (prefetch), so
/// that copy runs during this block's recomputation and backward instead of
/// in front of the next one. On the CPU (and for a GPU tensor in a build
/// without CUDA) the copies are plain and prefetch does nothing.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace wick {

/// Whether an input moves to the host: a floating tensor that owns its whole
/// storage (a view into something larger, such as a slice of the batch,
/// frees nothing on the device when copied), of at least 64 KiB.
bool worth_offloading(const at::Tensor& t);

/// One block's inputs, those worth moving in host memory, the others kept.
/// Held counts as offloaded (util/memory.hpp) until take() or destruction.
class OffloadedInputs {
 public:
  explicit OffloadedInputs(const std::vector<at::Tensor>& inputs);
  ~OffloadedInputs();
  OffloadedInputs(const OffloadedInputs&) = delete;
  OffloadedInputs& operator=(const OffloadedInputs&) = delete;

  /// Starts the copies back to the device (a GPU's side stream); once, and
  /// nothing after take().
  void prefetch();
  /// The inputs on their devices, usable on the current stream; the host
  /// copies are let go. Once.
  std::vector<at::Tensor> take();
  /// Whether any input moved.
  bool any() const;

  /// prefetch() calls that came before take() for inputs that moved, in
  /// this process (on a GPU each started the copies back; for tests).
  static std::int64_t prefetches();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace wick
