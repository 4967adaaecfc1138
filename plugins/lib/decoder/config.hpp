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

struct Config {
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
  RopeScaling rope;
  /// The weights' dtype: "fp32", "bf16", "fp16", or "" when a config.json
  /// does not say (its torch_dtype, or dtype as transformers 5 writes it).
  std::string dtype;
};

/// Reads a JSON file; errors name it.
nlohmann::json read_json(const std::filesystem::path& p);

/// A Hugging Face config.json (llama or qwen2); `where` names it in errors
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
