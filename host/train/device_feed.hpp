#pragma once
// A window's micro-batches on their way to the device.

#include <c10/core/Device.h>

#include <cstddef>
#include <map>
#include <optional>
#include <vector>

#include <c10/core/Event.h>
#ifdef WICK_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "train/trainer.hpp"
#include "wick/data.hpp"

namespace wick {

// Pinned micro-batches reach the GPU on a side stream: the copy of micro-
// batch i + 1 is issued when micro-batch i starts, so it runs during i's
// forward and backward. The compute stream waits on the copy's event before
// it reads the tensors, and the caching allocator is told that the compute
// stream uses them (so their memory is not reused under it). Anything else
// (the CPU, pageable tensors, a stand-in) is copied as to_device copies.
class DeviceFeed {
 public:
  DeviceFeed(const at::Device& device, const std::vector<Batch>& pieces) : device_(device), pieces_(pieces) {
#ifdef WICK_WITH_CUDA
    if (device.is_cuda() && !pieces.empty() && pinned(pieces.front()))
      stream_.emplace(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index() < 0
                                                                                 ? c10::cuda::current_device()
                                                                                 : device.index()));
#endif
  }
  Batch take(std::size_t i, const Batch& b, bool stand_in) {
#ifdef WICK_WITH_CUDA
    if (stream_ && !stand_in && i < pieces_.size() && &b == &pieces_[i] && pinned(b)) {
      if (!pending_.count(i)) issue(i);
      auto node = pending_.extract(i);
      Pending& p = node.mapped();
      const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(stream_->device_index());
      p.done.block(compute);
      for (auto& [k, t] : p.batch)
        if (t.defined() && t.is_cuda())
          c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), compute);
      if (i + 1 < pieces_.size() && pinned(pieces_[i + 1]) && !pending_.count(i + 1)) issue(i + 1);
      return std::move(p.batch);
    }
#else
    (void)i;
    (void)stand_in;
#endif
    return to_device(b, device_);
  }

 private:
  static bool pinned(const Batch& b) {
    for (const auto& [k, t] : b)
      if (t.defined() && !t.is_pinned()) return false;
    return !b.empty();
  }
#ifdef WICK_WITH_CUDA
  struct Pending {
    Batch batch;
    c10::Event done{c10::DeviceType::CUDA};
  };
  void issue(std::size_t i) {
    c10::cuda::CUDAStreamGuard guard(*stream_);
    Pending p;
    for (const auto& [k, t] : pieces_[i]) p.batch[k] = t.defined() ? t.to(device_, /*non_blocking=*/true) : t;
    p.done.record(*stream_);
    pending_.emplace(i, std::move(p));
  }
  std::optional<c10::cuda::CUDAStream> stream_;
  std::map<std::size_t, Pending> pending_;
#endif
  at::Device device_;
  const std::vector<Batch>& pieces_;
};

}  // namespace wick
