// optim `schedule`: learning-rate multipliers per optimizer step: constant,
// linear decay or cosine decay, each after a linear warmup (the formulas of
// the common get_*_schedule_with_warmup helpers).

#include <wick/optim.hpp>

#include <algorithm>
#include <cmath>

namespace {

class Schedule : public wick::Schedule {
 public:
  explicit Schedule(const wick::Options& o)
      : type_(o.get_string("type")),
        warmup_(o.get_int("warmup_steps")),
        total_(o.get_int("total_steps")),
        min_ratio_(o.get_double("min_lr_ratio")) {}

  double factor(std::int64_t step, std::int64_t run_total) const override {
    const std::int64_t total = total_ > 0 ? total_ : run_total;
    if (step < warmup_) return static_cast<double>(step) / static_cast<double>(std::max<std::int64_t>(1, warmup_));
    if (type_ == "constant") return 1.0;
    const double progress = static_cast<double>(step - warmup_) /
                            static_cast<double>(std::max<std::int64_t>(1, total - warmup_));
    double f = 0;
    if (type_ == "linear") f = std::max(0.0, 1.0 - progress);
    else f = std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * progress)));
    return min_ratio_ + (1.0 - min_ratio_) * f;
  }

  std::map<std::string, wick::Value> attributes() const override {
    return {{"type", type_}, {"warmup_steps", warmup_}};
  }

 private:
  std::string type_;
  std::int64_t warmup_, total_;
  double min_ratio_;
};

}  // namespace

WICK_PLUGIN(wick::plugin<Schedule>(
    "schedule", "learning-rate schedule per optimizer step: constant, linear or cosine, with warmup",
    {wick::opt_string("type", "constant", "shape after warmup").one_of({"constant", "linear", "cosine"}),
     wick::opt_int("warmup_steps", 0, "steps of linear warmup from 0").at_least(0),
     wick::opt_int("total_steps", 0, "steps the decay spans (0: the run's total)").at_least(0),
     wick::opt_float("min_lr_ratio", 0.0, "floor of the decay, as a fraction of lr").range(0, 1)}))
