// optim `schedule`: learning-rate multipliers per optimizer step, the
// formulas of transformers' get_*_schedule_with_warmup helpers: constant,
// linear, cosine (with a floor: get_cosine_with_min_lr_schedule_with_warmup),
// cosine_with_restarts (hard restarts), polynomial, inverse_sqrt, and
// warmup_stable_decay (get_wsd_schedule). A floor min_lr_ratio is the
// fraction of lr the decay ends at (polynomial: lr_end / lr).

#include <wick/optim.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr double kPi = 3.14159265358979323846;

class Schedule : public wick::Schedule {
 public:
  explicit Schedule(const wick::Options& o)
      : type_(o.get_string("type")),
        warmup_(o.get_int("warmup_steps")),
        total_(o.get_int("total_steps")),
        min_ratio_(o.get_number("min_lr_ratio")) {
    const std::string who = "schedule '" + type_ + "'";
    // each shape's own options: given to another shape they would do nothing, so they are refused
    const std::map<std::string, std::vector<std::string>> owners = {
        {"num_cycles", {"cosine", "cosine_with_restarts", "warmup_stable_decay"}},
        {"power", {"polynomial"}},
        {"timescale", {"inverse_sqrt"}},
        {"decay_steps", {"warmup_stable_decay"}},
        {"stable_steps", {"warmup_stable_decay"}},
        {"warmup_type", {"warmup_stable_decay"}},
        {"decay_type", {"warmup_stable_decay"}}};
    for (const auto& [key, types] : owners) {
      if (!o.has(key) || std::find(types.begin(), types.end(), type_) != types.end()) continue;
      std::string list;
      for (const auto& t : types) list += (list.empty() ? "" : ", ") + t;
      throw wick::Error(who + ": " + key + " is an option of type " + list + " only");
    }
    cycles_ = o.has("num_cycles") ? o.get_number("num_cycles") : type_ == "cosine_with_restarts" ? 1.0 : 0.5;
    power_ = o.has("power") ? o.get_number("power") : 1.0;
    // transformers' default: the warmup's length, or 10,000 without one
    timescale_ = o.has("timescale") ? o.get_int("timescale") : (warmup_ > 0 ? warmup_ : 10000);
    warmup_type_ = o.has("warmup_type") ? o.get_string("warmup_type") : "linear";
    decay_type_ = o.has("decay_type") ? o.get_string("decay_type") : "cosine";
    if (o.has("stable_steps")) stable_ = o.get_int("stable_steps");
    if (type_ == "warmup_stable_decay") {
      if (!o.has("decay_steps")) throw wick::Error(who + ": decay_steps is required (the steps of the decay phase)");
      decay_steps_ = o.get_int("decay_steps");
      if (!stable_ && total_ > 0 && warmup_ + decay_steps_ > total_)
        throw wick::Error(who + ": warmup_steps " + std::to_string(warmup_) + " + decay_steps " +
                          std::to_string(decay_steps_) + " exceed total_steps " + std::to_string(total_) +
                          ", expected them to fit (or give stable_steps)");
    }
    if (type_ == "cosine_with_restarts" && cycles_ != std::floor(cycles_))
      throw wick::Error(who + ": num_cycles must be a whole number of restarts, got " + wick::Value(cycles_).repr());
    if (type_ == "polynomial" && min_ratio_ >= 1.0)
      throw wick::Error(who + ": min_lr_ratio must be below 1 (lr_end below lr), got " + wick::Value(min_ratio_).repr());
  }

  double factor(std::int64_t step, std::int64_t run_total) const override {
    const std::int64_t total = total_ > 0 ? total_ : run_total;
    const double s = static_cast<double>(step);
    if (type_ == "warmup_stable_decay") return wsd(s, total);
    if (step < warmup_) return s / static_cast<double>(std::max<std::int64_t>(1, warmup_));
    if (type_ == "constant") return 1.0;
    if (type_ == "inverse_sqrt") {
      const double t = static_cast<double>(timescale_);
      return 1.0 / std::sqrt((s + (t - static_cast<double>(warmup_))) / t);
    }
    const double progress = (s - static_cast<double>(warmup_)) /
                            static_cast<double>(std::max<std::int64_t>(1, total - warmup_));
    if (type_ == "polynomial") {
      // past the end, or a decay over no steps (total <= warmup: transformers divides by zero): the floor
      if (step > total || total <= warmup_) return min_ratio_;
      const double remaining = 1.0 - (s - static_cast<double>(warmup_)) / static_cast<double>(total - warmup_);
      return (1.0 - min_ratio_) * std::pow(remaining, power_) + min_ratio_;
    }
    if (type_ == "cosine_with_restarts") {
      if (progress >= 1.0) return 0.0;
      return std::max(0.0, 0.5 * (1.0 + std::cos(kPi * std::fmod(cycles_ * progress, 1.0))));
    }
    double f = 0;
    if (type_ == "linear") f = std::max(0.0, 1.0 - progress);
    else f = std::max(0.0, 0.5 * (1.0 + std::cos(kPi * cycles_ * 2.0 * progress)));
    return min_ratio_ + (1.0 - min_ratio_) * f;
  }

