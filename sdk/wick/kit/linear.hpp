#pragma once
/// \file linear.hpp
/// wick::Linear: a linear layer with PyTorch's parameter names (weight, bias)
/// that parameter-efficient transforms can extend in place: a LoRA adapter
/// (lora_A, lora_B, with PEFT's names) added, trained, saved, merged, and the
/// base weight stored as 4-bit NF4 (QLoRA), dequantized on the fly. Model
/// plugins use it for the layers they offer as adapter targets and list them
/// in Model::linear_layers().

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "wick/kit/heap.hpp"
#include "wick/kit/nf4.hpp"

namespace wick {

namespace detail {

/// A LoRA adapter's product B(A(dropout(x))), as PEFT computes it (dropout
/// drawn as at::dropout draws it, products in autocast's dtype when autocast
/// is on, else in the adapter's), keeping for backward only x, dropout's mask
/// as bytes and the rank-r A(h): not the dropped-out copy of x (as big as x,
/// and two of them on a CPU, where at::dropout's mask is of x's dtype), nor
/// its cast. h is made again from x and the mask for A's gradient, a slice of
/// rows at a time, as are x's gradient and (on the CPU) dropout itself.
struct LoraFunction : torch::autograd::Function<LoraFunction> {
  static at::ScalarType compute_dtype(const at::Tensor& x, const at::Tensor& a) {
    const auto type = x.device().type();
    return at::autocast::is_autocast_enabled(type) ? at::autocast::get_autocast_dtype(type) : a.scalar_type();
  }
  // Rows of x's [tokens, features] view per slice: the temporaries of
  // dropout(x) and of x's gradient stay near 8 MiB whatever the tokens.
  static std::int64_t slice_rows(std::int64_t features) {
    return std::max<std::int64_t>(1, (std::int64_t{8} << 20) / (std::max<std::int64_t>(features, 1) * 4));
  }
  // dropout(x) from its mask (x and mask: the same rows): at::dropout's own arithmetic
  static at::Tensor dropped(const at::Tensor& x, const at::Tensor& mask, double p) {
    if (!mask.defined()) return x;
    if (x.is_cpu()) return x * mask.to(x.scalar_type()).div_(1 - p);
    return at::native_dropout_backward(x, mask, 1.0 / (1 - p));
  }

  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& A, const at::Tensor& B, double p) {
    const at::ScalarType dt = compute_dtype(x, A);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // the casts are explicit
    const std::int64_t in = A.size(1);
    const at::Tensor Ac = A.to(dt);
    at::Tensor a, mask;
    if (p > 0 && x.is_cpu()) {
      // at::dropout on the CPU draws a mask of x's dtype with bernoulli_ over
      // the whole of x (the same draws here); kept as bytes, applied a slice
      // of rows at a time
      mask = at::empty_like(x, at::MemoryFormat::Contiguous).bernoulli_(1 - p).to(at::kBool);
      const at::Tensor x2 = x.reshape({-1, in}), m2 = mask.reshape({-1, in});
      const std::int64_t n = x2.size(0), rows = slice_rows(in);
      a = at::empty({n, A.size(0)}, x.options().dtype(dt));
      for (std::int64_t s = 0; s < n; s += rows) {
        const std::int64_t k = std::min(rows, n - s);
        a.narrow(0, s, k).copy_(at::linear(dropped(x2.narrow(0, s, k), m2.narrow(0, s, k), p).to(dt), Ac));
      }
      auto shape = x.sizes().vec();
      shape.back() = A.size(0);
      a = a.view(shape);
    } else {
      at::Tensor h = x;
      if (p > 0) std::tie(h, mask) = at::native_dropout(x, p, /*train=*/true);
      a = at::linear(h.to(dt), Ac);
    }
    const at::Tensor Bc = B.to(dt);
    const at::Tensor u = at::linear(a, Bc);
    // A and B in the compute dtype (casts of r x features: small) kept, not cast again in backward
    ctx->save_for_backward({x, mask, A, B, a, Ac, Bc});
    ctx->saved_data["p"] = p;
    return {u};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &mask = saved[1], &A = saved[2], &B = saved[3], &a = saved[4], &Ac = saved[5],
                     &Bc = saved[6];
    const double p = ctx->saved_data["p"].toDouble();
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const at::ScalarType dt = a.scalar_type();
    const std::int64_t r = A.size(0), in = A.size(1), out = B.size(0);
    const at::Tensor g = grads[0].to(dt).reshape({-1, out});
    at::Tensor gx, gA, gB;
    if (ctx->needs_input_grad(2)) gB = g.t().mm(a.reshape({-1, r})).to(B.scalar_type());
    const bool want_x = ctx->needs_input_grad(0), want_A = ctx->needs_input_grad(1);
    if (want_x || want_A) {
      const at::Tensor ga = g.mm(Bc);
      const at::Tensor x2 = x.reshape({-1, in}), m2 = mask.defined() ? mask.reshape({-1, in}) : at::Tensor();
      const std::int64_t n = x2.size(0), rows = slice_rows(in);
      auto A_part = [&](std::int64_t s, std::int64_t k, const at::Tensor& ms) {
        return ga.narrow(0, s, k).t().to(at::kFloat).mm(dropped(x2.narrow(0, s, k), ms, p).to(at::kFloat));
      };
      auto x_part = [&](std::int64_t s, std::int64_t k, const at::Tensor& ms) {
        return dropped(ga.narrow(0, s, k).mm(Ac).to(x.scalar_type()), ms, p);
      };
      if (n <= rows) {
        // one slice (most layers): the products themselves, no buffers to sum or write into
        if (want_A) gA = A_part(0, n, m2).to(A.scalar_type());
        if (want_x) gx = x_part(0, n, m2).view(x.sizes());
      } else {
        // A's gradient summed over slices in fp32; x's written a slice at a time
        if (want_A) gA = at::zeros({r, in}, A.options().dtype(at::kFloat));
        if (want_x) gx = at::empty({n, in}, x.options());
        for (std::int64_t s = 0; s < n; s += rows) {
          const std::int64_t k = std::min(rows, n - s);
          const at::Tensor ms = m2.defined() ? m2.narrow(0, s, k) : at::Tensor();
          if (want_A) gA.add_(A_part(s, k, ms));
          if (want_x) gx.narrow(0, s, k).copy_(x_part(s, k, ms));
        }
        if (want_A) gA = gA.to(A.scalar_type());
        if (want_x) gx = gx.view(x.sizes());
      }
    }
    return {gx, gA, gB, at::Tensor()};
  }
};

}  // namespace detail

