#pragma once
/// \file weights.hpp
/// Loading named tensors into a module's parameters and buffers by name, with
/// an error that lists what is missing, unexpected or of the wrong shape.

#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "wick/kit/safetensors.hpp"
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

/// Takes a tensor of the file in place of copying it into the module (for
/// example, a linear layer quantizing its weight as it arrives): true when
/// it did.
using TakeTensor = std::function<bool(const std::string& name, const at::Tensor& tensor)>;

namespace detail {

// The names missing, unexpected or of the wrong shape, as one error.
inline void check_fit(const NamedTensorList& state, const NamedTensorList& tensors, const std::string& source,
                      const std::set<std::string>& ignore) {
  std::map<std::string, const at::Tensor*> given;
  for (const auto& [n, t] : tensors) given[n] = &t;
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
}

// dst := src; a large tensor of a mapped file is copied in slices of rows,
// each slice's file pages released once copied, so no more than a slice of
// it is resident twice.
inline void copy_releasing(at::Tensor& dst, const at::Tensor& src) {
  constexpr std::int64_t kSliceBytes = std::int64_t{16} << 20;
  const std::int64_t bytes = src.numel() * src.element_size();
  if (src.dim() == 0 || bytes <= kSliceBytes || !wick::detail::is_file_view(src) || !src.is_contiguous() ||
      dst.sizes() != src.sizes()) {
    dst.copy_(src);
    return;
  }
  const std::int64_t rows = src.size(0), per = std::max<std::int64_t>(1, rows * kSliceBytes / bytes);
  for (std::int64_t r = 0; r < rows; r += per) {
    const std::int64_t n = std::min(per, rows - r);
    const at::Tensor part = src.narrow(0, r, n);
    dst.narrow(0, r, n).copy_(part);
    release_file_pages(part);
  }
}

}  // namespace detail

/// Copies `tensors` into `m` by name (converting dtype). Every parameter and
/// buffer must be given; names in `ignore` may be present in `tensors`
/// without a place in the module. `source` names the origin in errors.
inline void load_state(torch::nn::Module& m, const NamedTensorList& tensors, const std::string& source,
                       const std::set<std::string>& ignore = {}) {
  auto state = module_state(m);
  detail::check_fit(state, tensors, source, ignore);
  std::map<std::string, const at::Tensor*> given;
  for (const auto& [n, t] : tensors) given[n] = &t;
  at::NoGradGuard no_grad;
  for (auto& [name, t] : state) t.copy_(*given.at(name));
}

/// The same, consuming `tensors`: in the file's order, each is copied (or
/// given to `take`, when set and it takes it) and then dropped, so tensors
/// read from a mapped file (read_safetensors) release their pages as they
/// land and the model and the file are not both resident whole.
inline void load_state(torch::nn::Module& m, NamedTensorList&& tensors, const std::string& source,
                       const std::set<std::string>& ignore = {}, const TakeTensor& take = {}) {
  NamedTensorList in = std::move(tensors);
  std::map<std::string, at::Tensor> state;
  {
    auto list = module_state(m);
    detail::check_fit(list, in, source, ignore);
    for (auto& [n, t] : list) state.emplace(n, t);
  }
  at::NoGradGuard no_grad;
  for (auto& [name, t] : in) {
    auto it = state.find(name);
    if (it != state.end() && !(take && take(name, t))) detail::copy_releasing(it->second, t);
    t = at::Tensor();
  }
}

}  // namespace wick
