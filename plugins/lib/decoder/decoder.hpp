#pragma once
// The LLaMA / Qwen2 decoder shared by the `decoder_lm` and `vlm` plugins
// (built once into the static library wick_decoder): token embedding,
// RMSNorm, rotary position embeddings, grouped-query attention through
// LibTorch's scaled-dot-product attention with a causal mask, SwiGLU MLP,
// optional q/k/v bias, tied or separate output head, with Hugging Face's
// parameter names.
//
// The owner (a wick::Model) registers the parts under the names it wants:
// decoder_lm as `model` and `lm_head` (LlamaForCausalLM), the VLM as
// `model.language_model` and `lm_head` (LlavaForConditionalGeneration), and
// gives Decoder the block prefix its layers run under (run_block).

#include <wick/model.hpp>
#include <wick/options.hpp>
#include <wick/kit/deferral.hpp>
#include <wick/kit/deferred_build.hpp>
#include <wick/kit/linear.hpp>
#include <wick/kit/weights.hpp>

#include "lib/decoder/config.hpp"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <filesystem>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace wick::decoder {

constexpr std::int64_t kIgnore = -100;

/// How the parameters are made: in `dtype` from the start (never an fp32
/// model converted afterwards); randomly initialised, or (init false) left
/// uninitialised for a folder's values; with `defer_linear`, the layers'
/// linear weights are not allocated at all (meta tensors): they arrive
/// quantized, tensor by tensor (wick::Linear::quantize_nf4_from).
/// With `quantize_block` > 0 and `init`, each layer's linear weight is
/// quantized to NF4 as soon as it is made (the same bytes as quantizing the
/// whole model afterwards), so a from-scratch QLoRA model never holds more
/// than one float layer.
/// With `deferral` (a deferred build, wick/kit/deferral.hpp), the
/// embeddings, the linear layers and the head are hollow (no bytes): their
/// random values (init) are recorded as steps of the deferral, to be made
/// where the host wants them; a folder's values are recorded by the model.
/// The norms' weights (ones or zeros, a vector each) are made at once.
struct Build {
  at::ScalarType dtype = at::kFloat;
  bool init = true;
  bool defer_linear = false;
  std::int64_t quantize_block = 0;
  wick::Deferral* deferral = nullptr;
};

/// The model options of 4-bit weights (decoder_lm's and vlm's): quantize, quantize_block.
wick::OptionSchema quantize_options();
/// quantize_block must divide every layer's linear weight count (and leave an
/// even count); throws naming the first layer (under `prefix`) it does not.
void check_nf4_block(const Config& c, std::int64_t block, const std::string& prefix, const std::string& who);

class RMSNormImpl : public torch::nn::Module {
 public:
  /// gemma: scales by (1 + weight) in fp32 before rounding to x's dtype
  /// (Gemma2RMSNorm), its weight starting at 0; else LLaMA's weight * x
  /// rounded, the weight starting at 1.
  RMSNormImpl(std::int64_t dim, double eps, at::ScalarType dtype = at::kFloat, bool gemma = false);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
  bool gemma_ = false;
};
TORCH_MODULE(RMSNorm);

class AttentionImpl : public torch::nn::Module {
 public:
  /// `layer`: its index, which says whether it slides (Config::sliding)
  explicit AttentionImpl(const Config& c, const Build& b = {}, std::int64_t layer = 0);
  /// cache: this layer's keys and values of earlier positions, extended in
  /// place; window: the sliding-window mask [T, S] (true: attend) when this
  /// layer's window is shorter than the S positions seen, else undefined
  /// documents: the packed documents' mask [B, 1, T, T] (true: attend; causal
  /// within each document, document_mask), or undefined
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     std::pair<at::Tensor, at::Tensor>* cache = nullptr, const at::Tensor& window = {},
                     const at::Tensor& documents = {});
  /// q_proj, k_proj, v_proj; or (Config::fused, Phi-3) qkv_proj alone
  wick::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, qkv_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  ///< Config::qk_norm (Qwen3)
  bool slides() const { return slides_; }

 private:
  Config c_;
  bool slides_ = false;
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const Config& c, const Build& b = {});
  /// act(gate) * up through down: SwiGLU, or GeGLU (gelu, tanh approximation) for Gemma
  at::Tensor forward(const at::Tensor& x);
  /// gate_proj and up_proj; or (Config::fused, Phi-3) gate_up_proj, gate's rows first
  wick::Linear gate_proj{nullptr}, up_proj{nullptr}, gate_up_proj{nullptr}, down_proj{nullptr};

 private:
  bool gelu_ = false;
};
TORCH_MODULE(Mlp);

