#include "distributed/zero3.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "distributed/reducer.hpp"

namespace wick {

std::vector<at::Tensor> PartitionRunner::run(const std::string& block, const Fn& fn,
                                             const std::vector<at::Tensor>& inputs) {
  auto it = units_.find(block);
  if (it == units_.end()) return inner_ ? inner_->run(block, fn, inputs) : fn(inputs);
  GradReducer* r = reducer_;
  const std::size_t u = it->second;
  const std::string what = "the all-gather of block " + block + "'s weights";
  r->gather_unit(u, what);
  // a checkpointed block runs fn again during its backward: its weights first
  Fn gathered = [r, u, fn, what](const std::vector<at::Tensor>& in) {
    r->gather_unit(u, what);
    return fn(in);
  };
  std::vector<at::Tensor> out = inner_ ? inner_->run(block, gathered, inputs) : fn(inputs);
  if (at::GradMode::is_enabled())
    for (auto& o : out)  // the gradient reaching the block's output: its backward is next
      if (o.defined() && o.requires_grad())
        o.register_hook([r, u, what](const at::Tensor&) { r->gather_unit(u, what + " for its backward"); });
  r->release_unit(u);
  return out;
}

Zero3Units zero3_units(const std::vector<std::pair<std::string, at::Tensor>>& params,
                       const std::vector<std::string>& blocks) {
  Zero3Units z;
  std::vector<std::vector<std::size_t>> of_block(blocks.size());
  std::vector<std::size_t> rest;
  for (std::size_t k = 0; k < params.size(); ++k) {
    std::size_t best = blocks.size(), len = 0;
    for (std::size_t b = 0; b < blocks.size(); ++b)
      if (params[k].first.starts_with(blocks[b] + ".") && blocks[b].size() >= len) best = b, len = blocks[b].size();
    (best < blocks.size() ? of_block[best] : rest).push_back(k);
  }
  for (std::size_t b = blocks.size(); b-- > 0;)
    if (!of_block[b].empty()) {
      z.unit_of_block[blocks[b]] = z.units.size();
      z.units.push_back(of_block[b]);
    }
  if (!rest.empty()) {
    z.root = z.units.size();
    z.units.push_back(rest);
  }
  return z;
}

void check_tied_units(const std::vector<std::pair<std::string, at::Tensor>>& params, const Zero3Units& z) {
  std::map<const c10::TensorImpl*, std::pair<std::string, std::size_t>> seen;
  for (std::size_t u = 0; u < z.units.size(); ++u)
    for (auto k : z.units[u]) {
      auto [it, fresh] = seen.emplace(params[k].second.unsafeGetTensorImpl(), std::make_pair(params[k].first, u));
      if (!fresh && it->second.second != u)
        throw Error("shard = \"parameters\": '" + params[k].first + "' and '" + it->second.first +
                    "' are one tensor used in two blocks (or a block and the rest); its weights would be freed "
                    "while the other reads them: use shard = \"gradients\"");
    }
}

Batch one_sample(const Batch& b) {
  if (b.empty()) return b;
  const at::Tensor& first = b.begin()->second;
  if (first.dim() == 0 || first.size(0) <= 1) return b;
  for (const auto& [k, t] : b)
    if (t.dim() == 0 || t.size(0) != first.size(0)) return b;
  Batch out;
  for (const auto& [k, t] : b) out[k] = t.narrow(0, 0, 1).clone();
  return out;
}

}  // namespace wick
