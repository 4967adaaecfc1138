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

#include "wick/linear.hpp"
#include "wick/object.hpp"
#include "wick/plugin.hpp"

namespace wick {

/// A micro-batch: named tensors, first dimension the samples.
using Batch = std::map<std::string, at::Tensor>;

/// Sampling settings for Model::generate.
struct GenerateOptions {
  std::int64_t max_new_tokens = 32;
  double temperature = 0;   ///< 0: greedy
  std::int64_t top_k = 0;   ///< 0: no limit
  double top_p = 1.0;       ///< nucleus: smallest set of tokens whose probability reaches top_p
  std::int64_t eos_id = -1; ///< stop after this token (-1: never)
  std::uint64_t seed = 0;
};

struct ForwardResult {
  at::Tensor loss_sum;  ///< Required: sum of per-item losses (0-dim, differentiable)
  std::int64_t items;   ///< Required: items the loss sums over (samples or tokens)
  /// Optional: metric sums over the same items (e.g. number correct for
  /// "accuracy"); the host reports each divided by the item count.
  std::map<std::string, at::Tensor> metrics;
};

class Model : public Object, public torch::nn::Module {
 public:
  ObjectKind object_kind() const final { return ObjectKind::Model; }

  /// Required: loss sum, item count and metric sums for one micro-batch.
  virtual ForwardResult forward(const Batch& batch) = 0;

  /// Optional: the items a batch holds, known without running forward (the
  /// host normalises every micro-batch of a window by the window's total).
  /// Default: the "mask" tensor's sum if the batch has one, else the sample count.
  virtual std::int64_t count_items(const Batch& batch) const {
    if (auto it = batch.find("mask"); it != batch.end()) return it->second.sum().item<std::int64_t>();
    return batch.begin()->second.size(0);
  }

  /// Optional: the model's raw outputs (logits, predictions) for a batch,
  /// without the loss.
  virtual at::Tensor predict(const Batch& batch) {
    (void)batch;
    throw Error("this model does not implement predict()");
  }

  /// Optional: continue a token sequence (language models).
  virtual std::vector<std::int64_t> generate(const std::vector<std::int64_t>& prompt, const GenerateOptions& opts) {
    (void)prompt, (void)opts;
    throw Error("this model does not implement generate()");
  }

  /// Optional: what the model counts as an item ("samples", "tokens").
  virtual std::string item_name() const { return "samples"; }

  /// Optional, for losses that couple the samples of a window (contrastive
  /// losses, whose negatives are the other samples): true makes the host
  /// compute the loss over the whole window on all ranks at once, exactly as
  /// one large batch would, in two passes (GradCache, Gao et al. 2021):
  ///  1. embed() every micro-batch without a graph, and gather the
  ///     embeddings of all ranks;
  ///  2. window_loss() over them, whose backward gives each embedding's
  ///     gradient (and the gradients of parameters window_loss uses itself,
  ///     such as a temperature);
  ///  3. embed() each micro-batch again with the graph (same random state)
  ///     and backpropagate the cached gradients into it.
  /// forward() still computes the loss of one micro-batch alone (evaluation,
  /// probing, and models that choose the plain, per-micro-batch form).
  virtual bool window_coupled() const { return false; }
  /// The micro-batch's embeddings, each with the samples as first dimension.
  virtual std::vector<at::Tensor> embed(const Batch& batch) {
    (void)batch;
    throw Error("this model does not implement embed()");
  }
  /// Loss over the embeddings of a whole window: embeddings[k] is the
  /// concatenation of every micro-batch's (and every rank's, in rank order)
  /// embed()[k]. items must equal the count_items() sum over the same batches.
  virtual ForwardResult window_loss(const std::vector<at::Tensor>& embeddings) {
    (void)embeddings;
    throw Error("this model does not implement window_loss()");
  }

  /// Optional: names of submodules (LoRA targets) and of repeated blocks
  /// (checkpointing units).
  virtual std::vector<std::string> targets() const { return {}; }
  /// Optional: the wick::Linear layers adapters may extend, by module name
  /// (for a language model: every linear layer but the output head).
  virtual std::vector<std::pair<std::string, Linear>> linear_layers() { return {}; }
  virtual std::vector<std::string> blocks() const { return {}; }

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

  /// Runs block `name` (one of blocks()) on `inputs`: a plain call, or, when
  /// the recipe checkpoints this block, through the host's checkpointing (see
  /// wick/checkpoint.hpp). A model's forward calls its blocks through this
  /// and needs nothing else for activation checkpointing. A checkpointed
  /// `fn` runs again during backward, after forward has returned: it must
  /// capture what it uses by value (tensors, module holders), not by reference.
  std::vector<at::Tensor> run_block(const std::string& name,
                                    const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& fn,
                                    const std::vector<at::Tensor>& inputs) {
    if (block_runner_ && checkpointed_.count(name)) return block_runner_(fn, inputs);
    return fn(inputs);
  }
  /// The one-tensor form: x -> fn(x).
  at::Tensor run_block(const std::string& name, const std::function<at::Tensor(const at::Tensor&)>& fn,
                       const at::Tensor& x) {
    if (!(block_runner_ && checkpointed_.count(name))) return fn(x);
    return block_runner_([fn](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{fn(in[0])}; },
                         {x})[0];
  }

  using BlockRunner = std::function<std::vector<at::Tensor>(
      const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>&, const std::vector<at::Tensor>&)>;
  /// Host side: the blocks to checkpoint and how (empty set: none).
  void set_checkpointing(std::set<std::string> blocks, BlockRunner runner) {
    checkpointed_ = std::move(blocks);
    block_runner_ = std::move(runner);
  }
  const std::set<std::string>& checkpointed_blocks() const { return checkpointed_; }

 private:
  std::set<std::string> checkpointed_;
  BlockRunner block_runner_;
};

template <class T>
PluginDescriptor model_plugin(const char* name, const char* summary, OptionSchema options) {
  return make_descriptor(PluginKind::Model, name, summary, std::move(options),
                         &detail::make_object<T, Model>);
}

}  // namespace wick