class LayerImpl : public torch::nn::Module {
 public:
  explicit LayerImpl(const Config& c, const Build& b = {}, std::int64_t index = 0);
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     std::pair<at::Tensor, at::Tensor>* cache = nullptr, const at::Tensor& window = {},
                     const at::Tensor& documents = {});
  Attention self_attn{nullptr};
  Mlp mlp{nullptr};
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  /// Gemma: the MLP's input and output norms (post_attention_layernorm then
  /// normalises the attention's output)
  RMSNorm pre_feedforward_layernorm{nullptr}, post_feedforward_layernorm{nullptr};
};
TORCH_MODULE(Layer);

/// The sliding-window causal mask [T, S] (true: attend) of T new positions
/// after S - T earlier ones: position p sees p - window + 1 .. p, as
/// transformers' sliding_window_causal mask; undefined when no position
/// reaches past the window (plain causal attention then).
at::Tensor sliding_window_mask(std::int64_t window, std::int64_t T, std::int64_t S, at::Device device);

/// The attention mask [B, 1, T, T] (true: attend) of documents packed into
/// rows, from their position_ids [B, T]: a document starts where a position
/// is not the one before plus one (as transformers reads packed
/// position_ids); each token sees the tokens of its document up to itself.
at::Tensor document_mask(const at::Tensor& position_ids);

/// LlamaModel: embed_tokens, layers, norm.
class BodyImpl : public torch::nn::Module {
 public:
  explicit BodyImpl(const Config& c, const Build& b = {});
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};
TORCH_MODULE(Body);

/// The tensors of a Hugging Face folder: model.safetensors or the shards of
/// model.safetensors.index.json (wick::read_safetensors_folder).
wick::NamedTensorList read_folder(const std::filesystem::path& dir, const std::string& who);

/// Loads `weights` (named as in `m`) into `m` tensor by tensor, releasing
/// each as it lands (wick::load_state by rvalue). With block > 0, the weights
/// of `layers` (built with Build::defer_linear; names as in `m`) are quantized
/// to NF4 as they arrive instead, so the float layer never exists.
void load_quantizing(torch::nn::Module& m, wick::NamedTensorList&& weights, const std::string& source,
                     const std::set<std::string>& ignore,
                     const std::vector<std::pair<std::string, wick::Linear>>& layers, std::int64_t block);

/// The same for a deferred build (Build::deferral): `weights` are checked
/// against `m` now (names and shapes), the layers to quantize become hollow
/// NF4 ones, and one step is recorded that gives each tensor of the folder,
/// in the files' order, to the deferral's emit (converted to the dtype its
/// tensor is built in; quantized per layer with block > 0). The mapped files
/// stay open until the step has run.
void defer_loading(torch::nn::Module& m, wick::NamedTensorList&& weights, const std::string& source,
                   const std::set<std::string>& ignore, const std::vector<std::pair<std::string, wick::Linear>>& layers,
                   std::int64_t block, wick::Deferral& deferral);

/// tie_word_embeddings with a separate `head` tensor in the weights that
/// differs from `embed`: transformers then leaves the head untied and uses
/// the file's; so does this (c.tie becomes false), saying so on stderr.
void untie_if_distinct(Config& c, const wick::NamedTensorList& weights, const std::string& embed,
                       const std::string& head, const std::string& where);

/// The model options of the loss (decoder_lm's and vlm's): loss_chunk.
wick::OptionSchema loss_options();
/// loss_chunk left out: as many tokens as keep one chunk's fp32 logits within
/// kLossChunkBytes, between kLossChunkMin and kLossChunkMax (1024 tokens for
/// a 16 K vocabulary, 110 for Qwen's 151,936).
constexpr std::int64_t kLossChunkBytes = std::int64_t{64} << 20, kLossChunkMin = 32, kLossChunkMax = 1024;
constexpr std::int64_t kDefaultLossChunk = -1;  // the byte budget above
/// The chunk the budget gives for `vocab`.
std::int64_t budget_loss_chunk(std::int64_t vocab);

