#pragma once
/// \file early_host.hpp
/// A device tensor's host copy, started early: made, it queues the copy (into
/// pinned memory) on the tensor's current stream with an event after it;
/// read, it waits for that event alone. Reading it late (a loss that checks
/// its labels on the host) then waits for the work queued before the copy,
/// not for everything queued since (the whole forward), as a plain .cpu()
/// would. On the CPU it is the tensor itself.
/// \code
///   wick::EarlyHost labels_host(labels);     // before the forward's kernels
///   at::Tensor h = hidden(...);
///   check(labels_host.get());                // waits for the copy only
/// \endcode

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <optional>

namespace wick {

class EarlyHost {
 public:
  EarlyHost() = default;
  explicit EarlyHost(const at::Tensor& t) {
    if (!t.defined() || t.is_cpu()) {
      host_ = t;
      return;
    }
    host_ = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
    host_.copy_(t, /*non_blocking=*/true);
    const c10::impl::VirtualGuardImpl impl(t.device().type());
    ready_.emplace(t.device().type());
    ready_->record(impl.getStream(t.device()));
  }
  /// The host copy, whole (the first call waits for it).
  const at::Tensor& get() {
    if (ready_) {
      ready_->synchronize();
      ready_.reset();
    }
    return host_;
  }

 private:
  at::Tensor host_;
  std::optional<c10::Event> ready_;
};

}  // namespace wick