  std::map<std::string, wick::Value> attributes() const override {
    return {{"type", type_}, {"warmup_steps", warmup_}};
  }

 private:
  // get_wsd_schedule's three phases: warmup from min_lr_ratio (linear, cosine
  // or 1-sqrt), stable at 1, decay to min_lr_ratio; min_lr_ratio after.
  double wsd(double s, std::int64_t total) const {
    const double w = static_cast<double>(warmup_);
    const double stable = static_cast<double>(stable_ ? *stable_ : total - warmup_ - decay_steps_);
    const double d = static_cast<double>(decay_steps_);
    if (s < w) {
      const double p = s / std::max(1.0, w);
      double f = warmup_type_ == "linear" ? p : warmup_type_ == "cosine" ? 0.5 * (1.0 - std::cos(kPi * p))
                                                                         : 1.0 - std::sqrt(1.0 - p);
      return std::max(0.0, f * (1.0 - min_ratio_) + min_ratio_);
    }
    if (s < w + stable) return 1.0;
    if (s < w + stable + d) {
      const double p = (s - w - stable) / std::max(1.0, d);
      double f = decay_type_ == "linear" ? 1.0 - p
                 : decay_type_ == "cosine" ? 0.5 * (1.0 + std::cos(kPi * cycles_ * 2.0 * p))
                                           : 1.0 - std::sqrt(p);
      return std::max(0.0, f * (1.0 - min_ratio_) + min_ratio_);
    }
    return min_ratio_;
  }

  std::string type_;
  std::int64_t warmup_, total_;
  double min_ratio_, power_ = 1.0, cycles_ = 0.5;
  std::int64_t decay_steps_ = 0, timescale_ = 10000;
  std::optional<std::int64_t> stable_;
  std::string warmup_type_, decay_type_;
};

}  // namespace

WICK_PLUGIN(wick::plugin<Schedule>(
    "schedule",
    "learning-rate schedule per optimizer step: constant, linear, cosine, cosine_with_restarts, polynomial, "
    "inverse_sqrt or warmup_stable_decay, with warmup (transformers' formulas)",
    {wick::opt_string("type", "constant", "shape after warmup")
         .one_of({"constant", "linear", "cosine", "cosine_with_restarts", "polynomial", "inverse_sqrt",
                  "warmup_stable_decay"}),
     wick::opt_int("warmup_steps", 0, "steps of linear warmup from 0").at_least(0),
     wick::opt_int("total_steps", 0, "steps the decay spans (0: the run's total)").at_least(0),
     wick::opt_number("min_lr_ratio", 0.0, "floor of the decay, as a fraction of lr (polynomial: lr_end / lr)").range(0, 1),
     wick::opt_number("num_cycles", wick::Value(),
                     "cosine: waves over the decay (default 0.5, a half wave); cosine_with_restarts: restarts "
                     "(default 1); warmup_stable_decay's cosine decay (default 0.5)")
         .at_least(0)
         .optional(),
     wick::opt_number("power", wick::Value(), "polynomial: the decay's power (default 1)").at_least(0).optional(),
     wick::opt_int("timescale", wick::Value(), "inverse_sqrt: the time scale (default warmup_steps, or 10000)")
         .at_least(1)
         .optional(),
     wick::opt_int("decay_steps", wick::Value(), "warmup_stable_decay: steps of the decay phase (required)")
         .at_least(1)
         .optional(),
     wick::opt_int("stable_steps", wick::Value(),
                   "warmup_stable_decay: steps at full lr (default: the total less warmup and decay)")
         .at_least(0)
         .optional(),
     wick::opt_string("warmup_type", wick::Value(), "warmup_stable_decay: the warmup's shape (default linear)")
         .one_of({"linear", "cosine", "1-sqrt"})
         .optional(),
     wick::opt_string("decay_type", wick::Value(), "warmup_stable_decay: the decay's shape (default cosine)")
         .one_of({"linear", "cosine", "1-sqrt"})
         .optional()}))
