// optim `sgd`: stochastic gradient descent with momentum, dampening, Nesterov
// and weight decay, by PyTorch's update rule (torch.optim.SGD, single-tensor
// path), so the same gradients give the same weights.

#include <wick/optim.hpp>

#include <ATen/ATen.h>

namespace {

class Sgd : public wick::Optimizer, public wick::ElementwiseUpdates {
 public:
  explicit Sgd(const wick::Options& o)
      : lr_(o.get_number("lr")),
        momentum_(o.get_number("momentum")),
        dampening_(o.get_number("dampening")),
        weight_decay_(o.get_number("weight_decay")),
        nesterov_(o.get_bool("nesterov")) {
    if (nesterov_ && (momentum_ <= 0 || dampening_ != 0))
      throw wick::Error("optim 'sgd': nesterov needs momentum > 0 and dampening = 0");
  }

  void attach(wick::NamedTensors params) override { params_ = std::move(params); }
  double base_lr() const override { return lr_; }

  void step(double lr) override {
    for (auto& [name, p] : params_) {
      if (!p.grad().defined()) continue;
      at::Tensor g = p.grad();
      if (weight_decay_ != 0) g = g.add(p, weight_decay_);
      if (momentum_ != 0) {
        auto it = buf_.find(name);
        if (it == buf_.end()) {
          it = buf_.emplace(name, g.clone().detach()).first;
        } else {
          it->second.mul_(momentum_).add_(g, 1 - dampening_);
        }
        g = nesterov_ ? g.add(it->second, momentum_) : it->second;
      }
      p.add_(g, -lr);
    }
  }

  std::int64_t state_bytes(const wick::NamedTensors& params) const override {
    if (momentum_ == 0) return 0;
    std::int64_t n = 0;
    for (const auto& [name, p] : params) n += p.numel() * p.element_size();  // one momentum buffer each
    return n;
  }

  std::map<std::string, at::Tensor> state() const override {
    std::map<std::string, at::Tensor> s;
    for (const auto& [k, v] : buf_) s[k + ".momentum_buffer"] = v;
    return s;
  }

  void load_state(const std::map<std::string, at::Tensor>& s) override {
    buf_.clear();
    for (const auto& [name, p] : params_)
      if (auto it = s.find(name + ".momentum_buffer"); it != s.end()) buf_[name] = it->second.to(p.device()).clone();
  }

 private:
  double lr_, momentum_, dampening_, weight_decay_;
  bool nesterov_;
  wick::NamedTensors params_;
  std::map<std::string, at::Tensor> buf_;
};

}  // namespace

WICK_PLUGIN(wick::plugin<Sgd>(
    "sgd", "stochastic gradient descent (PyTorch's torch.optim.SGD update)",
    {wick::opt_number("lr", 1e-3, "learning rate").at_least(0),
     wick::opt_number("momentum", 0.0, "momentum factor").range(0, 1),
     wick::opt_number("dampening", 0.0, "dampening for momentum").range(0, 1),
     wick::opt_number("weight_decay", 0.0, "L2 penalty added to the gradient").at_least(0),
     wick::opt_bool("nesterov", false, "Nesterov momentum")}))
