// A working Predictor (wick/model.hpp): a linear map x -> x W^T whose raw
// outputs wick.core.predict writes; forward is the squared error against y.
#include <wick/model.hpp>
#include <wick/plugin.hpp>

#include <ATen/ATen.h>

namespace {
class LinearPredictor : public wick::Model, public wick::Predictor {
 public:
  explicit LinearPredictor(const wick::Options& o) {
    at::manual_seed(o.get_int("seed"));
    w_ = register_parameter("w", at::randn({o.get_int("outputs"), o.get_int("inputs")}));
  }
  wick::ForwardResult forward(const wick::Batch& b) override {
    const at::Tensor diff = predict(b) - b.at("y").to(at::kFloat).reshape({b.at("x").size(0), -1});
    return {diff.pow(2).sum(), b.at("x").size(0), {}};
  }
  at::Tensor predict(const wick::Batch& b) override { return b.at("x").to(at::kFloat).matmul(w_.t()); }

 private:
  at::Tensor w_;
};
}  // namespace

WICK_PLUGIN(wick::plugin<LinearPredictor>("test_predictor", "x -> x W^T, with predict()",
                                          {wick::opt_int("inputs", 4, "input features").at_least(1),
                                           wick::opt_int("outputs", 1, "outputs").at_least(1),
                                           wick::opt_int("seed", 0, "seed of the initial weights").at_least(0)}))
