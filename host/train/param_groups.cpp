#include "train/param_groups.hpp"

#include <ATen/core/Tensor.h>

#include "train/freeze.hpp"

namespace wick {

ParamGroups::ParamGroups(std::string label, std::shared_ptr<Optimizer> rest, std::vector<ParamGroup> groups)
    : label_(std::move(label)), rest_(std::move(rest)), groups_(std::move(groups)) {
  if (!rest_) throw Error(label_ + ": no optimizer for the default group");
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    auto& g = groups_[i];
    g.log_name = "lr_" + (g.name.empty() ? "group" + std::to_string(i + 1) : g.name);
    if (g.name.empty()) g.name = "groups[" + std::to_string(i + 1) + "]";
    if (g.patterns.empty())
      throw Error(label_ + ": " + g.name + ": expected params = a pattern or a list of patterns, got none");
    for (const auto& p : g.patterns) check_pattern(p, label_ + ": " + g.name);
    if (!g.optim) throw Error(label_ + ": " + g.name + ": no optimizer");
  }
  // each group's learning rate is logged as lr_<name>: a second group of a
  // name would overwrite the first's in every record
  for (std::size_t i = 0; i < groups_.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (groups_[i].log_name == groups_[j].log_name)
        throw Error(label_ + ": groups[" + std::to_string(j + 1) + "] and groups[" + std::to_string(i + 1) +
                    "] are both named '" + groups_[i].log_name.substr(3) + "' (each group's learning rate is logged "
                    "as lr_<name>): give each group a name of its own");
  rest_group_.name = "default";
  rest_group_.optim = rest_;
}

std::size_t ParamGroups::group_of(const std::string& name) const {
  for (std::size_t i = 0; i < groups_.size(); ++i)
    for (const auto& p : groups_[i].patterns)
      if (names_parameter(p, name)) return i;
  return groups_.size();
}

void ParamGroups::check(const NamedTensors& params) const {
  std::vector<bool> taken(groups_.size(), false);
  for (const auto& np : params)
    if (const std::size_t i = group_of(np.first); i < groups_.size()) taken[i] = true;
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    if (taken[i]) continue;
    const auto& g = groups_[i];
    std::string pats;
    for (const auto& p : g.patterns) pats += (pats.empty() ? "'" : ", '") + p + "'";
    std::string some;
    for (std::size_t k = 0; k < params.size() && k < 4; ++k) some += (k ? ", " : "") + params[k].first;
    throw Error(label_ + ": " + g.name + " (params " + pats + ") takes no trainable parameter (an earlier group " +
                "takes what it names, or it names none: the trainable parameters are named like " + some + ")");
  }
}

void ParamGroups::attach(NamedTensors params) {
  check(params);
  assign(params, {});
  for (auto& g : groups_) g.optim->attach(g.params);
  rest_->attach(rest_group_.params);
}

void ParamGroups::attach_shard(NamedTensors params, const std::vector<std::int64_t>& whole) {
  const auto wholes = assign(params, whole);
  for (std::size_t i = 0; i < groups_.size(); ++i) groups_[i].optim->attach_shard(groups_[i].params, wholes[i]);
  rest_->attach_shard(rest_group_.params, wholes.back());
}

std::vector<std::vector<std::int64_t>> ParamGroups::assign(const NamedTensors& params,
                                                            const std::vector<std::int64_t>& whole) {
  for (auto& g : groups_) g.params.clear();
  rest_group_.params.clear();
  std::vector<std::vector<std::int64_t>> wholes(groups_.size() + 1);
  for (std::size_t k = 0; k < params.size(); ++k) {
    const std::size_t i = group_of(params[k].first);
    (i < groups_.size() ? groups_[i] : rest_group_).params.push_back(params[k]);
    wholes[i].push_back(k < whole.size() ? whole[k] : params[k].second.numel());
  }
  return wholes;
}

void ParamGroups::step(double lr) {
  const double base = rest_->base_lr();
  step_scaled(base > 0 ? lr / base : 1.0);
}

void ParamGroups::step_scaled(double factor) {
  for (auto& g : groups_) g.optim->step(g.optim->base_lr() * factor);
  rest_->step(rest_->base_lr() * factor);
}

std::map<std::string, at::Tensor> ParamGroups::state() const {
  auto out = rest_->state();
  for (const auto& g : groups_)
    for (auto& [k, v] : g.optim->state())
      if (!out.emplace(k, v).second)
        throw Error(label_ + ": two groups keep state under one name, '" + k + "'");
  return out;
}

void ParamGroups::load_state(const std::map<std::string, at::Tensor>& state) {
  // each group takes its own parameters' entries (state is kept by parameter name)
  for (auto& g : groups_) g.optim->load_state(state);
  rest_->load_state(state);
}

std::int64_t ParamGroups::state_bytes(const NamedTensors& params) const {
  std::vector<NamedTensors> split(groups_.size() + 1);
  for (const auto& np : params) split[group_of(np.first)].push_back(np);
  std::int64_t n = rest_->state_bytes(split.back());
  for (std::size_t i = 0; i < groups_.size(); ++i) n += groups_[i].optim->state_bytes(split[i]);
  return n;
}

}  // namespace wick
