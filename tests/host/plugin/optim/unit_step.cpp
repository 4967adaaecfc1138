// An optimizer whose update is not elementwise: each parameter moves lr
// along its gradient divided by the gradient's norm over the whole tensor.
// Over a flat piece of a parameter the norm is the piece's, not the whole's,
// so a sharded run must refuse it (it does not derive from
// wick::ElementwiseUpdates); unsharded it trains.
#include <wick/optim.hpp>

#include <ATen/ATen.h>

namespace {
class UnitStep : public wick::Optimizer {
 public:
  explicit UnitStep(const wick::Options& o) : lr_(o.get_number("lr")) {}
  void attach(wick::NamedTensors params) override { params_ = std::move(params); }
  void step(double lr) override {
    for (auto& [name, p] : params_)
      if (p.grad().defined()) p.sub_(p.grad() / (p.grad().norm() + 1e-12), lr);
  }
  double base_lr() const override { return lr_; }
  std::map<std::string, at::Tensor> state() const override { return {}; }
  void load_state(const std::map<std::string, at::Tensor>&) override {}
  std::int64_t state_bytes(const wick::NamedTensors&) const override { return 0; }

 private:
  double lr_;
  wick::NamedTensors params_;
};
}  // namespace

WICK_PLUGIN(wick::plugin<UnitStep>("unit_step", "descent along each tensor's unit gradient (not elementwise)",
                                   {wick::opt_number("lr", 0.01, "learning rate").at_least(0)}))
