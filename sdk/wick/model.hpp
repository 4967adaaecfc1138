#pragma once
/// \file model.hpp
/// Model plugins: a LibTorch module whose forward returns the summed loss over
/// the batch's items, the item count, and named metric sums.

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "wick/object.hpp"
#include "wick/plugin.hpp"

namespace wick {

/// A micro-batch: named tensors, first dimension the samples.
using Batch = std::map<std::string, at::Tensor>;

/// Sampling settings for Model::generate.
/// The host checks every value before a model sees it; a model refuses a
/// max_new_tokens its context cannot hold.
struct GenerateOptions {
  std::int64_t max_new_tokens = 32;
  double temperature = 0;   ///< 0: greedy
  std::int64_t top_k = 0;   ///< 0: no limit
  double top_p = 1.0;       ///< nucleus: smallest set of tokens whose probability reaches top_p
  std::int64_t eos_id = -1; ///< stop after this token (-1: never)
  std::uint64_t seed = 0;
  /// Optional: called with each new token as soon as it is chosen (streaming).
  std::function<void(std::int64_t)> on_token;
  /// Further end tokens: generation stops after any of these too (a chat
  /// template's end-of-turn tokens, generation_config.json's eos list).
  std::vector<std::int64_t> eos_ids;
  /// transformers' RepetitionPenaltyLogitsProcessor: the logit of every token
  /// in the prompt or generated so far is divided by it (multiplied where it
  /// is negative) before sampling or the greedy pick; 1: none; > 0.
  double repetition_penalty = 1.0;
  /// Optional: asked after each token (after on_token); true ends the
  /// generation there (stop strings: the caller decodes and looks).
  std::function<bool()> stop;
};

struct ForwardResult {
  at::Tensor loss_sum;  ///< Required: sum of per-item losses (0-dim, differentiable)
  std::int64_t items;   ///< Required: items the loss sums over (samples or tokens)
  /// Optional: metric sums over the same items (e.g. number correct for
  /// "accuracy"); the host reports each divided by the item count.
  std::map<std::string, at::Tensor> metrics;
};

/// Host side of Model::run_block: runs a block plainly or through activation
/// checkpointing, as the recipe chose. The host sets it; plugins never do.
class BlockRunner {
 public:
  using Fn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
  virtual ~BlockRunner() = default;
  virtual std::vector<at::Tensor> run(const std::string& block, const Fn& fn, const std::vector<at::Tensor>& inputs) = 0;
};

/// The model contract: a forward that sums the loss over the batch's items.
/// Further abilities are capabilities (Predictor, Generator, WindowCoupled
/// below; AdapterTargets in wick/kit/linear.hpp) that a model class adds by
/// deriving from them too, and that the host looks for with capability<C>().
class Model : public Object, public torch::nn::Module {
 public:
  static constexpr ObjectKind object_type = ObjectKind::Model;
  ObjectKind object_kind() const final { return object_type; }

  /// Required: loss sum, item count and metric sums for one micro-batch.
  virtual ForwardResult forward(const Batch& batch) = 0;

  /// Optional: the items a batch holds, known without running forward (the
  /// host normalises every micro-batch of a window by the window's total).
  /// Default: the "mask" tensor's sum if the batch has one, else the sample count.
  virtual std::int64_t count_items(const Batch& batch) const {
    if (auto it = batch.find("mask"); it != batch.end()) return it->second.sum().item<std::int64_t>();
    return batch.begin()->second.size(0);
  }

  /// Optional: what the model counts as an item ("samples", "tokens").
  virtual std::string item_name() const { return "samples"; }

  /// Optional: names of the repeated blocks (checkpointing units), each run
  /// through run_block.
  virtual std::vector<std::string> blocks() const { return {}; }

  /// Runs block `name` (one of blocks()) on `inputs`: a plain call, or, when
  /// the recipe checkpoints this block, through the host's checkpointing. A
  /// model's forward calls its blocks through this and needs nothing else for
  /// activation checkpointing. A checkpointed `fn` runs again during
  /// backward, after forward has returned: it must capture what it uses by
  /// value (tensors, module holders), not by reference.
  std::vector<at::Tensor> run_block(const std::string& name, const BlockRunner::Fn& fn,
                                    const std::vector<at::Tensor>& inputs) {
    return block_runner_ ? block_runner_->run(name, fn, inputs) : fn(inputs);
  }
  /// The one-tensor form: x -> fn(x).
  at::Tensor run_block(const std::string& name, const std::function<at::Tensor(const at::Tensor&)>& fn,
                       const at::Tensor& x) {
    if (!block_runner_) return fn(x);
    return block_runner_->run(
        name, [fn](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; }, {x})[0];
  }

  /// Host side: how blocks run (null: plainly). The runner outlives its use.
  void set_block_runner(BlockRunner* runner) { block_runner_ = runner; }
  BlockRunner* block_runner() const { return block_runner_; }

