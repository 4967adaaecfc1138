#include "lib/decoder/config.hpp"

#include <wick/kit/json_fields.hpp>

#include <sys/sysinfo.h>

#include <algorithm>
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

std::uint64_t parameter_count(const Config& c) {
  const std::uint64_t h = c.hidden, q = mul(c.heads, c.head_dim), kv = mul(c.kv_heads, c.head_dim);
  std::uint64_t layer = add(add(mul(h, q), mul(2, mul(h, kv))), mul(q, h));  // q, k, v, o
  if (c.qkv_bias) layer = add(layer, add(q, mul(2, kv)));
  layer = add(layer, mul(3, mul(h, c.intermediate)));  // gate, up, down
  layer = add(layer, mul(2, h));                       // two norms
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
    if (k == "partial_rotary_factor" && v.is_number() && v.get<double>() == 1.0) continue;
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

}  // namespace

Config config_from_hf(const nlohmann::json& json, const std::string& where, const std::string& path) {
  const wick::JsonFields j(json, where, path);
  Config c;
  const std::string type = j.string("model_type", "llama");
  if (type != "llama" && type != "qwen2") j.bad("model_type", "llama or qwen2 (the decoders wick reads)");
  c.family = type;
  c.vocab = j.integer("vocab_size", 1);
  c.hidden = j.integer("hidden_size", 1);
  c.intermediate = j.integer("intermediate_size", 1);
  c.layers = j.integer("num_hidden_layers", 1);
  c.heads = j.integer("num_attention_heads", 1);
  c.kv_heads = j.integer("num_key_value_heads", c.heads, 1, kMax);
  c.head_dim = j.integer("head_dim", 0, 2, kMax);
  if (j.flag("mlp_bias", false)) j.bad("mlp_bias", "false (MLP biases are not supported)");
  c.eps = j.number("rms_norm_eps", 1e-6, 0);
  c.init_range = j.number("initializer_range", 0.02, 0);
  // the context; absent, transformers' default for the family
  c.max_positions = j.integer("max_position_embeddings", type == "qwen2" ? 32768 : 2048, 1, kMax);
  c.tie = j.flag("tie_word_embeddings", false);
  c.qkv_bias = type == "qwen2" ? true : j.flag("attention_bias", false);
  if (j.string("hidden_act", "silu") != "silu") j.bad("hidden_act", "silu");
  // older configs: rope_theta and rope_scaling {type | rope_type, factor, ...};
  // newer: rope_parameters {rope_theta, rope_type, factor, ...} (rope_scaling wins, as in transformers)
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
  // Qwen2's sliding window (transformers' Qwen2Config): with use_sliding_window
  // and a sliding_window, the layers from max_window_layers on (or those
  // layer_types calls sliding_attention) see only the last sliding_window
  // positions. wick's attention sees every earlier position, so a config where
  // some layer slides is refused rather than computed otherwise.
  if (type == "qwen2" && j.flag("use_sliding_window", false) && j.has("sliding_window")) {
    const std::int64_t window = j.integer("sliding_window", 1);
    std::int64_t first = c.layers, sliding = 0;
    std::string which;
    if (j.has("layer_types")) {
      const auto& types = j.array("layer_types");
      for (std::size_t i = 0; i < types.size(); ++i) {
        if (!types[i].is_string() || (types[i] != "full_attention" && types[i] != "sliding_attention"))
          j.bad("layer_types", "a list of full_attention and sliding_attention");
        if (types[i] == "sliding_attention" && sliding++ == 0) first = static_cast<std::int64_t>(i);
      }
      which = std::to_string(sliding) + " of the " + std::to_string(c.layers) + " layers (layer_types, the first " +
              std::to_string(first) + ")";
    } else {
      first = j.integer("max_window_layers", 28, 0, kMax);  // transformers' default
      sliding = std::max<std::int64_t>(0, c.layers - first);
      which = "layers " + std::to_string(first) + " to " + std::to_string(c.layers - 1) + " (max_window_layers " +
              std::to_string(first) + ")";
    }
    if (sliding > 0)
      j.fail("use_sliding_window", "is true: " + which + " would attend to only the last " + std::to_string(window) +
                                       " positions (sliding_window), and wick has no sliding-window attention; "
                                       "expected use_sliding_window false, or max_window_layers of at least "
                                       "num_hidden_layers (" + std::to_string(c.layers) + ")");
  }
  // the dtype the weights were saved in: the model is built in it
  for (const char* key : {"dtype", "torch_dtype"}) {
    if (!c.dtype.empty() || !j.has(key)) continue;
    const std::string d = j.string(key);
    c.dtype = d == "float32" ? "fp32" : d == "bfloat16" ? "bf16" : d == "float16" ? "fp16" : "";
    if (c.dtype.empty()) j.bad(key, "float32, bfloat16 or float16 (the dtypes wick builds a decoder in)");
  }
  finish_config(c, where, /*hf=*/true);
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
  c.rope_theta = o.get_double("rope_theta");
  c.eps = o.get_double("rms_norm_eps");
  c.init_range = o.get_double("initializer_range");
  c.tie = o.get_bool("tie_embeddings");
  c.qkv_bias = c.family == "qwen2";
  return c;
}

wick::OptionSchema size_options() {
  return {wick::opt_string("family", "llama", "llama, or qwen2 (q/k/v bias)").one_of({"llama", "qwen2"}),
          wick::opt_int("vocab_size", 256, "vocabulary size").at_least(1),
          wick::opt_int("hidden_size", 256, "model width").at_least(1),
          wick::opt_int("intermediate_size", 688, "MLP width").at_least(1),
          wick::opt_int("layers", 4, "decoder layers").at_least(1),
          wick::opt_int("heads", 4, "attention heads").at_least(1),
          wick::opt_int("kv_heads", wick::Value(), "key/value heads (grouped-query attention; default: heads)")
              .at_least(1)
              .optional(),
          wick::opt_float("rope_theta", 10000.0, "rotary embedding base").at_least(1),
          wick::opt_float("rms_norm_eps", 1e-6, "RMSNorm epsilon").at_least(0),
          wick::opt_bool("tie_embeddings", false, "output head shares the token embedding"),
          wick::opt_float("initializer_range", 0.02,
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
  const bool qwen = c.family == "qwen2";
  nlohmann::json j = {{"architectures", {qwen ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
                      {"model_type", c.family},
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
                      {"rope_parameters", rope_json(c)},
                      {"tie_word_embeddings", c.tie},
                      {"max_position_embeddings", c.max_positions},
                      {"torch_dtype", c.dtype == "bf16" ? "bfloat16" : c.dtype == "fp16" ? "float16" : "float32"}};
  if (!qwen) j["attention_bias"] = c.qkv_bias;
  return j;
}

}  // namespace wick::decoder
