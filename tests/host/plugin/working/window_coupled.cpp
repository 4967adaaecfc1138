// A working WindowCoupled model (wick/model.hpp): the loss of a window is
// the squared norm of the mean embedding over all of its samples, times the
// sample count. It does not split into a sum over micro-batches, so only a
// host that computes it over the whole window (on all ranks) gets the
// gradients one large batch gets; forward() is the same loss over one
// micro-batch alone (what training uses with coupled = false).
#include <wick/model.hpp>
#include <wick/plugin.hpp>

#include <ATen/ATen.h>

namespace {
class MeanPull : public wick::Model, public wick::WindowCoupled {
 public:
  explicit MeanPull(const wick::Options& o) : coupled_(o.get_bool("coupled")) {
    at::manual_seed(o.get_int("seed"));
    w_ = register_parameter("w", at::randn({o.get_int("dim"), o.get_int("inputs")}));
  }
  bool window_coupled() const override { return coupled_; }
  wick::ForwardResult forward(const wick::Batch& b) override { return window_loss(embed(b)); }
  std::vector<at::Tensor> embed(const wick::Batch& b) override { return {b.at("x").to(at::kFloat).matmul(w_.t())}; }
  wick::ForwardResult window_loss(const std::vector<at::Tensor>& e) override {
    const std::int64_t n = e[0].size(0);
    return {e[0].mean(0).pow(2).sum() * static_cast<double>(n), n, {}};
  }

 private:
  bool coupled_;
  at::Tensor w_;
};
}  // namespace

WICK_PLUGIN(wick::plugin<MeanPull>("test_window_coupled", "pulls the window's mean embedding to 0 (window_loss())",
                                   {wick::opt_int("inputs", 4, "input features").at_least(1),
                                    wick::opt_int("dim", 3, "embedding size").at_least(1),
                                    wick::opt_int("seed", 0, "seed of the initial weights").at_least(0),
                                    wick::opt_bool("coupled", true, "couple the window (false: each micro-batch alone)")}))
