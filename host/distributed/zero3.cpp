#include "distributed/zero3.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "distributed/group.hpp"
#include "distributed/reducer.hpp"
#include "wick/kit/nf4.hpp"

namespace wick {

bool fill_nf4(GradReducer& reducer, Group& group, const Nf4Weight& hollow, const at::Tensor& w) {
  const auto packed = reducer.kept(hollow.packed);
  if (!packed) return false;
  const std::int64_t n = w.numel(), block = hollow.block, blocks = n / block;
  if (n != hollow.numel() || n % block != 0 || n % 2 != 0)
    throw std::invalid_argument("fill_nf4: a weight of " + std::to_string(n) + " values for 4-bit tensors of " +
                                std::to_string(hollow.numel()) + " in blocks of " + std::to_string(block));
  at::NoGradGuard no_grad;
  // the absmax constants: each rank those of its share of the blocks, then all of them on every rank
  const std::int64_t world = group.size(), share = (blocks + world - 1) / world;
  const std::int64_t b0 = std::min(blocks, group.rank() * share), b1 = std::min(blocks, b0 + share);
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(group.device());
  at::Tensor mine = at::zeros({share}, opts), all = at::empty({share * world}, opts);
  if (b0 < b1) mine.narrow(0, 0, b1 - b0).copy_(nf4_absmax(w, block, b0, b1));
  group.all_gather(all, mine, "the 4-bit block constants of a deferred weight");
  const at::Tensor absmax = all.narrow(0, 0, blocks).cpu().contiguous();
  Nf4Weight q;
  q.shape = hollow.shape;
  q.block = block;
  q.scale_block = hollow.scale_block;
  nf4_quantize_constants(q, absmax);  // (one byte per 64 values: made whole, kept in part)
  for (auto [t, v] : {std::pair{hollow.absmax_q, q.absmax_q}, {hollow.absmax_scale, q.absmax_scale},
                      {hollow.absmax_offset, q.absmax_offset}})
    if (!reducer.fill(t, v)) throw std::logic_error("fill_nf4: a 4-bit weight's tensors lie in no unit");
  // the codes: of the values this rank keeps the bytes of (two to a byte)
  if (const auto [a, z] = *packed; a < z) reducer.fill(hollow.packed, nf4_pack(w, absmax, block, 2 * a, 2 * z), a);
  return true;
}

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
  if (at::GradMode::is_enabled()) {
    bool backward = false;
    for (auto& o : out)  // the gradient reaching the block's output: its backward is next
      if (o.defined() && o.requires_grad()) {
        o.register_hook([r, u, what](const at::Tensor&) { r->gather_unit(u, what + " for its backward"); });
        backward = true;
      }
    // frozen weights are read until the gradient of the block's input is
    // made (the end of its backward); with several inputs taking gradients,
    // the first of theirs is no such end, and the unit waits for the window's
    std::vector<at::Tensor> taking;
    for (const auto& i : inputs)
      if (i.defined() && i.requires_grad()) taking.push_back(i);
    if (backward && r->has_frozen(u) && taking.size() == 1)
      taking.front().register_hook([r, u](const at::Tensor&) { r->input_grad_ready(u); });
  }
  r->release_unit(u);
  return out;
}

namespace {
// The declared block a tensor belongs to (the longest block name that
// prefixes its name with a dot), or blocks.size() for the rest.
std::size_t block_of(const std::string& name, const std::vector<std::string>& blocks) {
  std::size_t best = blocks.size(), len = 0;
  for (std::size_t b = 0; b < blocks.size(); ++b)
    if (name.starts_with(blocks[b] + ".") && blocks[b].size() >= len) best = b, len = blocks[b].size();
  return best;
}
}  // namespace

Zero3Units zero3_units(const std::vector<std::pair<std::string, at::Tensor>>& params,
                       const std::vector<std::string>& blocks,
                       const std::vector<std::pair<std::string, at::Tensor>>& frozen) {
  Zero3Units z;
  // per block (and the rest, last): the trainable parameters and the frozen tensors
  std::vector<std::vector<std::size_t>> of_block(blocks.size() + 1), frozen_of(blocks.size() + 1);
  for (std::size_t k = 0; k < params.size(); ++k) of_block[block_of(params[k].first, blocks)].push_back(k);
  for (std::size_t k = 0; k < frozen.size(); ++k) frozen_of[block_of(frozen[k].first, blocks)].push_back(k);
  auto add = [&](std::size_t b) {
    z.units.push_back(of_block[b]);
    z.frozen.push_back(frozen_of[b]);
    return z.units.size() - 1;
  };
  for (std::size_t b = blocks.size(); b-- > 0;)
    if (!of_block[b].empty() || !frozen_of[b].empty()) z.unit_of_block[blocks[b]] = add(b);
  if (!of_block[blocks.size()].empty() || !frozen_of[blocks.size()].empty()) z.root = add(blocks.size());
  return z;
}

void check_tied_units(const std::vector<std::pair<std::string, at::Tensor>>& params, const Zero3Units& z,
                      const std::vector<std::pair<std::string, at::Tensor>>& frozen) {
  std::map<const c10::TensorImpl*, std::pair<std::string, std::size_t>> seen;
  auto check = [&](const std::pair<std::string, at::Tensor>& t, std::size_t u) {
    auto [it, fresh] = seen.emplace(t.second.unsafeGetTensorImpl(), std::make_pair(t.first, u));
    if (!fresh && it->second.second != u)
      throw Error("shard = \"parameters\": '" + t.first + "' and '" + it->second.first +
                  "' are one tensor used in two blocks (or a block and the rest); its weights would be freed "
                  "while the other reads them: use shard = \"gradients\"");
  };
  for (std::size_t u = 0; u < z.units.size(); ++u) {
    for (auto k : z.units[u]) check(params[k], u);
    if (u < z.frozen.size())
      for (auto k : z.frozen[u]) check(frozen[k], u);
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
