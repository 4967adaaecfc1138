#pragma once
/// \file linear.hpp
/// wick::Linear: a linear layer with PyTorch's parameter names (weight, bias)
/// that parameter-efficient transforms can extend in place: a LoRA adapter
/// (lora_A, lora_B, with PEFT's names) added, trained, saved, merged. Model
/// plugins use it for the layers they offer as adapter targets and list them
/// in Model::linear_layers().

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cmath>

namespace wick {

class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(std::int64_t in, std::int64_t out, bool bias = true) : in_features(in), out_features(out) {
    // the same initialisation as torch.nn.Linear
    torch::nn::Linear init(torch::nn::LinearOptions(in, out).bias(bias));
    weight = register_parameter("weight", init->weight.detach().clone());
    if (bias) this->bias = register_parameter("bias", init->bias.detach().clone());
  }

  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = at::linear(x, weight, bias.defined() ? bias : at::Tensor());
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
    lora_A->to(weight.device());
    lora_B->to(weight.device());
    scale_ = alpha / static_cast<double>(r);
    dropout_ = dropout;
  }

  bool has_adapter() const { return static_cast<bool>(lora_A); }

  /// Folds the adapter into the weight and removes it.
  void merge_adapter() {
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
};
TORCH_MODULE(Linear);

}  // namespace wick