/// The output head and the summed cross-entropy over token rows, `chunk`
/// rows at a time, in one autograd function that keeps only its inputs and
/// one log-sum-exp per row and recomputes each chunk's logits in backward:
/// [tokens, vocab] logits (and their gradient) never exist whole. h [N,
/// hidden], w [vocab, hidden] (the head's weight, or the tied embedding),
/// labels [N] (kIgnore: no loss). Computes in autocast's dtype when autocast
/// is on for h's device (as at::linear would), the softmax in fp32. Returns
/// the loss sum (fp32, differentiable in h and w) and the number of rows
/// whose argmax is the label (the accuracy's numerator).
///
/// into_grad: w is a leaf whose gradient another use in the same graph
/// accumulates after this one (a tied embedding's lookup): backward adds the
/// head's part straight into w.grad() and hands autograd none, so no
/// [vocab, hidden] buffer exists beside the gradient; the lookup's own
/// contribution then runs w's accumulation (and its hooks, as a rank's
/// gradient reduction needs).
/// softcap > 0: the logits are softcap * tanh(logits / softcap) (Gemma 2's final_logit_softcapping).
std::pair<at::Tensor, at::Tensor> chunked_head_loss(const at::Tensor& h, const at::Tensor& w, const at::Tensor& labels,
                                                    std::int64_t chunk, bool into_grad = false, double softcap = 0);

/// Sampling of the next token from the last position's logits (greedy when
/// temperature is 0).
std::int64_t pick_token(const at::Tensor& logits, const wick::GenerateOptions& g, at::Generator& gen);

/// The rotary inverse frequencies [head_dim / 2] (fp32) and the cos/sin scale
/// of c.rope at a sequence of seq_len positions (dynamic scaling depends on
/// it; the others do not), as transformers' ROPE_INIT_FUNCTIONS compute them.
std::pair<at::Tensor, double> rope_frequencies(const Config& c, std::int64_t seq_len);

/// Body + head + rotary tables, run on behalf of `owner` (whose run_block
/// checkpoints the layers when the recipe asks).
class Decoder {
 public:
  using Cache = std::vector<std::pair<at::Tensor, at::Tensor>>;

  /// body_prefix: the owner's name of the body ("model" or
  /// "model.language_model"); the layers run as blocks "<body_prefix>.layers.N".
  Decoder(const Config& c, std::string body_prefix, const Build& b = {});

  /// Registers the body and (untied) head with the owner's modules: the body
  /// as `body_name` under `body_parent`, the head as "lm_head" under `owner`.
  void register_with(torch::nn::Module& body_parent, const std::string& body_name, torch::nn::Module& owner);

  /// Token embeddings. Tied to the head, the lookup's gradient is sparse
  /// (its rows only): the head's dense part is already in the gradient, which
  /// takes the rows in place, so no dense [vocab, hidden] temporary is made.
  at::Tensor embed(const at::Tensor& ids);
  /// The layers and the final norm over input embeddings x [B, T, hidden] at
  /// positions offset, offset + 1, ...; with a cache, the keys and values of
  /// the positions before are reused and these appended (no blocks then).
  /// position_ids [B, T] (a batch's "position_ids": documents packed into
  /// rows, data 'text' with pack_attention = "document"): each token's
  /// rotary position, and attention within each document only
  /// (document_mask); no cache then.
  at::Tensor hidden(at::Tensor x, wick::Model* owner, Cache* cache = nullptr, std::int64_t offset = 0,
                    const at::Tensor& position_ids = {});
  at::Tensor head(const at::Tensor& h);
  at::Tensor logits_from_embeds(const at::Tensor& x, wick::Model* owner, Cache* cache = nullptr,
                                std::int64_t offset = 0) {
    return head(hidden(x, owner, cache, offset));
  }
  at::Tensor logits(const at::Tensor& ids, wick::Model* owner, Cache* cache = nullptr, std::int64_t offset = 0) {
    return logits_from_embeds(embed(ids), owner, cache, offset);
  }
  /// Summed cross-entropy of logits [B, T, V] against labels [B, T] shifted by
  /// one (Hugging Face's convention), items, and the number right.
  /// (items >= 0: the count, known already.)
  static wick::ForwardResult loss(const at::Tensor& logits, const at::Tensor& labels, std::int64_t items = -1);
  /// The same from the final hidden states [B, T, hidden] (hidden()): the
  /// head and the loss in chunks of loss_chunk() tokens (chunked_head_loss),
  /// or through the whole logits when it is 0. The labels are checked
  /// against the vocabulary and counted on the host: host_labels, when
  /// given, holds their values there (wick::EarlyHost, its copy started
  /// before the forward's kernels), else they are read when this runs.
  wick::ForwardResult loss_from_hidden(const at::Tensor& h, const at::Tensor& labels,
                                       const at::Tensor& host_labels = {});
  /// Tokens per chunk of the head and loss (the `loss_chunk` option; 0:
  /// whole; kDefaultLossChunk: by the byte budget).
  void set_loss_chunk(std::int64_t n) { loss_chunk_ = n; }
  std::int64_t loss_chunk() const { return loss_chunk_ < 0 ? budget_loss_chunk(c_.vocab) : loss_chunk_; }
  /// The output head's weight [vocab, hidden]: lm_head's, or the embedding when tied.
  at::Tensor head_weight() const { return c_.tie ? body->embed_tokens->weight : lm_head->weight; }

