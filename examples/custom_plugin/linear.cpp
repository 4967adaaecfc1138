// An out-of-tree wick plugin: the minimal model from the top of wick/plugin.hpp.
// Build it against an installed wick:
//   cmake -S examples/custom_plugin -B plugin-build -DCMAKE_PREFIX_PATH=<wick prefix>
//   cmake --build plugin-build
//   WICK_PLUGIN_PATH=plugin-build wick run examples/custom_plugin/recipe.lua
#include <wick/plugin.hpp>
#include <wick/model.hpp>
#include <torch/nn/modules/linear.h>

// A linear classifier: forward returns the summed loss and the item count.
class Linear : public wick::Model {
 public:
  explicit Linear(const wick::Options& o)
      : fc_(register_module("fc", torch::nn::Linear(o.get_int("inputs"), o.get_int("classes")))) {}
  wick::ForwardResult forward(const wick::Batch& b) override {
    auto logits = fc_->forward(b.at("x"));
    auto y = b.at("y");
    return {at::cross_entropy_loss(logits, y, {}, at::Reduction::Sum), y.size(0),
            {{"accuracy", logits.argmax(1).eq(y).sum()}}};
  }
 private:
  torch::nn::Linear fc_;
};

WICK_PLUGIN(wick::plugin<Linear>(
    "linear", "a linear classifier",
    {wick::opt_int("inputs", 4, "input features").at_least(1),
     wick::opt_int("classes", 2, "output classes").at_least(1)}))