class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(std::int64_t in, std::int64_t out, bool bias = true) : in_features(in), out_features(out) {
    // the same initialisation as torch.nn.Linear
    torch::nn::Linear init(torch::nn::LinearOptions(in, out).bias(bias));
    weight = register_parameter("weight", init->weight.detach().clone());
    if (bias) this->bias = register_parameter("bias", init->bias.detach().clone());
  }

  /// The layer built in `dtype`: initialised as above (in fp32, then
  /// converted), or, with `init` false, left uninitialised for values that
  /// come from a file. `defer_weight` allocates no weight at all (a meta
  /// tensor of its shape): it arrives through quantize_nf4_from.
  LinearImpl(std::int64_t in, std::int64_t out, bool bias, at::ScalarType dtype, bool init, bool defer_weight = false)
      : in_features(in), out_features(out) {
    const auto opts = at::TensorOptions().dtype(dtype);
    if (init) {
      torch::nn::Linear made(torch::nn::LinearOptions(in, out).bias(bias));
      weight = register_parameter("weight", defer_weight ? at::empty({out, in}, opts.device(at::kMeta))
                                                         : made->weight.detach().to(dtype).clone());
      if (bias) this->bias = register_parameter("bias", made->bias.detach().to(dtype).clone());
    } else {
      weight = register_parameter("weight", at::empty({out, in}, defer_weight ? opts.device(at::kMeta) : opts));
      if (bias) this->bias = register_parameter("bias", at::empty({out}, opts));
    }
  }

  /// The layer deferred (wick/kit/deferral.hpp): its weight and bias hollow,
  /// their values made later by the build's recorded steps.
  struct Hollow {};
  LinearImpl(std::int64_t in, std::int64_t out, bool bias, at::ScalarType dtype, Hollow)
      : in_features(in), out_features(out) {
    const auto opts = at::TensorOptions().dtype(dtype);
    weight = register_parameter("weight", hollow({out, in}, opts));
    if (bias) this->bias = register_parameter("bias", hollow({out}, opts));
  }

  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y;
    if (nf4_) {
      // QLoRA: the 4-bit weight, dequantized to the compute dtype for this product only
      y = nf4_linear(x.to(compute_dtype_), *nf4_);
      if (bias.defined()) y = y + bias.to(y.scalar_type());
      y = y.to(x.scalar_type());
    } else {
      y = at::linear(x, weight, bias.defined() ? bias : at::Tensor());
    }
    if (lora_A) {
      const double p = dropout_ > 0 && is_training() ? dropout_ : 0.0;
      y = y + detail::LoraFunction::apply(x, lora_A->weight, lora_B->weight, p)[0].to(y.scalar_type()) * scale_;
    }
    return y;
  }

  /// Adds a LoRA adapter: y += (alpha / r) * B(A(dropout(x))); A as nn.Linear
  /// initialises it, B starts at zero, so the model's outputs do not change.
  void add_adapter(std::int64_t r, double alpha, double dropout) {
    lora_A = register_module("lora_A", torch::nn::Linear(torch::nn::LinearOptions(in_features, r).bias(false)));
    lora_B = register_module("lora_B", torch::nn::Linear(torch::nn::LinearOptions(r, out_features).bias(false)));
    at::NoGradGuard no_grad;
    lora_B->weight.zero_();
    lora_A->to(device());
    lora_B->to(device());
    scale_ = alpha / static_cast<double>(r);
    dropout_ = dropout;
  }

  bool has_adapter() const { return static_cast<bool>(lora_A); }

  /// Stores the weight as NF4 with double-quantized block constants (see
  /// wick/kit/nf4.hpp) and drops the float weight; products run in `compute`.
  /// Quantized a chunk at a time (the bytes of nf4_quantize), and the freed
  /// temporaries handed back (release_free_heap): quantizing a loaded
  /// model's layers in turn leaves it resident at its 4-bit size.
  /// A deferred layer (its weight hollow: a model built with deferred =
  /// true) becomes a hollow NF4 layer whose float weight is quantized as it
  /// arrives: the value a deferred build makes for the former weight
  /// (deferred_float_weight()) is routed by the host to emit_nf4_from.
  void quantize_nf4(at::ScalarType compute = at::kBFloat16, std::int64_t block = 64) {
    if (nf4_) return;
    if (is_hollow(weight)) {
      at::Tensor was = weight;
      hollow_nf4(compute, block);
      deferred_float_ = was;
      return;
    }
    adopt_nf4(nf4_quantize_chunked(weight, block), compute);
    release_free_heap();
  }

  /// The hollow float weight a deferred layer had before quantize_nf4 made
  /// it a hollow NF4 one (undefined otherwise): a deferred build still makes
  /// this tensor's value, which is the float weight to quantize (the host
  /// hands it to emit_nf4_from, converted to this tensor's dtype first where
  /// the whole build's weight would have rounded it).
  const at::Tensor& deferred_float_weight() const { return deferred_float_; }

  /// The same from `w`, the weight's values as they arrive (a file's tensor,
  /// of this layer's shape), quantized a chunk at a time (nf4_quantize_chunked:
  /// the same bytes as quantize_nf4): the float weight is never allocated.
  void quantize_nf4_from(const at::Tensor& w, at::ScalarType compute = at::kBFloat16, std::int64_t block = 64) {
    if (nf4_) throw std::logic_error("wick::Linear: the weight is quantized already");
    if (w.sizes() != at::IntArrayRef{out_features, in_features})
      throw std::invalid_argument("wick::Linear: a weight of shape " + c10::str(w.sizes()) + " for a layer of [" +
                                  std::to_string(out_features) + ", " + std::to_string(in_features) + "]");
    adopt_nf4(nf4_quantize_chunked(w, block), compute);
    release_free_heap();
  }

  /// A deferred layer's weight as hollow NF4 tensors (their values come
  /// from emit_nf4 in the build's recorded steps).
  void hollow_nf4(at::ScalarType compute = at::kBFloat16, std::int64_t block = 64) {
    if (nf4_) throw std::logic_error("wick::Linear: the weight is quantized already");
    adopt_nf4(nf4_hollow({out_features, in_features}, block), compute);
  }
  /// A deferred NF4 layer's values: each of q's tensors to its hollow one.
  void emit_nf4(const Nf4Weight& q, const Deferral::Emit& emit) const {
    if (!nf4_) throw std::logic_error("wick::Linear: emit_nf4 on a layer that is not quantized");
    emit(nf4_->packed, q.packed);
    emit(nf4_->absmax_q, q.absmax_q);
    emit(nf4_->absmax_scale, q.absmax_scale);
    emit(nf4_->absmax_offset, q.absmax_offset);
  }

  /// A deferred NF4 layer's values quantized from `w`, the weight's values
  /// (a file's tensor or a fresh draw, of this layer's shape): through the
  /// host's emit.nf4() when it gives one (a rank of a divided run reads and
  /// quantizes only what its chunks come from), else quantized here
  /// (nf4_quantize_chunked) and each tensor emitted whole.
  void emit_nf4_from(const at::Tensor& w, const Deferral::Emit& emit) const {
    if (!nf4_) throw std::logic_error("wick::Linear: emit_nf4_from on a layer that is not quantized");
    if (w.sizes() != at::IntArrayRef{out_features, in_features})
      throw std::invalid_argument("wick::Linear: a weight of shape " + c10::str(w.sizes()) + " for a layer of [" +
                                  std::to_string(out_features) + ", " + std::to_string(in_features) + "]");
    if (emit.nf4()) emit.nf4()(*nf4_, w);
    else emit_nf4(nf4_quantize_chunked(w, nf4_->block, nf4_->scale_block), emit);
  }

  /// The NF4 block size of a quantized weight (0 when not quantized).
  std::int64_t nf4_block() const { return nf4_ ? nf4_->block : 0; }
  /// The dtype quantized products run in.
  void set_compute_dtype(at::ScalarType compute) { compute_dtype_ = compute; }

 private:
  void adopt_nf4(Nf4Weight q, at::ScalarType compute) {
    nf4_ = std::make_shared<Nf4Weight>(std::move(q));
    compute_dtype_ = compute;
    // a child module holds the 4-bit tensors: <layer>.nf4.packed, ...; they
    // move with the model and save with it
    auto store = std::make_shared<torch::nn::Module>("Nf4Weight");
    store->register_buffer("packed", nf4_->packed);
    store->register_buffer("absmax_q", nf4_->absmax_q);
    store->register_buffer("absmax_scale", nf4_->absmax_scale);
    store->register_buffer("absmax_offset", nf4_->absmax_offset);
    register_module("nf4", store);
    parameters_.erase("weight");
    weight = at::Tensor();
  }

 public:
  bool quantized() const { return static_cast<bool>(nf4_); }
  /// Bytes the base weight takes (4-bit codes and constants when quantized).
  std::int64_t weight_bytes() const { return nf4_ ? nf4_->bytes() : static_cast<std::int64_t>(weight.nbytes()); }
  /// The base weight in float (dequantized when quantized).
  at::Tensor dense_weight() const { return nf4_ ? nf4_dequantize(*nf4_, at::kFloat) : weight; }
  at::Device device() const { return nf4_ ? nf4_->packed.device() : weight.device(); }

  /// Folds the adapter into the weight and removes it. A quantized weight
  /// becomes a float weight again (dequantized, then the adapter added).
  void merge_adapter() {
    if (nf4_) {
      at::Tensor w = dense_weight();
      unregister_module("nf4");
      nf4_.reset();
      deferred_float_ = at::Tensor();
      weight = register_parameter("weight", w, /*requires_grad=*/false);
    }
    if (!lora_A) return;
    {
      at::NoGradGuard no_grad;
      weight.add_((lora_B->weight.matmul(lora_A->weight) * scale_).to(weight.scalar_type()));
    }
    unregister_module("lora_A");
    unregister_module("lora_B");
    lora_A = nullptr;
    lora_B = nullptr;
  }

  std::int64_t in_features, out_features;
  at::Tensor weight, bias;
  torch::nn::Linear lora_A{nullptr}, lora_B{nullptr};
  double scale_ = 0, dropout_ = 0;

 private:
  std::shared_ptr<Nf4Weight> nf4_;
  at::Tensor deferred_float_;  // quantize_nf4 of a deferred layer: the hollow float weight it had
  at::ScalarType compute_dtype_ = at::kBFloat16;
};
TORCH_MODULE(Linear);

/// Model capability: the wick::Linear layers adapters (lora, qlora) may
/// extend, by module name (for a language model: every linear layer but the
/// output head). A model class offers it by deriving from it too.
class AdapterTargets {
 public:
  virtual ~AdapterTargets() = default;
  virtual std::vector<std::pair<std::string, Linear>> linear_layers() = 0;
};

}  // namespace wick
