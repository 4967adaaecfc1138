#include "dist/reducer.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "dist/group.hpp"

namespace wick {

GradReducer::GradReducer(std::shared_ptr<Group> group, std::vector<at::Tensor> params, double bucket_mb)
    : group_(std::move(group)), params_(std::move(params)), alive_(std::make_shared<std::atomic<bool>>(true)) {
  // Backward produces gradients roughly in reverse order of the parameters:
  // fill buckets from the end so the first bucket is ready first.
  const std::int64_t cap = std::max<std::int64_t>(1, static_cast<std::int64_t>(bucket_mb * 1024 * 1024));
  bucket_of_.resize(params_.size());
  for (std::size_t k = params_.size(); k-- > 0;) {
    const auto& p = params_[k];
    const std::int64_t bytes = p.numel() * p.element_size();
    if (buckets_.empty() || buckets_.back().numel * p.element_size() + bytes > cap ||
        params_[buckets_.back().params.front()].scalar_type() != p.scalar_type())
      buckets_.emplace_back();
    buckets_.back().params.push_back(k);
    buckets_.back().numel += p.numel();
    bucket_of_[k] = buckets_.size() - 1;
  }
  for (std::size_t k = 0; k < params_.size(); ++k) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[k]);
    if (!acc) continue;
    std::weak_ptr<std::atomic<bool>> alive = alive_;
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, k, alive](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto a = alive.lock(); a && *a && armed_) ready(k);
          return outputs;
        }));
    accumulators_.push_back(std::move(acc));
  }
}

GradReducer::~GradReducer() { *alive_ = false; }

void GradReducer::arm() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.work.reset();
    b.flat = at::Tensor();
  }
  next_ = 0;
  launched_early_ = 0;
  armed_ = true;
}

void GradReducer::launch(Bucket& b) {
  std::vector<at::Tensor> parts;
  parts.reserve(b.params.size());
  for (auto k : b.params) {
    const auto& p = params_[k];
    parts.push_back(p.grad().defined() ? p.grad().reshape({-1}) : at::zeros({p.numel()}, p.options()));
  }
  b.flat = at::cat(parts);
  b.work = group_->all_reduce_async(b.flat);
}

void GradReducer::ready(std::size_t param) {
  std::lock_guard<std::mutex> lock(mu_);
  Bucket& b = buckets_[bucket_of_[param]];
  if (b.pending > 0) --b.pending;
  // Buckets start strictly in index order, as on every other rank: collectives
  // must be issued in the same order everywhere.
  while (next_ < buckets_.size() && buckets_[next_].pending == 0) {
    launch(buckets_[next_++]);
    ++launched_early_;
  }
}

void GradReducer::finish(std::int64_t step) {
  armed_ = false;
  std::lock_guard<std::mutex> lock(mu_);
  // Buckets whose gradients never all arrived (unused parameters, or no
  // micro-batch on this rank) go now, in the same order on every rank.
  while (next_ < buckets_.size()) launch(buckets_[next_++]);
  const std::string what = "the gradient all-reduce of step " + std::to_string(step);
  for (auto& b : buckets_) {
    group_->wait(b.work, what);
    std::int64_t offset = 0;
    for (auto k : b.params) {
      auto& p = params_[k];
      at::Tensor sum = b.flat.narrow(0, offset, p.numel()).view(p.sizes());
      if (p.grad().defined()) p.mutable_grad().copy_(sum);
      else p.mutable_grad() = sum.clone();
      offset += p.numel();
    }
    b.flat = at::Tensor();
    b.work.reset();
  }
}

}  // namespace wick
