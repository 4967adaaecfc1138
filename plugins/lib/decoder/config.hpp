#pragma once
// The decoder's sizes (decoder.hpp), from a Hugging Face config.json or from
// decoder_lm's options, checked before anything is allocated: each field of
// its JSON type (an integer is not 32.0), in range, the heads dividing the
// width, and the weights fitting in this machine's memory. No LibTorch: the
// config.json fuzz target builds this file alone.

#include <wick/options.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace wick::decoder {

/// Rotary scaling (config.json's rope_scaling, or rope_parameters' rope_type
/// and its fields), as transformers' modeling_rope_utils computes it.
struct RopeScaling {
  std::string type = "default";      ///< default, linear, dynamic, llama3 or yarn
  double factor = 1;                 ///< linear, dynamic, llama3, yarn
  std::int64_t original_max = 0;     ///< llama3, yarn: original_max_position_embeddings
  double low_freq_factor = 1, high_freq_factor = 4;  ///< llama3
  double beta_fast = 32, beta_slow = 1;              ///< yarn
  double attention_factor = 0;       ///< yarn: the cos/sin scale; 0: from factor (and mscale, mscale_all_dim)
  double mscale = 0, mscale_all_dim = 0;             ///< yarn
  bool truncate = true;              ///< yarn: whole dimensions at the correction range's ends
};

/// The decoder families wick reads from a Hugging Face folder (config.json's
/// model_type), as a refusal lists them.
inline constexpr const char* kFamilies = "llama, mistral, qwen2, qwen3, phi3, gemma2 or gemma3_text";

struct Config {
  /// llama, mistral, qwen2, qwen3 or phi3: what differs is below (qkv_bias,
  /// o_bias, qk_norm, fused, rotary_factor, the sliding window)
  std::string family = "llama";
  std::int64_t vocab = 32000, hidden = 512, intermediate = 1376, layers = 6, heads = 8, kv_heads = 8, head_dim = 0;
  double rope_theta = 10000, eps = 1e-6;
  /// The standard deviation of a fresh model's weights (initializer_range):
  /// linear and embedding weights normal(0, it), biases 0, norms 1, as
  /// transformers' _init_weights.
  double init_range = 0.02;
  /// The context (max_position_embeddings): positions a prompt and its
  /// continuation may use together.
  std::int64_t max_positions = 4096;
  bool tie = false, qkv_bias = false;
  /// o_proj's bias (LLaMA's and Qwen3's attention_bias covers it; Qwen2's does not)
  bool o_bias = false;
  /// Qwen3: an RMSNorm over each head's q and k (q_norm, k_norm) before the rotation
  bool qk_norm = false;
  /// Phi-3: q, k and v in one qkv_proj, gate and up in one gate_up_proj (Hugging Face's names)
  bool fused = false;
  /// The share of each head's features that rotate (Phi's partial_rotary_factor);
  /// the rotary size is head_dim * this, the rest pass unrotated.
  double rotary_factor = 1.0;
  /// Sliding-window attention: the layers marked in `sliding` see only the last
  /// sliding_window positions (their own included), as transformers'
  /// sliding_window_causal mask; 0: no layer slides.
  std::int64_t sliding_window = 0;
  std::vector<bool> sliding;
  /// Qwen2/Qwen3's max_window_layers, written back as it was read
  std::int64_t max_window_layers = 0;
  /// Gemma 2 / Gemma 3: RMSNorm scales by (1 + weight) in fp32, the token
  /// embedding by sqrt(hidden), the MLP is GeGLU (gelu, tanh approximation),
  /// and each layer normalises the attention's and the MLP's outputs too
  /// (post_attention_layernorm, pre_ and post_feedforward_layernorm).
  bool gemma = false;
  /// Attention scores times this (query_pre_attn_scalar^-0.5); 0: head_dim^-0.5.
  double attn_scale = 0;
  std::int64_t query_pre_attn_scalar = 0;  ///< as read, written back
  /// cap * tanh(x / cap) on the attention scores and on the logits; 0: none
  double attn_softcap = 0, final_softcap = 0;
  /// Gemma 3: the sliding layers rotate with their own base (rope_local_base_freq,
  /// or rope_parameters.sliding_attention.rope_theta) and no scaling; 0: as the others.
  double rope_local_theta = 0;
  RopeScaling rope;
  /// The special token ids a folder's config.json gave (pad_token_id,
  /// bos_token_id, eos_token_id, as read: eos may be a list), written back
  /// with the config (Phi-3's class would otherwise pad with token 32000).
  nlohmann::json token_ids = nlohmann::json::object();
  /// The weights' dtype: "fp32", "bf16", "fp16", or "" when a config.json
  /// does not say (its torch_dtype, or dtype as transformers 5 writes it).
  std::string dtype;
};

/// Reads a JSON file; errors name it.
nlohmann::json read_json(const std::filesystem::path& p);

/// The features that rotate in each head: head_dim * rotary_factor (even).
std::int64_t rotary_dim(const Config& c);
/// Whether layer i slides (Config::sliding).
inline bool layer_slides(const Config& c, std::int64_t i) {
  return c.sliding_window > 0 && i < static_cast<std::int64_t>(c.sliding.size()) && c.sliding[static_cast<std::size_t>(i)];
}

/// A Hugging Face config.json (one of kFamilies); `where` names it in errors
/// ("decoder_lm: m/config.json", or a LLaVA file with `path` "text_config.").
Config config_from_hf(const nlohmann::json& j, const std::string& where, const std::string& path = "");
/// decoder_lm's size options (family, vocab_size, hidden_size, ...).
Config config_from_options(const wick::Options& o);
/// Fills head_dim and checks the head counts and the size in memory (the
/// weights in c.dtype, fp32 when empty; the linear layers in NF4 with `nf4`);
/// `who` names the plugin or file in errors, `hf` picks config.json's key names.
void finish_config(Config& c, const std::string& who, bool hf = false, bool nf4 = false);
/// The parameters of a decoder of these sizes (saturating at 2^64 - 1).
std::uint64_t parameter_count(const Config& c);
/// The options config_from_options reads.
wick::OptionSchema size_options();
/// rope_parameters as transformers 5 writes them (rope_theta, rope_type and the type's fields).
nlohmann::json rope_json(const Config& c);
/// The config.json that transformers reads for this decoder.
nlohmann::json hf_config(const Config& c);

}  // namespace wick::decoder
