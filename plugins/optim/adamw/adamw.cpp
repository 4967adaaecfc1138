// optim `adamw`: Adam with decoupled weight decay, by PyTorch's update rule
// (torch.optim.AdamW; fp32 weights through its fused kernel, fused=True),
// amsgrad included.

#include <wick/optim.hpp>

#include <ATen/ops/_fused_adamw.h>
#include <map>

#include <ATen/ATen.h>

#include <cmath>

namespace {

class AdamW : public wick::Optimizer, public wick::ElementwiseUpdates {
 public:
  explicit AdamW(const wick::Options& o)
      : lr_(o.get_number("lr")),
        eps_(o.get_number("eps")),
        weight_decay_(o.get_number("weight_decay")),
        amsgrad_(o.get_bool("amsgrad")) {
    const auto betas = o.get_number_list("betas");
    if (betas.size() != 2)
      throw wick::Error("optim 'adamw': option 'betas': expected 2 numbers, got " + std::to_string(betas.size()));
    beta1_ = betas[0];
    beta2_ = betas[1];
    if (beta1_ < 0 || beta1_ >= 1 || beta2_ < 0 || beta2_ >= 1)
      throw wick::Error("optim 'adamw': option 'betas': expected values in [0, 1), got {" + std::to_string(beta1_) +
                        ", " + std::to_string(beta2_) + "}");
  }

  void attach(wick::NamedTensors params) override { params_ = std::move(params); }
  double base_lr() const override { return lr_; }

  void step(double lr) override {
    // fp32 (and fp64) weights: PyTorch's fused AdamW kernel (torch.optim.AdamW
    // with fused=True), one pass over each tensor, grouped by device and dtype
    std::map<std::pair<std::string, at::ScalarType>, Group> groups;
    for (auto& [name, p] : params_) {
      if (!p.grad().defined()) continue;
      const bool half = p.scalar_type() == at::kHalf || p.scalar_type() == at::kBFloat16;
      auto& s = state_[name];
      if (!s.exp_avg.defined()) {
        const auto like = half ? p.detach().to(at::kFloat) : p.detach();
        s.exp_avg = at::zeros_like(like, at::MemoryFormat::Preserve);
        s.exp_avg_sq = at::zeros_like(like, at::MemoryFormat::Preserve);
        if (amsgrad_) s.max_exp_avg_sq = at::zeros_like(like, at::MemoryFormat::Preserve);
      }
      if (!s.step_t.defined()) s.step_t = at::full({}, static_cast<double>(s.step), p.options().dtype(at::kFloat));
      s.step += 1;
      if (half) {
        half_step(p, s, lr);
        continue;
      }
      auto& g = groups[{p.device().str(), p.scalar_type()}];
      g.params.push_back(p);
      g.grads.push_back(p.grad());
      g.exp_avg.push_back(s.exp_avg);
      g.exp_avg_sq.push_back(s.exp_avg_sq);
      if (amsgrad_) g.max_exp_avg_sq.push_back(s.max_exp_avg_sq);
      g.steps.push_back(s.step_t);
    }
    for (auto& [key, g] : groups) {
      for (auto& t : g.steps) t.add_(1);  // as torch.optim does, before the kernel
      at::_fused_adamw_(g.params, g.grads, g.exp_avg, g.exp_avg_sq, g.max_exp_avg_sq, g.steps, lr, beta1_, beta2_,
                        weight_decay_, eps_, amsgrad_, /*maximize=*/false);
    }
  }

  std::int64_t state_bytes(const wick::NamedTensors& params) const override {
    std::int64_t n = 0;  // exp_avg, exp_avg_sq (and max_exp_avg_sq), fp32 for half-precision weights too
    for (const auto& [name, p] : params) n += (amsgrad_ ? 3 : 2) * p.numel() * std::max<std::int64_t>(4, p.element_size());
    return n;
  }

  std::map<std::string, at::Tensor> state() const override {
    std::map<std::string, at::Tensor> out;
    for (const auto& [name, s] : state_) {
      if (!s.exp_avg.defined()) continue;
      out[name + ".step"] = at::scalar_tensor(s.step, at::kFloat);
      out[name + ".exp_avg"] = s.exp_avg;
      out[name + ".exp_avg_sq"] = s.exp_avg_sq;
      if (s.max_exp_avg_sq.defined()) out[name + ".max_exp_avg_sq"] = s.max_exp_avg_sq;
    }
    return out;
  }

  void load_state(const std::map<std::string, at::Tensor>& in) override {
    state_.clear();
    for (const auto& [name, p] : params_) {
      auto it = in.find(name + ".exp_avg");
      if (it == in.end()) continue;
      auto& s = state_[name];
      s.step = static_cast<std::int64_t>(in.at(name + ".step").item<double>());
      s.step_t = at::Tensor();  // rebuilt from s.step at the next step
      s.exp_avg = it->second.to(p.device()).clone();
      s.exp_avg_sq = in.at(name + ".exp_avg_sq").to(p.device()).clone();
      if (auto m = in.find(name + ".max_exp_avg_sq"); m != in.end()) s.max_exp_avg_sq = m->second.to(p.device()).clone();
      else if (amsgrad_) s.max_exp_avg_sq = at::zeros_like(p);
    }
  }

 private:
  struct ParamState {
    std::int64_t step = 0;
    at::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq;
    at::Tensor step_t;  // the step as the fused kernel reads it
  };
  struct Group {
    std::vector<at::Tensor> params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, steps;
  };

  // Half-precision weights (bf16-true, fp16-true): the update and the moments
  // in fp32 (squared gradients underflow in fp16 and eps = 1e-8 rounds to
  // zero), the result rounded into the weight.
  void half_step(at::Tensor& p, ParamState& s, double lr) {
    const at::Tensor g = p.grad().to(at::kFloat);
    at::Tensor w = p.detach().to(at::kFloat);
    s.step_t.add_(1);
    if (weight_decay_ != 0) w.mul_(1 - lr * weight_decay_);
    s.exp_avg.lerp_(g, 1 - beta1_);
    s.exp_avg_sq.mul_(beta2_).addcmul_(g, g, 1 - beta2_);
    const double bias_correction1 = 1 - std::pow(beta1_, s.step);
    const double bias_correction2_sqrt = std::sqrt(1 - std::pow(beta2_, s.step));
    at::Tensor denom;
    if (amsgrad_) {
      at::maximum_out(s.max_exp_avg_sq, s.max_exp_avg_sq, s.exp_avg_sq);
      denom = (s.max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps_);
    } else {
      denom = (s.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps_);
    }
    w.addcdiv_(s.exp_avg, denom, -lr / bias_correction1);
    p.detach().copy_(w);
  }
  double lr_, eps_, weight_decay_, beta1_ = 0.9, beta2_ = 0.999;
  bool amsgrad_;
  wick::NamedTensors params_;
  std::map<std::string, ParamState> state_;
};

}  // namespace

WICK_PLUGIN(wick::plugin<AdamW>(
    "adamw", "Adam with decoupled weight decay (PyTorch's torch.optim.AdamW update)",
    {wick::opt_number("lr", 1e-3, "learning rate").at_least(0),
     wick::opt("betas", wick::OptionType::NumberList, wick::List{0.9, 0.999}, "coefficients of the running averages"),
     wick::opt_number("eps", 1e-8, "term added to the denominator").at_least(0),
     wick::opt_number("weight_decay", 0.01, "decoupled weight decay").at_least(0),
     wick::opt_bool("amsgrad", false, "use the maximum of past squared-gradient averages")}))
