#include "lib/decoder/config.hpp"

#include <wick/kit/hf_dtype_names.hpp>
#include <wick/kit/json_fields.hpp>

#include <sys/sysinfo.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

namespace wick::decoder {

namespace {

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

std::uint64_t mul(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<std::uint64_t>::max() : r;
}
std::uint64_t add(std::uint64_t a, std::uint64_t b) {
  std::uint64_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<std::uint64_t>::max() : r;
}

std::string bytes_text(std::uint64_t b) {
  if (b == std::numeric_limits<std::uint64_t>::max()) return "more than 2^64 bytes";
  char s[64];
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double x = static_cast<double>(b);
  int u = 0;
  while (x >= 1024 && u < 6) x /= 1024, ++u;
  std::snprintf(s, sizeof s, u ? "%.1f %s" : "%.0f %s", x, units[u]);
  return s;
}

// Physical memory and swap: what the weights could ever be written into.
std::uint64_t memory_here() {
  struct sysinfo si {};
  if (::sysinfo(&si) != 0) return std::numeric_limits<std::uint64_t>::max();
  return add(mul(si.totalram, si.mem_unit), mul(si.totalswap, si.mem_unit));
}

}  // namespace

nlohmann::json read_json(const std::filesystem::path& p) { return wick::read_json_file(p); }

std::int64_t rotary_dim(const Config& c) {
  // as transformers: int(head_dim * partial_rotary_factor)
  return static_cast<std::int64_t>(static_cast<double>(c.head_dim) * c.rotary_factor);
}

std::uint64_t parameter_count(const Config& c) {
  const std::uint64_t h = c.hidden, q = mul(c.heads, c.head_dim), kv = mul(c.kv_heads, c.head_dim);
  std::uint64_t layer = add(add(mul(h, q), mul(2, mul(h, kv))), mul(q, h));  // q, k, v, o
  if (c.qkv_bias) layer = add(layer, add(q, mul(2, kv)));
  if (c.o_bias) layer = add(layer, h);
  if (c.qk_norm) layer = add(layer, mul(2, c.head_dim));
  layer = add(layer, mul(3, mul(h, c.intermediate)));  // gate, up, down
  layer = add(layer, mul(c.gemma ? 4 : 2, h));         // two norms (Gemma: four)
  std::uint64_t n = add(mul(c.layers, layer), add(mul(c.vocab, h), h));
  if (!c.tie) n = add(n, mul(c.vocab, h));
  return n;
}

void finish_config(Config& c, const std::string& who, bool hf, bool nf4) {
  const char* k_hidden = "hidden_size";
  const char* k_heads = hf ? "num_attention_heads" : "heads";
  const char* k_kv = hf ? "num_key_value_heads" : "kv_heads";
  if (c.heads < 1 || c.kv_heads < 1)
    throw wick::Error(who + ": " + k_heads + " " + std::to_string(c.heads) + " and " + k_kv + " " +
                      std::to_string(c.kv_heads) + ", expected at least 1 each");
  if (c.head_dim == 0) {
    if (c.hidden % c.heads)
      throw wick::Error(who + ": " + k_hidden + " " + std::to_string(c.hidden) + " is not a multiple of " + k_heads +
                        " " + std::to_string(c.heads) + ", expected a width that the heads divide");
    c.head_dim = c.hidden / c.heads;
  }
  if (c.head_dim % 2)
    throw wick::Error(who + ": the head size " + std::to_string(c.head_dim) + (hf ? " (head_dim, or hidden_size / num_attention_heads)" : " (hidden_size / heads)") +
                      " is odd, expected an even size (rotary embeddings turn pairs of features)");
  if (rotary_dim(c) < 2 || rotary_dim(c) % 2)
    throw wick::Error(who + ": partial_rotary_factor " + std::to_string(c.rotary_factor) + " of the head size " +
                      std::to_string(c.head_dim) + " rotates " + std::to_string(rotary_dim(c)) +
                      " features, expected an even number of at least 2 (rotary embeddings turn pairs of features)");
  if (c.heads % c.kv_heads)
    throw wick::Error(who + ": " + k_heads + " " + std::to_string(c.heads) + " is not a multiple of " + k_kv + " " +
                      std::to_string(c.kv_heads) + ", expected each key/value head to serve the same number of heads");
  // before anything is allocated: the weights, as they are built (in their
  // dtype; the linear layers in 4 bits with quantize = "nf4"), must fit where
  // they are made
  const std::uint64_t params = parameter_count(c), here = memory_here();
  const std::string dt = c.dtype.empty() ? "fp32" : c.dtype;
  const std::uint64_t elt = dt == "fp32" ? 4 : 2;
  std::uint64_t bytes = mul(params, elt);
  if (nf4 && params != std::numeric_limits<std::uint64_t>::max()) {
    const std::uint64_t h = c.hidden, q = mul(c.heads, c.head_dim), kv = mul(c.kv_heads, c.head_dim);
    const std::uint64_t linear =
        mul(c.layers, add(add(mul(h, q), mul(2, mul(h, kv))), add(mul(q, h), mul(3, mul(h, c.intermediate)))));
    // 4 bits a weight, one byte a block of 64 and 4 bytes per 256 blocks (double-quantized constants)
    bytes = add(mul(params - std::min(params, linear), elt), add(linear / 2, add(linear / 64, linear / 4096)));
  }
  if (bytes > here)
    throw wick::Error(who + ": vocab_size " + std::to_string(c.vocab) + ", " + k_hidden + " " + std::to_string(c.hidden) +
                      ", intermediate_size " + std::to_string(c.intermediate) + " and " +
                      (hf ? "num_hidden_layers " : "layers ") + std::to_string(c.layers) + " make " +
                      (params == std::numeric_limits<std::uint64_t>::max() ? std::string("more than 2^64")
                                                                            : std::to_string(params)) +
                      " parameters, which need " + bytes_text(bytes) + " in " + dt + (nf4 ? " with NF4 linear layers" : "") +
                      ", more than this machine's " +
                      bytes_text(here) + " of memory and swap, expected a model that fits");
}

namespace {

// The fields of a rotary scaling (rope_scaling, or rope_parameters beside
// rope_theta), each type's own, as transformers' validators take them.
void read_rope(const wick::JsonFields& rp, Config& c, const wick::JsonFields& top) {
  RopeScaling& r = c.rope;
  r.type = rp.string("rope_type", rp.string("type", "default"));
  const char* kinds = "default, linear, dynamic, llama3 or yarn (the rotary scalings wick computes)";
  std::vector<std::string> keys{"rope_type", "type", "rope_theta"};
  if (r.type == "default") {
  } else if (r.type == "linear" || r.type == "dynamic") {
    keys.insert(keys.end(), {"factor"});
  } else if (r.type == "llama3") {
    keys.insert(keys.end(), {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"});
  } else if (r.type == "yarn") {
    keys.insert(keys.end(), {"factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                             "original_max_position_embeddings", "truncate"});
  } else {
    rp.bad(rp.has("rope_type") ? "rope_type" : "type", kinds);
  }
  for (const auto& [k, v] : rp.json().items()) {
    if (v.is_null() || std::find(keys.begin(), keys.end(), k) != keys.end()) continue;
    if (k == "partial_rotary_factor" && v.is_number() && (c.family == "phi3" || v.get<double>() == 1.0)) continue;
    std::string list;
    for (const auto& x : keys) list += (list.empty() ? "" : ", ") + x;
    rp.fail(k, "is not a field of rope_type " + r.type + " (expected " + list + ")");
  }
  if (r.type == "default") return;
  // yarn may leave factor out: then max_position_embeddings / original_max_position_embeddings
  if (r.type != "yarn" || rp.has("factor")) {
    r.factor = rp.number("factor", -1, 0, /*lo_open=*/true);
    if (r.factor <= 0) rp.bad("factor", "a number above 0");
  }
  if (r.type == "llama3" || r.type == "yarn") {
    // a top-level original_max_position_embeddings wins, as transformers' standardize_rope_params has it
    r.original_max = top.has("original_max_position_embeddings")
                         ? top.integer("original_max_position_embeddings", 1, std::numeric_limits<std::int64_t>::max())
                         : rp.integer("original_max_position_embeddings", c.max_positions, 1,
                                      std::numeric_limits<std::int64_t>::max());
  }
  if (r.type == "llama3") {
    r.low_freq_factor = rp.number("low_freq_factor", -1, 0, true);
    r.high_freq_factor = rp.number("high_freq_factor", -1, 0, true);
    if (r.low_freq_factor <= 0) rp.bad("low_freq_factor", "a number above 0");
    if (r.high_freq_factor <= r.low_freq_factor)
      rp.bad("high_freq_factor", "a number above low_freq_factor (" + std::to_string(r.low_freq_factor) + ")");
  }
  if (r.type == "yarn") {
    if (!rp.has("factor")) r.factor = static_cast<double>(c.max_positions) / static_cast<double>(r.original_max);
    r.attention_factor = rp.number("attention_factor", 0, 0);
    // 0 or absent: the paper's defaults (transformers reads them with `or`)
    r.beta_fast = rp.number("beta_fast", 0, 0);
    r.beta_slow = rp.number("beta_slow", 0, 0);
    if (r.beta_fast == 0) r.beta_fast = 32;
    if (r.beta_slow == 0) r.beta_slow = 1;
    r.mscale = rp.number("mscale", 0, 0);
    r.mscale_all_dim = rp.number("mscale_all_dim", 0, 0);
    r.truncate = rp.flag("truncate", true);
  }
}

// layer_types: which layers slide (c.sliding), one entry per layer.
void read_layer_types(const wick::JsonFields& j, Config& c) {
  const auto& types = j.array("layer_types");
  if (static_cast<std::int64_t>(types.size()) != c.layers)
    j.bad("layer_types", "one entry per layer (num_hidden_layers " + std::to_string(c.layers) + "), not " +
                             std::to_string(types.size()));
  for (std::size_t i = 0; i < types.size(); ++i) {
    if (!types[i].is_string() || (types[i] != "full_attention" && types[i] != "sliding_attention"))
      j.bad("layer_types", "a list of full_attention and sliding_attention");
    c.sliding[i] = types[i] == "sliding_attention";
  }
}

// The sliding window, as each family's config class reads it. Mistral and
// Phi-3: a sliding_window (not null) makes every layer slide. Qwen2 and Qwen3:
// with use_sliding_window and a sliding_window, the layers that layer_types
// calls sliding_attention, or else those from max_window_layers on.
// rope_theta and its scaling: older configs rope_theta and rope_scaling
// {type | rope_type, factor, ...}; newer rope_parameters {rope_theta,
// rope_type, factor, ...} (rope_scaling wins, as in transformers)
void read_rope_fields(const wick::JsonFields& j, Config& c) {
  c.rope_theta = j.number("rope_theta", 10000.0, 0, /*lo_open=*/true);
  if (j.has("rope_scaling")) {
    const auto rs = j.object("rope_scaling");
    c.rope_theta = rs.number("rope_theta", c.rope_theta, 0, /*lo_open=*/true);
    read_rope(rs, c, j);
  } else if (j.has("rope_parameters")) {
    const auto rp = j.object("rope_parameters");
    c.rope_theta = rp.number("rope_theta", c.rope_theta, 0, /*lo_open=*/true);
    read_rope(rp, c, j);
  }
}

void read_sliding(const wick::JsonFields& j, Config& c) {
  c.sliding.assign(static_cast<std::size_t>(c.layers), false);
  const bool qwen = c.family == "qwen2" || c.family == "qwen3";
  if (qwen) c.max_window_layers = j.integer("max_window_layers", 28, 0, kMax);  // transformers' default
  if (c.family == "llama" || !j.has("sliding_window")) return;
  if (qwen && !j.flag("use_sliding_window", false)) return;
  c.sliding_window = j.integer("sliding_window", 1, kMax);
  if (!qwen) {
    c.sliding.assign(static_cast<std::size_t>(c.layers), true);
    return;
  }
  if (j.has("layer_types")) {
    read_layer_types(j, c);
  } else {
    for (std::int64_t i = c.max_window_layers; i < c.layers; ++i) c.sliding[static_cast<std::size_t>(i)] = true;
  }
}

// The special token ids, kept as given to be written back (eos may be a list).
void read_token_ids(const wick::JsonFields& j, Config& c) {
  for (const char* key : {"pad_token_id", "bos_token_id", "eos_token_id"}) {
    if (!j.json().contains(key)) continue;
    const auto& v = j.json().at(key);
    const bool ok = v.is_null() || v.is_number_integer() ||
                    (v.is_array() && std::all_of(v.begin(), v.end(), [](const auto& x) { return x.is_number_integer(); }));
    if (!ok) j.bad(key, "a token id, a list of them, or null");
    c.token_ids[key] = v;
  }
}

// the dtype the weights were saved in: the model is built in it
void read_dtype(const wick::JsonFields& j, Config& c) {
  for (const char* key : {"dtype", "torch_dtype"}) {
    if (!c.dtype.empty() || !j.has(key)) continue;
    const std::string d = j.string(key);
    c.dtype = wick::dtype_of_hf_name(d);
    if (c.dtype.empty()) j.bad(key, "float32, bfloat16 or float16 (the dtypes wick builds a decoder in)");
  }
}

// The sizes every family's config names alike (kv_heads: the heads when absent).
void read_sizes(const wick::JsonFields& j, Config& c) {
  c.vocab = j.integer("vocab_size", 1);
  c.hidden = j.integer("hidden_size", 1);
  c.intermediate = j.integer("intermediate_size", 1);
  c.layers = j.integer("num_hidden_layers", 1);
  c.heads = j.integer("num_attention_heads", 1);
  c.kv_heads = j.integer("num_key_value_heads", c.heads, 1, kMax);
}

// A softcapping field: absent, the family's default; null, none.
double softcap(const wick::JsonFields& j, const std::string& key, double fallback) {
  const auto& json = j.json();
  if (json.contains(key) && json.at(key).is_null()) return 0;
  return j.number(key, fallback, 0, /*lo_open=*/true);
}

// Gemma 2 and Gemma 3's text model (Gemma2Config, Gemma3TextConfig): their
// own defaults, sliding layers by layer_types (or the old pattern: every
// second layer slides in Gemma 2, five of six in Gemma 3), and Gemma 3's two
// rotary bases.
Config gemma_from_hf(const wick::JsonFields& j) {
  Config c;
  const bool g3 = j.string("model_type") == "gemma3_text";
  c.family = j.string("model_type");
  c.gemma = true;
  read_sizes(j, c);
  c.head_dim = j.integer("head_dim", 256, 2, kMax);
  c.eps = j.number("rms_norm_eps", 1e-6, 0);
  c.init_range = j.number("initializer_range", 0.02, 0);
  c.max_positions = j.integer("max_position_embeddings", g3 ? 131072 : 8192, 1, kMax);
  c.tie = j.flag("tie_word_embeddings", true);
  c.qkv_bias = c.o_bias = j.flag("attention_bias", false);
  c.qk_norm = g3;
  const std::string act = j.string("hidden_activation", "gelu_pytorch_tanh");
  if (act != "gelu_pytorch_tanh") j.bad("hidden_activation", "gelu_pytorch_tanh (GeGLU with gelu's tanh approximation)");
  c.query_pre_attn_scalar = j.integer("query_pre_attn_scalar", 256, 1, kMax);
  c.attn_scale = 1.0 / std::sqrt(static_cast<double>(c.query_pre_attn_scalar));
  c.attn_softcap = softcap(j, "attn_logit_softcapping", g3 ? 0 : 50.0);
  c.final_softcap = softcap(j, "final_logit_softcapping", g3 ? 0 : 30.0);
  if (g3 && j.flag("use_bidirectional_attention", false))
    j.bad("use_bidirectional_attention", "false (wick's decoder attends causally)");
  // the sliding layers
  c.sliding.assign(static_cast<std::size_t>(c.layers), false);
  if (j.has("layer_types")) {
    read_layer_types(j, c);
  } else {
    const std::int64_t pattern = g3 ? j.integer("sliding_window_pattern", 6, 1, kMax) : 2;
    for (std::int64_t i = 0; i < c.layers; ++i) c.sliding[static_cast<std::size_t>(i)] = (i + 1) % pattern != 0;
  }
  const auto& json = j.json();
  const bool no_window = json.contains("sliding_window") && json.at("sliding_window").is_null();
  c.sliding_window = no_window ? 0 : j.integer("sliding_window", 4096, 1, kMax);
  if (no_window && std::find(c.sliding.begin(), c.sliding.end(), true) != c.sliding.end())
    j.bad("sliding_window", "a window for the layers layer_types calls sliding_attention");
  // rotary: Gemma 2 as the others; Gemma 3 a base (and scaling) for the full
  // layers and a base for the sliding ones
  if (!g3) {
    read_rope_fields(j, c);
  } else {
    c.rope_theta = j.number("rope_theta", 1000000.0, 0, /*lo_open=*/true);
    c.rope_local_theta = j.number("rope_local_base_freq", 10000.0, 0, /*lo_open=*/true);
    if (j.has("rope_parameters") && j.object("rope_parameters").has("full_attention")) {
      const auto rp = j.object("rope_parameters");
      const auto full = rp.object("full_attention");
      c.rope_theta = full.number("rope_theta", c.rope_theta, 0, /*lo_open=*/true);
      read_rope(full, c, j);
      if (rp.has("sliding_attention")) {
        const auto local = rp.object("sliding_attention");
        c.rope_local_theta = local.number("rope_theta", c.rope_local_theta, 0, /*lo_open=*/true);
        if (local.string("rope_type", "default") != "default")
          local.bad("rope_type", "default (wick scales only the full-attention layers' rotation)");
      }
    }
    if (j.has("rope_scaling")) {
      const auto rs = j.object("rope_scaling");
      c.rope_theta = rs.number("rope_theta", c.rope_theta, 0, /*lo_open=*/true);
      read_rope(rs, c, j);
    }
  }
  read_dtype(j, c);
  read_token_ids(j, c);
  finish_config(c, j.where(), /*hf=*/true);
  return c;
}

}  // namespace

Config config_from_hf(const nlohmann::json& json, const std::string& where, const std::string& path) {
  const wick::JsonFields j(json, where, path);
  Config c;
  const std::string type = j.string("model_type", "llama");
  if (type == "gemma2" || type == "gemma3_text") return gemma_from_hf(j);
  if (type != "llama" && type != "mistral" && type != "qwen2" && type != "qwen3" && type != "phi3")
    j.bad("model_type", std::string(kFamilies) + " (the decoders wick reads)");
  const bool qwen = type == "qwen2" || type == "qwen3";
  c.family = type;
  read_sizes(j, c);
  // absent: transformers' default (Qwen3Config's is 128; the others' the width over the heads)
  c.head_dim = j.integer("head_dim", type == "qwen3" ? 128 : 0, 2, kMax);
  if (j.flag("mlp_bias", false)) j.bad("mlp_bias", "false (MLP biases are not supported)");
  c.eps = j.number("rms_norm_eps", type == "phi3" ? 1e-5 : 1e-6, 0);
  c.init_range = j.number("initializer_range", 0.02, 0);
  // the context; absent, transformers' default for the family
  c.max_positions = j.integer("max_position_embeddings",
                              qwen ? 32768 : type == "mistral" ? 131072 : type == "phi3" ? 4096 : 2048, 1, kMax);
  c.tie = j.flag("tie_word_embeddings", false);
  // attention_bias: LLaMA's and Qwen3's cover q, k, v and o; Qwen2 has q/k/v
  // biases always; Mistral and Phi-3 have none
  const bool attention_bias = (type == "llama" || type == "qwen3") && j.flag("attention_bias", false);
  c.qkv_bias = type == "qwen2" || attention_bias;
  c.o_bias = attention_bias;
  c.qk_norm = type == "qwen3";
  c.fused = type == "phi3";
  if (j.string("hidden_act", "silu") != "silu") j.bad("hidden_act", "silu");
  // Phi's partial rotation: top-level, or in rope_parameters (which wins)
  if (type == "phi3") {
    c.rotary_factor = j.number("partial_rotary_factor", 1.0, 0, /*lo_open=*/true);
    if (c.rotary_factor > 1) j.bad("partial_rotary_factor", "a number above 0 and at most 1");
    for (const char* key : {"rope_parameters", "rope_scaling"}) {
      if (!j.has(key)) continue;
      const auto rp = j.object(key);
      c.rotary_factor = rp.number("partial_rotary_factor", c.rotary_factor, 0, /*lo_open=*/true);
      if (c.rotary_factor > 1) rp.bad("partial_rotary_factor", "a number above 0 and at most 1");
      // Phi-3's long-context models rotate by longrope ("su"; transformers reads "yarn" as longrope for Phi-3)
      const std::string t = rp.string("rope_type", rp.string("type", "default"));
      if (t != "default")
        rp.fail(rp.has("rope_type") ? "rope_type" : "type",
                "is " + t + ": Phi-3's long-context rotary scaling (longrope, su) is not supported by wick, expected "
                "rope_scaling null (the rotary embedding of Phi-3's 4k-context models)");
    }
  }
  read_rope_fields(j, c);
  read_sliding(j, c);
  read_dtype(j, c);
  read_token_ids(j, c);
  finish_config(c, j.where(), /*hf=*/true);
  return c;
}

Config config_from_options(const wick::Options& o) {
  Config c;
  c.family = o.get_string("family");
  c.vocab = o.get_int("vocab_size");
  c.hidden = o.get_int("hidden_size");
  c.intermediate = o.get_int("intermediate_size");
  c.layers = o.get_int("layers");
  c.heads = o.get_int("heads");
  c.kv_heads = o.has("kv_heads") ? o.get_int("kv_heads") : c.heads;
  c.rope_theta = o.get_number("rope_theta");
  c.eps = o.get_number("rms_norm_eps");
  c.init_range = o.get_number("initializer_range");
  c.tie = o.get_bool("tie_embeddings");
  c.qkv_bias = c.family == "qwen2";
  c.qk_norm = c.family == "qwen3" || c.family == "gemma3_text";
  c.fused = c.family == "phi3";
  c.head_dim = o.has("head_dim") ? o.get_int("head_dim") : 0;
  c.sliding.assign(static_cast<std::size_t>(c.layers), false);
  if (c.family == "qwen2" || c.family == "qwen3") c.max_window_layers = c.layers;
  const bool windowed = o.has("sliding_window");
  if (windowed) c.sliding_window = o.get_int("sliding_window");
  if (c.family == "gemma2" || c.family == "gemma3_text") {
    // Gemma2Config's and Gemma3TextConfig's own choices: (1 + w) norms, GeGLU,
    // scores scaled by head_dim^-0.5 (query_pre_attn_scalar = head_dim),
    // Gemma 2's soft-capping (50 on the scores, 30 on the logits), every
    // second layer sliding in Gemma 2 and five of six in Gemma 3 (whose
    // sliding layers rotate with base 10,000, the others with rope_theta)
    const bool g3 = c.family == "gemma3_text";
    c.gemma = true;
    if (c.head_dim == 0 && c.heads > 0 && c.hidden % c.heads == 0) c.head_dim = c.hidden / c.heads;
    c.query_pre_attn_scalar = c.head_dim;
    c.attn_softcap = g3 ? 0 : 50.0;
    c.final_softcap = g3 ? 0 : 30.0;
    if (!windowed) c.sliding_window = 4096;
    const std::int64_t pattern = g3 ? 6 : 2;
    for (std::int64_t i = 0; i < c.layers; ++i) c.sliding[static_cast<std::size_t>(i)] = (i + 1) % pattern != 0;
    if (g3) c.rope_local_theta = 10000.0;
  } else if (windowed) {
    if (c.family != "mistral" && c.family != "phi3")
      throw wick::Error("option 'sliding_window': family '" + c.family +
                        "' has no sliding window made from options, expected it with family mistral, phi3, gemma2 or "
                        "gemma3_text (a Qwen folder's config.json sets its own)");
    c.sliding.assign(static_cast<std::size_t>(c.layers), true);  // Mistral and Phi-3: every layer
  }
  return c;
}

wick::OptionSchema size_options() {
  return {wick::opt_string("family", "llama",
                           "llama; mistral (llama's layers, saved as Mistral); qwen2 (q/k/v bias); qwen3 (q/k norms); "
                           "phi3 (fused qkv_proj and gate_up_proj); gemma2 ((1 + w) norms, GeGLU, soft-capping, every "
                           "second layer sliding); gemma3_text (Gemma 3's text model: q/k norms, five of six layers "
                           "sliding)")
              .one_of({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"}),
          wick::opt_int("vocab_size", 256, "vocabulary size").at_least(1),
          wick::opt_int("hidden_size", 256, "model width").at_least(1),
          wick::opt_int("intermediate_size", 688, "MLP width").at_least(1),
          wick::opt_int("layers", 4, "decoder layers").at_least(1),
          wick::opt_int("heads", 4, "attention heads").at_least(1),
          wick::opt_int("kv_heads", wick::Value(), "key/value heads (grouped-query attention; default: heads)")
              .at_least(1)
              .optional(),
          wick::opt_int("head_dim", wick::Value(), "each head's width (default: hidden_size / heads)")
              .at_least(2)
              .optional(),
          wick::opt_int("sliding_window", wick::Value(),
                        "positions a sliding layer sees (mistral and phi3: every layer; gemma2 and gemma3_text: their "
                        "sliding layers, default 4096)")
              .at_least(1)
              .optional(),
          wick::opt_number("rope_theta", 10000.0, "rotary embedding base (gemma3_text: its full-attention layers')")
              .at_least(1),
          wick::opt_number("rms_norm_eps", 1e-6, "RMSNorm epsilon").at_least(0),
          wick::opt_bool("tie_embeddings", false, "output head shares the token embedding"),
          wick::opt_number("initializer_range", 0.02,
                          "a fresh model's weights: linear and embedding weights normal(0, this), biases 0, norms 1 "
                          "(transformers' _init_weights)")
              .range(0, 1)};
}

nlohmann::json rope_json(const Config& c) {
  const RopeScaling& r = c.rope;
  nlohmann::json j = {{"rope_theta", c.rope_theta}, {"rope_type", r.type}};
  if (r.type == "default") return j;
  j["factor"] = r.factor;
  if (r.type == "llama3" || r.type == "yarn") j["original_max_position_embeddings"] = r.original_max;
  if (r.type == "llama3") {
    j["low_freq_factor"] = r.low_freq_factor;
    j["high_freq_factor"] = r.high_freq_factor;
  }
  if (r.type == "yarn") {
    if (r.attention_factor > 0) j["attention_factor"] = r.attention_factor;
    j["beta_fast"] = r.beta_fast;
    j["beta_slow"] = r.beta_slow;
    if (r.mscale > 0) j["mscale"] = r.mscale;
    if (r.mscale_all_dim > 0) j["mscale_all_dim"] = r.mscale_all_dim;
    j["truncate"] = r.truncate;
  }
  return j;
}

nlohmann::json hf_config(const Config& c) {
  const std::string& f = c.family;
  const char* arch = f == "qwen2"     ? "Qwen2ForCausalLM"
                     : f == "qwen3"   ? "Qwen3ForCausalLM"
                     : f == "mistral" ? "MistralForCausalLM"
                     : f == "phi3"    ? "Phi3ForCausalLM"
                     : f == "gemma2"  ? "Gemma2ForCausalLM"
                     : f == "gemma3_text" ? "Gemma3ForCausalLM"
                                      : "LlamaForCausalLM";
  nlohmann::json rope = rope_json(c);
  if (f == "phi3") rope["partial_rotary_factor"] = c.rotary_factor;
  nlohmann::json j = {{"architectures", {arch}},
                      {"model_type", f},
                      {"vocab_size", c.vocab},
                      {"hidden_size", c.hidden},
                      {"intermediate_size", c.intermediate},
                      {"num_hidden_layers", c.layers},
                      {"num_attention_heads", c.heads},
                      {"num_key_value_heads", c.kv_heads},
                      {"head_dim", c.head_dim},
                      {"hidden_act", "silu"},
                      {"rms_norm_eps", c.eps},
                      {"initializer_range", c.init_range},
                      {"rope_theta", c.rope_theta},
                      {"rope_parameters", rope},
                      {"tie_word_embeddings", c.tie},
                      {"max_position_embeddings", c.max_positions},
                      {"torch_dtype", wick::hf_dtype_name(c.dtype)}};
  // Phi3Config pads with token 32000 unless told: said, whatever the vocabulary
  if (f == "phi3") j["pad_token_id"] = nullptr;
  for (const auto& [k, v] : c.token_ids.items()) j[k] = v;
  if (f == "llama" || f == "qwen3" || c.gemma) j["attention_bias"] = c.qkv_bias;
  if (c.gemma) {
    j.erase("hidden_act");
    j["hidden_activation"] = "gelu_pytorch_tanh";
    j["query_pre_attn_scalar"] = c.query_pre_attn_scalar;
    j["attn_logit_softcapping"] = c.attn_softcap > 0 ? nlohmann::json(c.attn_softcap) : nlohmann::json(nullptr);
    j["final_logit_softcapping"] = c.final_softcap > 0 ? nlohmann::json(c.final_softcap) : nlohmann::json(nullptr);
    j["sliding_window"] = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
    nlohmann::json types = nlohmann::json::array();
    for (std::int64_t i = 0; i < c.layers; ++i) types.push_back(layer_slides(c, i) ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
    if (f == "gemma3_text") {
      j.erase("rope_theta");
      j["rope_parameters"] = {{"full_attention", rope}, {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", c.rope_local_theta}}}};
    }
  }
  if (f == "phi3") j["partial_rotary_factor"] = c.rotary_factor;
  // the sliding window as each family's config class reads it back
  const nlohmann::json window = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
  if (f == "mistral" || f == "phi3") j["sliding_window"] = window;
  if (f == "qwen2" || f == "qwen3") {
    j["use_sliding_window"] = c.sliding_window > 0;
    j["sliding_window"] = window;
    j["max_window_layers"] = c.max_window_layers;
    nlohmann::json types = nlohmann::json::array();
    for (std::int64_t i = 0; i < c.layers; ++i) types.push_back(layer_slides(c, i) ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
  }
  return j;
}

}  // namespace wick::decoder
