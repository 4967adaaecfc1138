#pragma once
/// \file linear.hpp
/// wick::Linear: a linear layer with PyTorch's parameter names (weight, bias)
/// that parameter-efficient transforms can extend in place: a LoRA adapter
/// (lora_A, lora_B, with PEFT's names) added, trained, saved, merged, and the
/// base weight stored as 4-bit NF4 (QLoRA), dequantized on the fly. Model
/// plugins use it for the layers they offer as adapter targets and list them
/// in Model::linear_layers().

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "wick/kit/nf4.hpp"

namespace wick {

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
      at::Tensor h = dropout_ > 0 && is_training() ? at::dropout(x, dropout_, true) : x;
      y = y + lora_B->forward(lora_A->forward(h.to(lora_A->weight.scalar_type()))).to(y.scalar_type()) * scale_;
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
  void quantize_nf4(at::ScalarType compute = at::kBFloat16, std::int64_t block = 64) {
    if (nf4_) return;
    adopt_nf4(nf4_quantize(weight, block), compute);
  }

  /// The same from `w`, the weight's values as they arrive (a file's tensor,
  /// of this layer's shape), quantized a chunk at a time (nf4_quantize_chunked:
  /// the same bytes as quantize_nf4): the float weight is never allocated.
  void quantize_nf4_from(const at::Tensor& w, at::ScalarType compute = at::kBFloat16, std::int64_t block = 64) {
    if (nf4_) throw std::logic_error("wick::Linear: the weight is quantized already");
    if (w.sizes() != at::IntArrayRef{out_features, in_features})
      throw std::invalid_argument("wick::Linear: a weight of shape " + c10::str(w.sizes()) + " for a layer of [" +
                                  std::to_string(out_features) + ", " + std::to_string(in_features) + "]");
    adopt_nf4(nf4_quantize_chunked(w, block), compute);
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