 private:
  BlockRunner* block_runner_ = nullptr;
};

/// Capability: the model's raw outputs (logits, predictions) for a batch,
/// without the loss (`wick.core.predict`).
class Predictor {
 public:
  virtual ~Predictor() = default;
  virtual at::Tensor predict(const Batch& batch) = 0;
};

/// Capability: continuing a token sequence (language models; `wick generate`).
class Generator {
 public:
  virtual ~Generator() = default;
  virtual std::vector<std::int64_t> generate(const std::vector<std::int64_t>& prompt, const GenerateOptions& opts) = 0;
  /// Optional: continue the first sample of a batch (models whose prompt is
  /// more than token ids: a vision-language model's picture and prompt).
  /// Default: generate() from the batch's input_ids row 0 (its
  /// attention_mask's real tokens when it has one).
  virtual std::vector<std::int64_t> generate_from(const Batch& inputs, const GenerateOptions& opts) {
    auto it = inputs.find("input_ids");
    if (it == inputs.end()) throw Error("generate: the batch has no input_ids");
    at::Tensor row = it->second.select(0, 0).cpu();
    if (auto m = inputs.find("attention_mask"); m != inputs.end())
      row = row.masked_select(m->second.select(0, 0).cpu().to(at::kBool));
    const auto* p = row.contiguous().data_ptr<std::int64_t>();
    return generate(std::vector<std::int64_t>(p, p + row.numel()), opts);
  }
};

/// Capability: input embedding tables that may stay in host memory while the
/// rest of the model is on the device (wick.train's offload_embeddings). The
/// model looks them up with wick::lookup (wick/kit/lookup.hpp), which runs a
/// lookup where its table is and brings only the looked-up rows to the ids'
/// device. A table also used otherwise on the device (an output head tied
/// to it) is not one of them.
class HostLookups {
 public:
  virtual ~HostLookups() = default;
  /// The model's own parameters that are such tables (none: the model cannot
  /// keep any in host memory as it stands, for the reason host_lookup_refusal gives).
  virtual std::vector<at::Tensor> host_lookup_tables() = 0;
  /// Why host_lookup_tables() is empty, for the error offload_embeddings
  /// gives (as "its input embedding is tied to the output head").
  virtual std::string host_lookup_refusal() const { return ""; }
};

/// Capability, for losses that couple the samples of a window (contrastive
/// losses, whose negatives are the other samples): the host computes the
/// loss over the whole window on all ranks at once, exactly as one large
/// batch would, in two passes (GradCache, Gao et al. 2021):
///  1. embed() every micro-batch without a graph, and gather the embeddings
///     of all ranks;
///  2. window_loss() over them, whose backward gives each embedding's
///     gradient (and the gradients of parameters window_loss uses itself,
///     such as a temperature);
///  3. embed() each micro-batch again with the graph (same random state) and
///     backpropagate the cached gradients into it.
/// Model::forward() still computes the loss of one micro-batch alone
/// (evaluation, probing, and models that choose the plain form).
class WindowCoupled {
 public:
  virtual ~WindowCoupled() = default;
  /// Optional: whether this instance couples its windows (a model may offer
  /// both forms, chosen by an option). Default: true.
  virtual bool window_coupled() const { return true; }
  /// The micro-batch's embeddings, each with the samples as first dimension.
  virtual std::vector<at::Tensor> embed(const Batch& batch) = 0;
  /// Loss over the embeddings of a whole window: embeddings[k] is the
  /// concatenation of every micro-batch's (and every rank's, in rank order)
  /// embed()[k]. items must equal the count_items() sum over the same batches.
  virtual ForwardResult window_loss(const std::vector<at::Tensor>& embeddings) = 0;
};

class Emit;  // wick/kit/deferral.hpp

/// Capability: deferred construction (wick/kit/deferral.hpp). A model built
/// deferred holds hollow tensors (shapes without bytes); materialize() makes
/// their values one tensor at a time, in the order a whole build makes them,
/// each handed to `sink` once, so the host keeps of each what it needs: under
/// shard = "parameters" a rank keeps its chunks and no rank ever holds the
/// whole model; elsewhere the host gives each tensor its whole value. The
/// values have the bits a whole build gives them.
class Deferred {
 public:
  virtual ~Deferred() = default;
  /// Whether some of the model's tensors still wait for their values (are
  /// hollow); false once the host gave each its storage.
  virtual bool deferred() const = 0;
  /// emit(tensor, value) (wick::Emit): `tensor` one of the model's
  /// parameters or buffers (every hollow one, and any the build made at once
  /// whose values come later, as a folder's norms), `value` its whole value
  /// (the dtype the build makes it in, on the CPU), valid during the call
  /// only; a 4-bit weight's through emit.nf4() when the host gives one. May
  /// run more than once, each time with the same values (a save streams them
  /// and keeps none). Deferral::run(emit) does all of this.
  virtual void materialize(const Emit& emit) = 0;
};

/// The capability C of a model, or null when it has none.
template <class C>
C* capability(Model& m) {
  return dynamic_cast<C*>(&m);
}

/// A window-coupled model that couples this run's windows, or null.
inline WindowCoupled* coupled_windows(Model& m) {
  auto* c = capability<WindowCoupled>(m);
  return c && c->window_coupled() ? c : nullptr;
}

}  // namespace wick
