// model `mlp`: a multi-layer perceptron with PyTorch's parameter names
// (nn.Sequential(Linear, act, Linear, ...): 0.weight, 0.bias, 2.weight, ...).
// Samples are rows x [inputs] or, with a mask, several items x [T, inputs].

#include <wick/model.hpp>

#include <ATen/ops/cross_entropy_loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

namespace {

at::ScalarType parse_dtype(const std::string& s) {
  if (s == "bf16") return at::kBFloat16;
  if (s == "fp16") return at::kHalf;
  return at::kFloat;
}

class Mlp : public wick::Model {
 public:
  explicit Mlp(const wick::Options& o) : loss_(o.get_string("loss")) {
    std::int64_t in = o.get_int("inputs");
    const std::string act = o.get_string("activation");
    for (auto h : o.get_int_list("hidden")) {
      net_->push_back(torch::nn::Linear(torch::nn::LinearOptions(in, h).bias(o.get_bool("bias"))));
      if (act == "relu") net_->push_back(torch::nn::ReLU());
      else if (act == "gelu") net_->push_back(torch::nn::GELU());
      else if (act == "tanh") net_->push_back(torch::nn::Tanh());
      else if (act == "sigmoid") net_->push_back(torch::nn::Sigmoid());
      else net_->push_back(torch::nn::SiLU());
      in = h;
    }
    net_->push_back(torch::nn::Linear(torch::nn::LinearOptions(in, o.get_int("outputs")).bias(o.get_bool("bias"))));
    // Children of the Sequential are this module's children: names "0.weight", ...
    for (const auto& c : net_->named_children()) register_module(c.key(), c.value());
    to(parse_dtype(o.get_string("dtype")));
    outputs_ = o.get_int("outputs");
  }

  wick::ForwardResult forward(const wick::Batch& b) override {
    at::Tensor x = b.at("x");
    at::Tensor y = b.at("y");
    if (auto m = b.find("mask"); m != b.end()) {
      // several items per sample: keep the real ones
      const auto keep = m->second.reshape({-1}).to(at::kBool);
      x = x.reshape({-1, x.size(-1)}).index({keep});
      y = loss_ == "mse" ? y.reshape({-1, outputs_}).index({keep}) : y.reshape({-1}).index({keep});
    }
    const auto dtype = net_->parameters().front().scalar_type();
    at::Tensor out = net_->forward(x.to(dtype)).to(at::kFloat);
    wick::ForwardResult r;
    r.items = x.size(0);
    if (loss_ == "cross_entropy") {
      y = y.to(at::kLong);
      r.loss_sum = at::cross_entropy_loss(out, y, {}, at::Reduction::Sum);
      r.metrics["accuracy"] = out.argmax(-1).eq(y).sum();
    } else {
      y = y.to(at::kFloat).reshape(out.sizes());
      r.loss_sum = (out - y).pow(2).mean(-1).sum();
    }
    return r;
  }

  std::vector<std::string> targets() const override {
    std::vector<std::string> t;
    for (const auto& c : net_->named_children())
      if (c.value()->as<torch::nn::Linear>()) t.push_back(c.key());
    return t;
  }

 private:
  torch::nn::Sequential net_;
  std::string loss_;
  std::int64_t outputs_ = 1;
};

}  // namespace

WICK_PLUGIN(wick::model_plugin<Mlp>(
    "mlp", "multi-layer perceptron (PyTorch nn.Sequential names), cross-entropy or MSE loss",
    {wick::opt_int("inputs", 4, "input features").at_least(1),
     wick::opt("hidden", wick::OptionType::IntList, wick::List{64}, "hidden layer widths ({} for none)").at_least(1),
     wick::opt_int("outputs", 2, "outputs (classes for cross_entropy)").at_least(1),
     wick::opt_string("activation", "relu", "activation between layers").one_of({"relu", "gelu", "tanh", "sigmoid", "silu"}),
     wick::opt_string("loss", "cross_entropy", "loss per item").one_of({"cross_entropy", "mse"}),
     wick::opt_bool("bias", true, "linear layers have a bias"),
     wick::opt_string("dtype", "fp32", "weight dtype").one_of({"fp32", "bf16", "fp16"})}))
