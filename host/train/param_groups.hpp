#pragma once
// Parameter groups (torch.optim's param_groups): one optimizer per group of
// parameters, each made from the same plugin with the group's options (lr,
// weight_decay, betas, ...) on top of the recipe's. A parameter belongs to
// the first group one of whose patterns names it (train/freeze.hpp's
// forms), the others to the default group, which has the recipe's options.
// Every group is an ordinary wick::Optimizer of its plugin, so every
// optimizer plugin has groups without knowing of them: it sees its group's
// options and its group's parameters, and step(lr) gets the group's
// scheduled rate (its own base rate times the schedule's factor).

#include <memory>
#include <string>
#include <vector>

#include "wick/optim.hpp"

namespace wick {

struct ParamGroup {
  std::string name;                   ///< the recipe's name for it, or "groups[i]"
  std::string log_name;               ///< its lr's name in step records: lr_<name>, or lr_group<i>
  std::vector<std::string> patterns;  ///< which parameters it takes
  std::shared_ptr<Optimizer> optim;   ///< made with the group's options
  NamedTensors params;                ///< filled by attach
};

class ParamGroups : public Optimizer {
 public:
  /// `label` names the optimizer in errors ("optim 'adamw'"); `rest` takes
  /// the parameters no group names.
  ParamGroups(std::string label, std::shared_ptr<Optimizer> rest, std::vector<ParamGroup> groups);

  /// Assigns each parameter to its group; a group that gets no parameter is
  /// an error naming it and its patterns (a typo, or parameters that are frozen).
  void attach(NamedTensors params) override;
  /// Sharded: this rank's pieces to their groups (a group may get none here;
  /// check() takes the whole parameters).
  void attach_shard(NamedTensors params, const std::vector<std::int64_t>& whole) override;
  /// The error attach() gives for a group that takes no parameter of `params`.
  void check(const NamedTensors& params) const;
  /// lr: the default group's rate; every group steps at its base rate scaled
  /// as the default's is (the schedule's factor).
  void step(double lr) override;
  /// Every group at its own base rate times `factor`.
  void step_scaled(double factor);
  double base_lr() const override { return rest_->base_lr(); }
  std::map<std::string, at::Tensor> state() const override;
  void load_state(const std::map<std::string, at::Tensor>& state) override;
  std::int64_t state_bytes(const NamedTensors& params) const override;

  /// The groups, then the default group (name "default"), with their parameters.
  const std::vector<ParamGroup>& groups() const { return groups_; }
  const ParamGroup& rest() const { return rest_group_; }

 private:
  /// Puts each parameter in its group; the whole sizes by group (`whole` or each tensor's numel).
  std::vector<std::vector<std::int64_t>> assign(const NamedTensors& params, const std::vector<std::int64_t>& whole);
  /// Which group (index; groups_.size() for the default) takes `name`.
  std::size_t group_of(const std::string& name) const;
  std::string label_;
  std::shared_ptr<Optimizer> rest_;
  std::vector<ParamGroup> groups_;
  ParamGroup rest_group_;
};

}  // namespace wick
