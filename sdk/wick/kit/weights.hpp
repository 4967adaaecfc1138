#pragma once
/// \file weights.hpp
/// Loading named tensors into a module's parameters and buffers by name, with
/// an error that lists what is missing, unexpected or of the wrong shape.

#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>

#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "wick/options.hpp"

namespace wick {

using NamedTensorList = std::vector<std::pair<std::string, at::Tensor>>;

/// Parameters then buffers, with the module's (PyTorch-compatible) names.
inline NamedTensorList module_state(torch::nn::Module& m) {
  NamedTensorList out;
  for (const auto& p : m.named_parameters(/*recurse=*/true)) out.emplace_back(p.key(), p.value());
  for (const auto& b : m.named_buffers(/*recurse=*/true)) out.emplace_back(b.key(), b.value());
  return out;
}

/// Copies `tensors` into `m` by name (converting dtype). Every parameter and
/// buffer must be given; names in `ignore` may be present in `tensors`
/// without a place in the module. `source` names the origin in errors.
inline void load_state(torch::nn::Module& m, const NamedTensorList& tensors, const std::string& source,
                       const std::set<std::string>& ignore = {}) {
  std::map<std::string, const at::Tensor*> given;
  for (const auto& [n, t] : tensors) given[n] = &t;
  auto state = module_state(m);
  std::vector<std::string> missing, mismatched, unexpected;
  std::set<std::string> expected;
  for (const auto& [name, t] : state) {
    expected.insert(name);
    auto it = given.find(name);
    if (it == given.end()) {
      missing.push_back(name);
    } else if (it->second->sizes() != t.sizes()) {
      std::ostringstream s;
      s << name << " (file " << it->second->sizes() << ", model " << t.sizes() << ")";
      mismatched.push_back(s.str());
    }
  }
  for (const auto& [name, t] : tensors)
    if (!expected.count(name) && !ignore.count(name)) unexpected.push_back(name);
  auto list = [](const std::vector<std::string>& xs) {
    std::string s;
    for (std::size_t i = 0; i < xs.size() && i < 8; ++i) s += (i ? ", " : "") + xs[i];
    if (xs.size() > 8) s += ", ... (" + std::to_string(xs.size()) + " in all)";
    return s;
  };
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty()) {
    std::string msg = "weights in " + source + " do not fit the model:";
    if (!missing.empty()) msg += " missing " + list(missing) + ";";
    if (!unexpected.empty()) msg += " unexpected " + list(unexpected) + ";";
    if (!mismatched.empty()) msg += " shape mismatch " + list(mismatched) + ";";
    msg.pop_back();
    throw Error(msg);
  }
  at::NoGradGuard no_grad;
  for (auto& [name, t] : state) t.copy_(*given.at(name));
}

}  // namespace wick
