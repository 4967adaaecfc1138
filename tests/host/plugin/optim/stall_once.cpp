// Plain SGD that sleeps once, at its `stall_at`-th step, for `stall_s`
// seconds, saying so on stderr: one step's noise (another process taking the
// core) at a chosen step, for `wick plan`'s median test (recipe_spec.lua).
#include <wick/optim.hpp>

#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <thread>

namespace {
class StallOnce : public wick::Optimizer {
 public:
  explicit StallOnce(const wick::Options& o)
      : lr_(o.get_number("lr")), stall_at_(o.get_int("stall_at")), stall_s_(o.get_number("stall_s")) {}
  void attach(wick::NamedTensors params) override { params_ = std::move(params); }
  void step(double lr) override {
    if (++steps_ == stall_at_) {
      std::fprintf(stderr, "stall_once: step %lld stalls %.1f s\n", static_cast<long long>(steps_), stall_s_);
      std::this_thread::sleep_for(std::chrono::duration<double>(stall_s_));
    }
    for (auto& [name, p] : params_)
      if (p.grad().defined()) p.sub_(p.grad(), lr);
  }
  double base_lr() const override { return lr_; }
  std::map<std::string, at::Tensor> state() const override { return {}; }
  void load_state(const std::map<std::string, at::Tensor>&) override {}  // the count of steps goes on
  std::int64_t state_bytes(const wick::NamedTensors&) const override { return 0; }

 private:
  double lr_;
  std::int64_t stall_at_;
  double stall_s_;
  std::int64_t steps_ = 0;
  wick::NamedTensors params_;
};
}  // namespace

WICK_PLUGIN(wick::plugin<StallOnce>("stall_once", "SGD that sleeps once, at a chosen step (a test of timing noise)",
                                    {wick::opt_number("lr", 0.01, "learning rate").at_least(0),
                                     wick::opt_int("stall_at", 1, "the step (counted from 1 over the process) that sleeps").at_least(1),
                                     wick::opt_number("stall_s", 1.0, "seconds it sleeps").at_least(0)}))
