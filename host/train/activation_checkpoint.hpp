#pragma once
/// \file activation_checkpoint.hpp
/// Activation checkpointing: wick::checkpoint(fn, inputs) runs `fn` without
/// keeping its intermediate activations and runs it again during backward to
/// get them back. It is a custom autograd function (PyTorch's reentrant
/// torch.utils.checkpoint): the forward runs under no_grad, saves only the
/// inputs, the random generators' states and the autocast settings; the
/// backward restores them, recomputes with gradients on and backpropagates
/// through the recomputed graph. Dropout draws the same masks and autocast
/// casts the same way, so gradients equal those of the plain forward.
///
/// With offload on, each block input the block owns whole (not a view into a
/// larger tensor, such as a slice of the batch) moves to host memory once the
/// block has run (pinned memory on a GPU, copied on a side stream) and
/// comes back for the recomputation, started by the backward of the block
/// after it (train/activation_offload.hpp): the device holds no block inputs
/// between forward and backward but the next one's, the host holds them
/// instead (Unsloth's offloaded gradient checkpointing, torchtune's
/// activation offloading). Gradients are the same bits; each input crosses
/// the bus twice per step.
///
/// Model plugins never call this: they declare blocks (Model::blocks()) and
/// run each through Model::run_block, and the host's CheckpointRunner (below)
/// checkpoints the blocks the recipe names.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "train/activation_offload.hpp"
#include "util/memory.hpp"
#include "wick/options.hpp"
#include "wick/model.hpp"

namespace wick {

using BlockFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

namespace detail {

struct AutocastState {
  bool cpu = false, cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;

  static AutocastState now() {
    return {at::autocast::is_autocast_enabled(at::kCPU), at::autocast::is_autocast_enabled(at::kCUDA),
            at::autocast::get_autocast_dtype(at::kCPU), at::autocast::get_autocast_dtype(at::kCUDA)};
  }
  void set() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
  }
};

/// The random generators a block may draw from: the CPU's and, when the
/// block's tensors live on a GPU, that GPU's.
struct RngState {
  at::Tensor cpu;
  std::optional<at::Device> device;
  at::Tensor device_state;

  static RngState capture(const std::vector<at::Tensor>& inputs) {
    RngState s;
    auto cpu_gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(cpu_gen.mutex());
      s.cpu = cpu_gen.get_state();
    }
    for (const auto& t : inputs)
      if (t.defined() && t.is_cuda()) {
        s.device = t.device();
        auto g = at::globalContext().defaultGenerator(*s.device);
        std::lock_guard<std::mutex> lock(g.mutex());
        s.device_state = g.get_state();
        break;
      }
    return s;
  }
  void restore() const {
    auto cpu_gen = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(cpu_gen.mutex());
      cpu_gen.set_state(cpu);
    }
    if (device) {
      auto g = at::globalContext().defaultGenerator(*device);
      std::lock_guard<std::mutex> lock(g.mutex());
      g.set_state(device_state);
    }
  }
};

