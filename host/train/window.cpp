// A window's forward and backward passes: micro-batch by micro-batch, or,
// for a model whose loss couples the window's samples, in three passes over
// all of them (GradCache). Ranks agree that none ran out of memory before
// gradients cross them; ZeRO-3 ranks pair their gathers with stand-ins.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "distributed/group.hpp"
#include "distributed/reducer.hpp"
#include "distributed/zero3.hpp"
#include "train/activation_checkpoint.hpp"
#include "train/device_feed.hpp"
#include "train/trainer.hpp"
#include "train/trainer_internal.hpp"

namespace wick {
using namespace trainer_internal;
namespace {

// sync = "micro_batch": a micro-batch before the last reduces its gradients
// at once; sum, then divide by the rank count, so the part accumulated before
// stays counted once.
void finish_early_sync(GradReducer& reducer, std::vector<std::pair<std::string, at::Tensor>>& params, Group& group,
                       std::int64_t step) {
  reducer.finish(step);
  at::NoGradGuard no_grad;
  for (auto& [name, p] : params)
    if (p.grad().defined()) p.mutable_grad().div_(group.size());
}


// embed()'s tensors for a micro-batch of `rows` items: as many as the first
// micro-batch's (at least one), each [items, width].
void check_embeddings(const std::vector<at::Tensor>& emb, const std::vector<at::Tensor>& first, std::int64_t rows,
                      const std::string& where) {
  if (emb.empty() || emb.size() != first.size())
    throw Error(where + ": the model's embed() must give the same number (at least one) of embeddings for every "
                "micro-batch");
  for (const auto& e : emb)
    if (e.dim() != 2 || e.size(0) != rows)
      throw Error(where + ": the model's embed() must give [items, width] tensors with one row per item (" +
                  std::to_string(rows) + " items), got " + c10::str(e.sizes()));
}

// Every micro-batch's (every rank's) embeddings of each kind, in fp32, as
// leaves whose gradients the window's loss gives; `offset`: this rank's first row.
std::vector<at::Tensor> window_embeddings(const std::vector<std::vector<at::Tensor>>& emb,
                                          const std::vector<std::int64_t>& widths, Group* group,
                                          const at::Device& device, const std::string& where, std::int64_t& offset) {
  std::vector<at::Tensor> all;
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  for (std::size_t k = 0; k < widths.size(); ++k) {
    std::vector<at::Tensor> parts;
    for (const auto& e : emb) parts.push_back(e[k].to(at::kFloat));
    at::Tensor local = parts.empty() ? at::zeros({0, widths[k]}, f32) : at::cat(parts);
    if (group) std::tie(local, offset) = group->all_gather_rows(local, widths[k], "the embeddings of " + where);
    all.push_back(local.detach().requires_grad_(true));
  }
  return all;
}

// The number of embeddings and their widths: from this rank's data, or, on a
// rank whose window is empty, from the others' (one small all-reduce).
std::vector<std::int64_t> embedding_widths(const std::vector<std::vector<at::Tensor>>& emb, Group* group,
                                           const std::string& where) {
  std::vector<std::int64_t> widths;
  if (!emb.empty())
    for (const auto& e : emb[0]) widths.push_back(e.size(1));
  if (group) {
    const int world = group->size();
    constexpr std::int64_t kMax = 16;
    if (static_cast<std::int64_t>(widths.size()) > kMax) throw Error(where + ": embed() gave more than 16 embeddings");
    std::vector<at::Tensor> meta{at::zeros({world, kMax + 1}, at::TensorOptions().dtype(at::kLong).device(group->device()))};
    if (!emb.empty()) {
      meta[0][group->rank()][0] = static_cast<std::int64_t>(widths.size());
      for (std::size_t k = 0; k < widths.size(); ++k) meta[0][group->rank()][static_cast<std::int64_t>(k) + 1] = widths[k];
    }
    group->all_reduce(meta, "the embedding sizes of " + where);
    const at::Tensor m = meta[0].cpu();
    for (int r = 0; r < world; ++r) {
      const auto n = m[r][0].item<std::int64_t>();
      if (n == 0) continue;
      std::vector<std::int64_t> theirs;
      for (std::int64_t k = 0; k < n; ++k) theirs.push_back(m[r][k + 1].item<std::int64_t>());
      if (widths.empty()) widths = theirs;
      else if (widths != theirs)
        throw Error(where + ": rank " + std::to_string(r) + "'s embeddings differ in number or width from rank " +
                    std::to_string(group->rank()) + "'s");
    }
  }
  return widths;
}

}  // namespace

// One window's pass: what its micro-batches share.
struct WindowPass {
  std::vector<Batch> pieces;  // the window's micro-batches, each cut in split_ parts
  std::size_t runs = 0;       // micro-batches every rank runs (ZeRO-3: the most any rank has)
  std::size_t i = 0;          // the micro-batch running now
  bool zero3 = false;
  bool agree = false;         // the ranks agree on no out-of-memory before the last backward
  bool agreed = false;        // ... and they did: the window cannot be redone
  bool tracing = false;       // ZeRO-3: the stand-in's pass that learns the collectives
  double inv_items = 0;
  std::string where;
  DeviceFeed* feed = nullptr;
  at::Tensor* loss_sum = nullptr;
  std::map<std::string, at::Tensor>* metric_sums = nullptr;
};

// ZeRO-3: every rank runs as many micro-batches as the rank with the most
// (their gathers and reduce-scatters pair up); a rank with fewer runs one
// sample of one it ran before again, its loss times zero, adding nothing.
std::size_t Trainer::agree_runs(const std::vector<Batch>& pieces) {
  Group* group = cfg_.group.get();
  if (!pieces.empty() && stand_in_.empty()) stand_in_ = one_sample(pieces.front());
  // each rank's count and whether it has a stand-in: every rank decides alike
  const auto a = group->all_gather_ints({static_cast<std::int64_t>(pieces.size()), stand_in_.empty() ? 0 : 1},
                                        "the micro-batch counts of step " + std::to_string(step_ + 1));
  ++host_reads_;
  std::size_t runs = 0;
  for (std::size_t q = 0; q < a.size(); q += 2) runs = std::max(runs, static_cast<std::size_t>(a[q]));
  for (int q = 0; q < group->size(); ++q)
    if (static_cast<std::size_t>(a[2 * q]) < runs && a[2 * q + 1] == 0)
      throw Error("shard = \"parameters\", step " + std::to_string(step_ + 1) + ": rank " + std::to_string(q) +
                  " has fewer micro-batches in this window than the others and has run none before to stand in "
                  "for them (the ranks' gathers must pair up); give every rank data from the first window on (a "
                  "larger data set, or fewer ranks)");
  return runs;
}

// One micro-batch's forward and backward; false: another rank ran out of
// memory before this window's gradients were reduced.
bool Trainer::pass_micro_batch(WindowPass& w, const Batch& batch, bool stand_in, bool last) {
  Group* group = cfg_.group.get();
  const at::Device device(cfg_.device);
  std::optional<StandInMode> mode;
  if (stand_in) mode.emplace(*model_);
  if (block_runner_) block_runner_->reset_runs();
  if (w.zero3) reducer_->begin_micro_batch();
  gather_root("the all-gather of the weights in no block, for micro-batch " + std::to_string(w.i + 1) + " of " + w.where);
  ForwardResult r;
  {
    RECORD_USER_SCOPE("wick::forward");
    AutocastScope autocast(cfg_.precision, device, /*cache=*/!w.zero3);
    try {
      r = model_->forward(w.feed->take(w.i, batch, stand_in));
    } catch (const c10::OutOfMemoryError&) {
      throw;
    } catch (const c10::Error& e) {
      throw Error(w.where + ", micro-batch " + std::to_string(w.i + 1) + " of " + std::to_string(w.pieces.size()) +
                  ": the model's forward failed on " + describe(batch) + ": " + e.what_without_backtrace());
    }
  }
  const std::int64_t counted = model_->count_items(batch);
  if (r.items != counted)
    throw Error("the model counted " + std::to_string(counted) + " items in a micro-batch before forward and " +
                std::to_string(r.items) + " in forward");
  if (!r.loss_sum.defined() || r.loss_sum.numel() != 1) throw Error("the model's forward must return a one-element loss sum");
  if (last && w.agree) {
    w.agreed = true;
    if (group->sum(0, "the out-of-memory check of " + w.where) > 0) return false;
  }
  // this backward reduces as it goes (ZeRO-3: every backward)
  if (group && (last || cfg_.sync_every_micro_batch || w.zero3)) reducer_->arm(/*early=*/!repeated_blocks());
  {
    RECORD_USER_SCOPE("wick::backward");
    at::Tensor l = r.loss_sum.reshape({}) * (stand_in ? 0.0 : w.inv_items);
    if (scaling()) l = l * scale_;
    if (block_runner_) block_runner_->prefetch_last();  // offload_activations: the last block's inputs on their way back
    l.backward();
    fold_grads();
  }
  check_late_gradients();
  if (group && !last && cfg_.sync_every_micro_batch) finish_early_sync(*reducer_, params_, *group, step_ + 1);
  if (w.zero3) {  // this micro-batch's sums, into this rank's chunks
    reducer_->finish(step_ + 1);
    reducer_->end_micro_batch();
  }
  if (stand_in) return true;
  add_to(*w.loss_sum, r.loss_sum.detach().to(at::kDouble).reshape({}));
  for (auto& [k, v] : r.metrics) add_to((*w.metric_sums)[k], metric_value(v));
  return true;
}

// ZeRO-3's first window: the stand-in (one sample, at loss x 0, the random
// state put back) runs first, so there is a whole micro-batch to follow.
void Trainer::trace_stand_in(WindowPass& w) {
  const RngState rng = rng_state(at::Device(cfg_.device));
  w.tracing = true;
  pass_micro_batch(w, stand_in_, /*stand_in=*/true, /*last=*/false);
  w.tracing = false;
  set_rng_state(rng);
}

// Out of memory in micro-batch w.i: false (every rank redoes the window in
// smaller parts), or an Error when the window cannot be redone.
bool Trainer::window_out_of_memory(WindowPass& w, const std::string& oom) {
  Group* group = cfg_.group.get();
  const std::string what = w.where + ", micro-batch " + std::to_string(std::min(w.i + 1, w.pieces.size())) + " of " +
                           std::to_string(w.pieces.size()) + ": out of memory: " + oom;
  if (!cfg_.split_on_oom) throw Error(what + " (recovery is off: on_oom = \"fail\")");
  if (w.zero3 && coupled_windows(*model_))
    throw Error(what + " (shard = \"parameters\" does not redo a window whose loss couples it: lower micro_batch "
                "and raise accumulate)");
  if (w.zero3) {
    // the rest of this micro-batch's collectives and the later ones', then the agreement
    if (!reducer_->drain(step_ + 1))
      throw Error(what + (w.tracing ? " (in the one-sample micro-batch that shard = \"parameters\" runs first "
                                      "to learn its collectives: the model does not fit even so)"
                                    : " (shard = \"parameters\": this micro-batch began with other "
                                      "collectives than the last whole one, so this rank cannot finish it "
                                      "with the others; lower micro_batch and raise accumulate)"));
    for (std::size_t j = w.i + 1; j < w.runs; ++j) reducer_->replay(step_ + 1);
    group->sum(1, "the out-of-memory check of " + w.where);
    return false;
  }
  if (group && !w.agree) throw Error(what + " (recovery across ranks needs sync = \"window\")");
  if (w.agreed) throw Error(what + " (after the ranks began their gradient all-reduce: cannot redo the window)");
  if (group) group->sum(1, "the out-of-memory check of " + w.where);  // tell the others: everyone redoes the window
  return false;
}

bool Trainer::run_window(const std::vector<Batch>& window, StepStats& s, at::Tensor& loss_sum,
                         std::map<std::string, at::Tensor>& metric_sums, std::string& oom_message) {
  Group* group = cfg_.group.get();
  WindowPass w;
  w.zero3 = partitioned();
  // Ranks agree that none ran out of memory before the last backward starts
  // its all-reduces: one small collective, only when recovery is on.
  w.agree = group && cfg_.split_on_oom && !cfg_.sync_every_micro_batch && !w.zero3;
  w.pieces = split_window(window, split_);
  w.runs = w.zero3 ? agree_runs(w.pieces) : w.pieces.size();
  w.inv_items = 1.0 / static_cast<double>(s.items);
  w.where = "step " + std::to_string(step_ + 1);
  w.loss_sum = &loss_sum;
  w.metric_sums = &metric_sums;
  DeviceFeed feed(at::Device(cfg_.device), w.pieces);
  w.feed = &feed;
  // ZeRO-3 recovers from running out of memory without a collective more per
  // gather: a rank that runs out partway through a micro-batch issues the
  // rest of its collectives as its last whole micro-batch issued them (with
  // nothing in them), and those of the window's later ones, and the ranks
  // agree once, after the window, to redo it in smaller parts.
  const bool recover = w.zero3 && cfg_.split_on_oom;
  try {
    if (coupled_windows(*model_) && (group || w.pieces.size() > 1)) {
      if (!run_coupled(w.pieces, w.runs, s, loss_sum, metric_sums, w.i, w.agree ? &w.agreed : nullptr)) return false;
      s.micro_batches = static_cast<std::int64_t>(w.pieces.size());
      return true;
    }
    if (w.agree && w.pieces.empty()) {
      w.agreed = true;
      if (group->sum(0, "the out-of-memory check of " + w.where) > 0) return false;
    }
    if (recover && w.runs > 0 && !reducer_->can_replay()) trace_stand_in(w);
    for (; w.i < w.runs; ++w.i) {
      const bool stand_in = w.i >= w.pieces.size();
      if (!pass_micro_batch(w, stand_in ? stand_in_ : w.pieces[w.i], stand_in, w.i + 1 == w.runs)) return false;
    }
    if (group && w.runs == 0) reducer_->arm();  // nothing to backpropagate: this rank sends zeros
    if (w.zero3 && w.runs == 0) reducer_->finish(step_ + 1);
    if (recover && group->sum(0, "the out-of-memory check of " + w.where) > 0) return false;
  } catch (const c10::OutOfMemoryError& e) {
    oom_message = e.what_without_backtrace();
    return window_out_of_memory(w, oom_message);
  }
  s.micro_batches = static_cast<std::int64_t>(w.pieces.size());
  return true;
}

// A loss over the whole window (contrastive), exactly, in three passes
// (GradCache): embeddings of every micro-batch without a graph; the loss over
// all of them (every rank's, gathered) and its gradient with respect to each
// embedding; then each micro-batch's embeddings again, with the graph and the
// random state of the first pass, backpropagating those gradients. Memory
// holds one micro-batch's graph at a time plus the window's embeddings.
bool Trainer::run_coupled(const std::vector<Batch>& pieces, std::size_t runs, StepStats& s, at::Tensor& loss_sum,
                          std::map<std::string, at::Tensor>& metric_sums, std::size_t& i, bool* agreed) {
  WindowCoupled& coupled = *coupled_windows(*model_);
  Group* group = cfg_.group.get();
  const at::Device device(cfg_.device);
  const std::string where = "step " + std::to_string(step_ + 1);
  const int world = group ? group->size() : 1;
  // ZeRO-3: as many embeddings and backwards on every rank (their gathers
  // pair up), a rank with fewer micro-batches running its stand-in, whose
  // embeddings count nowhere and whose backward takes zeros; every backward
  // reduces its gradients
  const bool zero3 = partitioned();
  // 1. embeddings, no graph; the random state before each micro-batch
  std::vector<RngState> states(runs);
  std::vector<std::vector<at::Tensor>> emb(pieces.size());
  std::vector<std::int64_t> rows(pieces.size());
  for (i = 0; i < runs; ++i) {
    states[i] = rng_state(device);
    at::NoGradGuard no_grad;
    AutocastScope autocast(cfg_.precision, device, /*cache=*/!zero3);
    gather_root("the all-gather of the weights in no block, for the embeddings of micro-batch " + std::to_string(i + 1) +
                " of " + where);
    if (i >= pieces.size()) {
      StandInMode mode(*model_);
      coupled.embed(to_device(stand_in_, device));
      continue;
    }
    rows[i] = model_->count_items(pieces[i]);
    emb[i] = coupled.embed(to_device(pieces[i], device));
    check_embeddings(emb[i], emb[0], rows[i], where);
  }
  // The number of embeddings and their widths: from this rank's data, or, on
  // a rank whose window is empty, from the others' (one small all-reduce).
  const std::vector<std::int64_t> widths = embedding_widths(emb, group, where);
  // 2. the loss over the window on every rank; gradients of the embeddings
  std::int64_t offset = 0;  // where this rank's rows start among every rank's
  std::vector<at::Tensor> all = window_embeddings(emb, widths, group, device, where, offset);
  for (auto& e : emb) e.clear();  // only the rows in `all` are needed now
  gather_root("the all-gather of the weights in no block, for the loss over " + where);
  ForwardResult r = coupled.window_loss(all);
  if (r.items != s.items)
    throw Error(where + ": the model's window_loss() counted " + std::to_string(r.items) + " items, the window holds " +
                std::to_string(s.items));
  if (!r.loss_sum.defined() || r.loss_sum.numel() != 1)
    throw Error("the model's window_loss() must return a one-element loss sum");
  // Every rank computes the same loss: its gradient for the parameters the
  // loss uses directly (a temperature) is divided by the rank count, as the
  // all-reduce sums it; the embeddings' gradients are taken whole.
  at::Tensor l = r.loss_sum.reshape({}) * (1.0 / static_cast<double>(s.items) / world);
  if (scaling()) l = l * scale_;
  l.backward();
  fold_grads();
  std::vector<at::Tensor> grads;
  for (auto& a : all) grads.push_back(a.grad() * static_cast<double>(world));
  all.clear();
  if (!group || group->rank() == 0) {  // the window's loss, counted once over the ranks
    add_to(loss_sum, r.loss_sum.detach().to(at::kDouble).reshape({}));
    for (auto& [k, v] : r.metrics) metric_sums[k] = metric_value(v);
  } else {
    for (auto& [k, v] : r.metrics) metric_sums[k] = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  }
  r = ForwardResult();
  // 3. each micro-batch again, with its graph, taking the cached gradients
  std::int64_t row = offset;
  for (i = 0; i < runs; ++i) {
    set_rng_state(states[i]);
    const bool stand_in = i >= pieces.size();
    std::vector<at::Tensor> e;
    if (block_runner_) block_runner_->reset_runs();
    gather_root("the all-gather of the weights in no block, for micro-batch " + std::to_string(i + 1) + " of " + where);
    {
      std::optional<StandInMode> mode;
      if (stand_in) mode.emplace(*model_);
      AutocastScope autocast(cfg_.precision, device, /*cache=*/!zero3);
      e = coupled.embed(to_device(stand_in ? stand_in_ : pieces[i], device));
    }
    std::vector<at::Tensor> g;
    for (std::size_t k = 0; k < e.size(); ++k)
      g.push_back(stand_in ? at::zeros_like(e[k]) : grads[k].narrow(0, row, rows[i]).to(e[k].scalar_type()));
    if (!stand_in) row += rows[i];
    const bool last = i + 1 == runs;
    if (last && agreed) {
      *agreed = true;
      if (group->sum(0, "the out-of-memory check of " + where) > 0) return false;
    }
    if (group && (last || cfg_.sync_every_micro_batch || zero3)) reducer_->arm(/*early=*/!repeated_blocks());
    if (block_runner_) block_runner_->prefetch_last();
    torch::autograd::backward(e, g);
    fold_grads();
    check_late_gradients();
    if (group && !last && cfg_.sync_every_micro_batch) finish_early_sync(*reducer_, params_, *group, step_ + 1);
    if (zero3) reducer_->finish(step_ + 1);  // this micro-batch's sums (the loss's own gradients with the first)
  }
  if (group && runs == 0) {  // at the point where the others check before their last backward
    if (agreed) {
      *agreed = true;
      if (group->sum(0, "the out-of-memory check of " + where) > 0) return false;
    }
    reducer_->arm();  // nothing to backpropagate: this rank sends zeros (and its temperature's share)
    if (zero3) reducer_->finish(step_ + 1);
  }
  return true;
}

}  // namespace wick
