// offload_activations' copies; see activation_offload.hpp.
#include "train/activation_offload.hpp"

#include <ATen/ops/empty.h>
#include <c10/core/Event.h>

#include <atomic>
#include <map>
#include <mutex>
#include <optional>

#ifdef WICK_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "util/host_copy.hpp"
#include "util/memory.hpp"

namespace wick {

namespace {

std::atomic<std::int64_t> g_prefetches{0};  // prefetch() calls that came in time

#ifdef WICK_WITH_CUDA
// One side stream per GPU for every block's copies, both ways: the copy back
// of an input is queued behind its copy out.
c10::cuda::CUDAStream side_stream(c10::DeviceIndex index) {
  static std::mutex m;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(m);
  auto it = streams.find(index);
  if (it == streams.end())
    it = streams.emplace(index, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)).first;
  return it->second;
}
#endif

}  // namespace

bool worth_offloading(const at::Tensor& t) {
  return t.defined() && at::isFloatingType(t.scalar_type()) && t.nbytes() >= (64u << 10) &&
         t.storage_offset() == 0 && t.storage().nbytes() == t.nbytes() && t.is_contiguous();
}

struct OffloadedInputs::Impl {
  std::vector<at::Tensor> inputs;  // each input: kept as it is, or its host copy
  std::vector<std::optional<at::Device>> moved;  // the device of each input that moved
  std::int64_t pinned_bytes = 0;  // pinned copies counted as offloaded (a GPU's)
  bool taken = false;
  bool prefetched = false;  // prefetch() came before take()
  std::mutex mu;  // prefetch() (the block after's backward) against take() (this block's): one at a time
#ifdef WICK_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> side;
  std::vector<at::Tensor> back;  // the copies back, once prefetch() queued them
  std::optional<c10::Event> back_done;
#endif

  // Queues the copies back on the side stream, into memory allocated for
  // that stream (so that memory the compute stream has queued work on is
  // not handed to the copy); false when there is nothing to queue.
  bool queue_back() {
#ifdef WICK_WITH_CUDA
    if (taken || !side || back_done) return false;
    {
      c10::cuda::CUDAStreamGuard guard(*side);
      back.resize(inputs.size());
      for (std::size_t i = 0; i < inputs.size(); ++i)
        if (moved[i] && moved[i]->is_cuda()) back[i] = inputs[i].to(*moved[i], /*non_blocking=*/true);
    }
    back_done.emplace(c10::DeviceType::CUDA);
    back_done->record(*side);
    return true;
#else
    return false;
#endif
  }

  void let_go_of_pinned() {
    if (pinned_bytes) count_host_offload(-pinned_bytes);
    pinned_bytes = 0;
  }
};

OffloadedInputs::OffloadedInputs(const std::vector<at::Tensor>& inputs) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.inputs.reserve(inputs.size());
  s.moved.assign(inputs.size(), std::nullopt);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    if (!worth_offloading(t)) {
      s.inputs.push_back(t);
      continue;
    }
    if (t.is_cuda() && !s.inputs.empty()) {
      // one side stream, one event: inputs on another GPU than the first moved one stay where they are
      bool other = false;
      for (std::size_t j = 0; j < i; ++j) other = other || (s.moved[j] && s.moved[j]->is_cuda() && *s.moved[j] != t.device());
      if (other) {
        s.inputs.push_back(t);
        continue;
      }
    }
    s.moved[i] = t.device();
    if (!t.is_cuda()) {
      s.inputs.push_back(copy_to_host_offload(t, "offload_activations: no host memory for a block input"));
      continue;
    }
    at::Tensor pinned = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
#ifdef WICK_WITH_CUDA
    const c10::DeviceIndex index = t.device().index();
    if (!s.side) s.side = side_stream(index);
    // the side stream starts after the compute stream's work so far (which made t)
    c10::Event ready(c10::DeviceType::CUDA);
    ready.record(c10::cuda::getCurrentCUDAStream(index));
    ready.block(*s.side);
    {
      c10::cuda::CUDAStreamGuard guard(*s.side);
      pinned.copy_(t, /*non_blocking=*/true);
    }
    // t's memory is not reused before the side stream has read it
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *s.side);
#else
    pinned.copy_(t, /*non_blocking=*/true);
#endif
    s.pinned_bytes += static_cast<std::int64_t>(t.nbytes());
    count_host_offload(static_cast<std::int64_t>(t.nbytes()));
    s.inputs.push_back(std::move(pinned));
  }
}

OffloadedInputs::~OffloadedInputs() { impl_->let_go_of_pinned(); }

bool OffloadedInputs::any() const {
  for (const auto& d : impl_->moved)
    if (d) return true;
  return false;
}

void OffloadedInputs::prefetch() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.taken || s.prefetched || !any()) return;
  s.prefetched = true;
  ++g_prefetches;
  s.queue_back();
}

std::vector<at::Tensor> OffloadedInputs::take() {
  Impl& s = *impl_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.taken) return {};
  std::vector<at::Tensor> out;
  out.reserve(s.inputs.size());
#ifdef WICK_WITH_CUDA
  if (s.side) {
    s.queue_back();  // unless prefetch() did
    const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(s.side->device_index());
    s.back_done->block(compute);
    for (auto& t : s.back)
      if (t.defined()) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), compute);
  }
#endif
  for (std::size_t i = 0; i < s.inputs.size(); ++i) {
#ifdef WICK_WITH_CUDA
    if (s.side && i < s.back.size() && s.back[i].defined()) {
      out.push_back(std::move(s.back[i]));
      continue;
    }
#endif
    // kept, a CPU input's host copy (the CPU is its device), or a GPU input
    // in a build without CUDA
    out.push_back(s.moved[i] && s.moved[i]->is_cuda() ? s.inputs[i].to(*s.moved[i], /*non_blocking=*/true)
                                                      : std::move(s.inputs[i]));
  }
  s.inputs.clear();
  s.taken = true;
  s.let_go_of_pinned();
  return out;
}

std::int64_t OffloadedInputs::prefetches() { return g_prefetches.load(); }

}  // namespace wick