struct CheckpointState : torch::CustomClassHolder {
  BlockFn fn;
  bool offload = false;
  std::vector<at::Tensor> inputs;  // detached (empty once offloaded)
  std::shared_ptr<OffloadedInputs> moved;  // offloaded: the inputs, those worth it in host memory
  std::weak_ptr<OffloadedInputs> before;  // the offloaded block that ran before this one, to prefetch
  bool used = false;  // backward ran: the inputs are gone
  std::vector<bool> needs_grad;
  RngState rng;
  AutocastState autocast;
  bool dummy = false;  // the last input is a placeholder that makes the output require grad
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<CheckpointState> st, at::TensorList inputs) {
    const std::size_t n = inputs.size() - (st->dummy ? 1 : 0);
    for (std::size_t i = 0; i < n; ++i) {
      st->inputs.push_back(inputs[i].defined() ? inputs[i].detach() : at::Tensor());
      st->needs_grad.push_back(inputs[i].defined() && inputs[i].requires_grad());
    }
    st->rng = RngState::capture(st->inputs);
    st->autocast = AutocastState::now();
    // the copies to the host queued first: on a GPU they run beside the block
    // (both only read the inputs), and each input's memory is free once its
    // copy ends rather than after the whole block
    if (st->offload) st->moved = std::make_shared<OffloadedInputs>(st->inputs);
    std::vector<at::Tensor> out = st->fn(st->inputs);  // grad mode is off inside a custom forward
    if (st->offload) st->inputs.clear();
    ctx->saved_data["state"] = c10::IValue::make_capsule(st);
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto st = c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    if (st->used)
      throw Error("a checkpointed block's backward ran twice (retain_graph): its inputs were freed after the first");
    std::vector<at::Tensor> in = st->moved ? st->moved->take() : std::move(st->inputs);
    for (std::size_t i = 0; i < in.size(); ++i)
      if (in[i].defined()) {
        in[i] = in[i].detach();
        if (st->needs_grad[i]) in[i].requires_grad_(true);
      }
    // The node keeps its state until the whole graph goes: the inputs go now,
    // not with the last block's backward.
    st->inputs.clear();
    st->moved.reset();
    st->used = true;
    // the block before's inputs come back while this one recomputes
    if (auto prev = st->before.lock()) prev->prefetch();
    std::vector<at::Tensor> out;
    {
      // the generators and autocast as they were in the forward, then back
      const RngState now = RngState::capture(in);
      const AutocastState ac_now = AutocastState::now();
      st->rng.restore();
      st->autocast.set();
      at::autocast::increment_nesting();
      try {
        at::AutoGradMode grad(true);
        out = st->fn(in);
      } catch (...) {
        if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
        ac_now.set();
        now.restore();
        throw;
      }
      if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
      ac_now.set();
      now.restore();
    }
    std::vector<at::Tensor> roots, root_grads;
    for (std::size_t i = 0; i < out.size() && i < grads.size(); ++i)
      if (out[i].defined() && out[i].requires_grad() && grads[i].defined()) {
        roots.push_back(out[i]);
        root_grads.push_back(grads[i]);
      }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    torch::autograd::variable_list result{at::Tensor()};  // the state argument
    for (std::size_t i = 0; i < in.size(); ++i)
      result.push_back(in[i].defined() && st->needs_grad[i] ? in[i].grad() : at::Tensor());
    if (st->dummy) result.emplace_back();
    return result;
  }
};

}  // namespace detail

/// Runs fn(inputs) keeping only the inputs for backward; see the file comment.
/// Without grad mode it is a plain call.
/// With `offload`, the inputs wait in host memory; `chain` (optional) holds
/// the last offloaded block's inputs, whose copies back this block's
/// backward starts, and is set to this block's.
inline std::vector<at::Tensor> checkpoint(const BlockFn& fn, const std::vector<at::Tensor>& inputs,
                                          bool offload = false, std::weak_ptr<OffloadedInputs>* chain = nullptr) {
  if (!at::GradMode::is_enabled()) return fn(inputs);
  auto st = c10::make_intrusive<detail::CheckpointState>();
  st->fn = fn;
  st->offload = offload;
  if (chain) st->before = *chain;
  std::vector<at::Tensor> args = inputs;
  bool any = false;
  for (const auto& t : inputs) any = any || (t.defined() && t.requires_grad());
  if (!any) {
    // The block's parameters still need gradients: an input that requires
    // grad makes autograd call the backward.
    st->dummy = true;
    args.push_back(at::empty({0}).requires_grad_(true));
  }
  auto out = detail::CheckpointFunction::apply(st, at::TensorList(args));
  if (chain && st->moved && st->moved->any()) *chain = st->moved;
  return out;
}

/// The host's Model::run_block: the chosen blocks through checkpoint(), the
/// others plainly.
class CheckpointRunner : public BlockRunner {
 public:
  explicit CheckpointRunner(std::set<std::string> blocks, bool offload = false)
      : blocks_(std::move(blocks)), offload_(offload) {}
  std::vector<at::Tensor> run(const std::string& block, const Fn& fn, const std::vector<at::Tensor>& inputs) override {
    if (!blocks_.count(block)) return fn(inputs);
    if (at::GradMode::is_enabled() && !runs_.insert(block).second) repeated_ = true;
    return checkpoint(fn, inputs, offload_, &last_offloaded_);
  }
  const std::set<std::string>& blocks() const { return blocks_; }
  /// Starts the copy back of the last block in host memory (its backward
  /// comes first): called when the forward has ended, it runs beside the
  /// loss's backward.
  void prefetch_last() {
    if (auto p = last_offloaded_.lock()) p->prefetch();
  }
  /// Whether a checkpointed block ran more than once with gradients since
  /// reset_runs() (frames in chunks, a shared layer): each run backpropagates
  /// on its own, so its parameters' gradients arrive once per run.
  bool repeated() const { return repeated_; }
  void reset_runs() {
    runs_.clear();
    repeated_ = false;
    last_offloaded_.reset();
  }

 private:
  std::set<std::string> blocks_;
  bool offload_ = false;
  std::set<std::string> runs_;
  bool repeated_ = false;
  std::weak_ptr<OffloadedInputs> last_offloaded_;  // this micro-batch's last block in host memory
};

}  // namespace wick