  /// Continues from input embeddings [1, T, hidden] (a prompt, maybe with
  /// visual tokens), then one token id at a time, with a key/value cache.
  /// Refuses a prompt and max_new_tokens beyond the context (`who` names the model).
  /// `prompt_ids`: the prompt's token ids, which the repetition penalty counts
  /// (a vision-language prompt's image tokens among them, as transformers').
  std::vector<std::int64_t> generate_from_embeds(const at::Tensor& embeds, const wick::GenerateOptions& g,
                                                 const std::string& who,
                                                 const std::vector<std::int64_t>& prompt_ids = {});
  std::vector<std::int64_t> generate(const std::vector<std::int64_t>& prompt, const wick::GenerateOptions& g,
                                     const std::string& who);

  std::vector<std::string> blocks() const;
  /// Every linear layer of the layers, named "<body_prefix>.layers.N.self_attn.q_proj", ...
  std::vector<std::pair<std::string, wick::Linear>> linear_layers();
  /// The file names of the tied head that a folder may still carry.
  std::set<std::string> ignored_on_load() const;

  const Config& config() const { return c_; }
  /// Where the model computes: the final norm's device (the input embedding
  /// may stay in host memory, offload_embeddings).
  at::Device device() const { return body->norm->weight.device(); }
  /// The input embedding when it may stay in host memory (wick::HostLookups):
  /// untied; tied, it is the output head's weight too and none is given.
  std::vector<at::Tensor> host_lookup_tables() const {
    return c_.tie ? std::vector<at::Tensor>{} : std::vector<at::Tensor>{body->embed_tokens->weight};
  }
  std::string host_lookup_refusal() const {
    return c_.tie ? "its input embedding is tied to its output head (tie_word_embeddings), which uses it on the device"
                  : "";
  }

  /// Linear layers whose weight is 4-bit NF4 (quantize = "nf4").
  std::int64_t nf4_layers();
  /// Before a forward that will be backpropagated: refuses 4-bit linear layers
  /// (which do not train) without adapters when every other weight of the
  /// decoder trains, which no one chose: training would move only the
  /// embeddings, norms and head. A freeze of any of those says it was meant.
  /// `who` starts the message, `freeze` says how this model freezes weights.
  void check_nf4_training(const std::string& who, const std::string& freeze);

  Body body{nullptr};
  wick::Linear lm_head{nullptr};  ///< made in its dtype (a wick::Linear: no fp32 [vocab, hidden] first)

 private:
  Config c_;
  std::string prefix_;
  at::Tensor inv_freq_, original_inv_freq_;
  at::Tensor local_inv_freq_;
  std::int64_t padding_idx_ = -1;  // pad_token_id: its row of the lookup gets no gradient, as nn.Embedding's padding_idx  // Gemma 3's sliding layers: their own base, unscaled
  double rope_scale_ = 1.0;        // cos and sin times this (yarn's attention factor)
  std::int64_t rope_cached_ = 0;   // dynamic: the sequence length inv_freq_ was made for
  std::int64_t loss_chunk_ = kDefaultLossChunk;
  bool nf4_checked_ = false;  // check_nf4_training passed once
};

}  // namespace wick::decoder
