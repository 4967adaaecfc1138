// model `mlp`: a multi-layer perceptron with PyTorch's parameter names
// (nn.Sequential(Linear, act, Linear, ...): 0.weight, 0.bias, 2.weight, ...).
// Samples are rows x [inputs] or, with a mask, several items x [T, inputs].

#include <wick/kit/dtype_names.hpp>
#include <wick/model.hpp>

#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/tanh.h>
#include <torch/nn/modules/linear.h>

namespace {

class Mlp : public wick::Model {
 public:
  explicit Mlp(const wick::Options& o) : loss_(o.get_string("loss")), act_(o.get_string("activation")) {
    std::int64_t in = o.get_int("inputs");
    // nn.Sequential(Linear, act, Linear, act, ..., Linear): linear layers at even indices
    std::int64_t index = 0;
    for (auto h : o.get_int_list("hidden")) {
      layers_.push_back(register_module(std::to_string(index), torch::nn::Linear(torch::nn::LinearOptions(in, h).bias(o.get_bool("bias")))));
      index += 2;
      in = h;
    }
    layers_.push_back(register_module(std::to_string(index), torch::nn::Linear(torch::nn::LinearOptions(in, o.get_int("outputs")).bias(o.get_bool("bias")))));
    to(wick::parse_enum(wick::kDtypeNames, o.get_string("dtype"), "dtype"));
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
    at::Tensor h = x.to(layers_.front()->weight.scalar_type());
    // each hidden layer (linear, then activation) is a block, named as its linear layer
    for (std::size_t i = 0; i + 1 < layers_.size(); ++i) {
      // by value: a checkpointed block runs again in backward
      h = run_block(std::to_string(2 * i),
                    [this, layer = layers_[i].ptr()](const at::Tensor& in) { return activation(layer->forward(in)); }, h);
    }
    at::Tensor out = layers_.back()->forward(h).to(at::kFloat);
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

  // every hidden layer with its activation; the output layer is not a block
  std::vector<std::string> blocks() const override {
    std::vector<std::string> t;
    for (std::size_t i = 0; i + 1 < layers_.size(); ++i) t.push_back(std::to_string(2 * i));
    return t;
  }

 private:
  at::Tensor activation(const at::Tensor& x) const {
    if (act_ == "relu") return at::relu(x);
    if (act_ == "gelu") return at::gelu(x);
    if (act_ == "tanh") return at::tanh(x);
    if (act_ == "sigmoid") return at::sigmoid(x);
    return at::silu(x);
  }

  std::vector<torch::nn::Linear> layers_;
  std::string loss_, act_;
  std::int64_t outputs_ = 1;
};

}  // namespace

WICK_PLUGIN(wick::plugin<Mlp>(
    "mlp", "multi-layer perceptron (PyTorch nn.Sequential names), cross-entropy or MSE loss",
    {wick::opt_int("inputs", 4, "input features").at_least(1),
     wick::opt("hidden", wick::OptionType::IntList, wick::List{64}, "hidden layer widths ({} for none)").at_least(1),
     wick::opt_int("outputs", 2, "outputs (classes for cross_entropy)").at_least(1),
     wick::opt_string("activation", "relu", "activation between layers").one_of({"relu", "gelu", "tanh", "sigmoid", "silu"}),
     wick::opt_string("loss", "cross_entropy", "loss per item").one_of({"cross_entropy", "mse"}),
     wick::opt_bool("bias", true, "linear layers have a bias"),
     wick::opt_string("dtype", "fp32", "weight dtype").one_of(wick::enum_names(wick::kDtypeNames))}))
