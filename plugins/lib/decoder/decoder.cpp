#include "lib/decoder/decoder.hpp"

#include <wick/kit/safetensors.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <fstream>
#include <set>

namespace fs = std::filesystem;

namespace wick::decoder {

RMSNormImpl::RMSNormImpl(std::int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  const auto dtype = x.scalar_type();
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return weight * h.to(dtype);
}

namespace {
at::Tensor rotate_half(const at::Tensor& x) {
  const auto half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}
}  // namespace

AttentionImpl::AttentionImpl(const Config& c) : c_(c) {
  q_proj = register_module("q_proj", wick::Linear(c.hidden, c.heads * c.head_dim, c.qkv_bias));
  k_proj = register_module("k_proj", wick::Linear(c.hidden, c.kv_heads * c.head_dim, c.qkv_bias));
  v_proj = register_module("v_proj", wick::Linear(c.hidden, c.kv_heads * c.head_dim, c.qkv_bias));
  o_proj = register_module("o_proj", wick::Linear(c.heads * c.head_dim, c.hidden, false));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                  std::pair<at::Tensor, at::Tensor>* cache) {
  const auto B = x.size(0), T = x.size(1);
  at::Tensor q = q_proj->forward(x).view({B, T, c_.heads, c_.head_dim}).transpose(1, 2);
  at::Tensor k = k_proj->forward(x).view({B, T, c_.kv_heads, c_.head_dim}).transpose(1, 2);
  at::Tensor v = v_proj->forward(x).view({B, T, c_.kv_heads, c_.head_dim}).transpose(1, 2);
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  const bool past = cache && cache->first.defined();
  if (cache) {
    if (past) {
      k = at::cat({cache->first, k}, 2);
      v = at::cat({cache->second, v}, 2);
    }
    *cache = {k, v};
  }
  if (c_.kv_heads != c_.heads) {  // each key/value head serves heads / kv_heads query heads
    const auto rep = c_.heads / c_.kv_heads;
    k = k.repeat_interleave(rep, 1);
    v = v.repeat_interleave(rep, 1);
  }
  // new positions see every cached one: causal masking is needed only among themselves
  if (past && T > 1) throw wick::Error("decoder_lm: several new tokens after a cache are not supported");
  at::Tensor y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/!past);
  return o_proj->forward(y.transpose(1, 2).reshape({B, T, c_.heads * c_.head_dim}));
}

MlpImpl::MlpImpl(const Config& c) {
  gate_proj = register_module("gate_proj", wick::Linear(c.hidden, c.intermediate, false));
  up_proj = register_module("up_proj", wick::Linear(c.hidden, c.intermediate, false));
  down_proj = register_module("down_proj", wick::Linear(c.intermediate, c.hidden, false));
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  return down_proj->forward(at::silu(gate_proj->forward(x)) * up_proj->forward(x));
}

LayerImpl::LayerImpl(const Config& c) {
  self_attn = register_module("self_attn", Attention(c));
  mlp = register_module("mlp", Mlp(c));
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden, c.eps));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.hidden, c.eps));
}

at::Tensor LayerImpl::forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                              std::pair<at::Tensor, at::Tensor>* cache) {
  x = x + self_attn->forward(input_layernorm->forward(x), cos, sin, cache);
  return x + mlp->forward(post_attention_layernorm->forward(x));
}

BodyImpl::BodyImpl(const Config& c) {
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(c.vocab, c.hidden));
  layers = register_module("layers", torch::nn::ModuleList());
  for (std::int64_t i = 0; i < c.layers; ++i) layers->push_back(Layer(c));
  norm = register_module("norm", RMSNorm(c.hidden, c.eps));
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  if (!in) throw wick::Error("cannot open " + p.string());
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw wick::Error(p.string() + " is not valid JSON: " + e.what());
  }
}

void finish_config(Config& c, const std::string& who) {
  if (c.head_dim == 0) {
    if (c.hidden % c.heads)
      throw wick::Error(who + ": hidden size " + std::to_string(c.hidden) + " is not a multiple of " +
                        std::to_string(c.heads) + " heads");
    c.head_dim = c.hidden / c.heads;
  }
  if (c.heads % c.kv_heads)
    throw wick::Error(who + ": " + std::to_string(c.heads) + " heads are not a multiple of " +
                      std::to_string(c.kv_heads) + " key/value heads");
}

Config config_from_hf(const nlohmann::json& j, const std::string& who) {
  Config c;
  const std::string type = j.value("model_type", "llama");
  if (type != "llama" && type != "qwen2")
    throw wick::Error(who + ": model_type '" + type + "' is not supported (expected llama or qwen2)");
  c.family = type;
  c.vocab = j.at("vocab_size").get<std::int64_t>();
  c.hidden = j.at("hidden_size").get<std::int64_t>();
  c.intermediate = j.at("intermediate_size").get<std::int64_t>();
  c.layers = j.at("num_hidden_layers").get<std::int64_t>();
  c.heads = j.at("num_attention_heads").get<std::int64_t>();
  c.kv_heads = j.value("num_key_value_heads", c.heads);
  if (j.contains("num_key_value_heads") && j["num_key_value_heads"].is_null()) c.kv_heads = c.heads;
  if (j.contains("head_dim") && !j["head_dim"].is_null()) c.head_dim = j["head_dim"].get<std::int64_t>();
  // older configs: rope_theta (and rope_scaling); newer: rope_parameters {rope_theta, rope_type}
  c.rope_theta = j.value("rope_theta", 10000.0);
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
    const auto& rp = j["rope_parameters"];
    c.rope_theta = rp.value("rope_theta", c.rope_theta);
    const std::string kind = rp.value("rope_type", std::string("default"));
    if (kind != "default") throw wick::Error(who + ": rope_type '" + kind + "' is not supported yet (default)");
  }
  if (j.value("mlp_bias", false)) throw wick::Error(who + ": mlp_bias is not supported");
  c.eps = j.value("rms_norm_eps", 1e-6);
  // the context; absent, transformers' default for the family
  c.max_positions = type == "qwen2" ? 32768 : 2048;
  if (auto it = j.find("max_position_embeddings"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<std::int64_t>() < 1)
      throw wick::Error(who + ": config.json: max_position_embeddings: expected a whole number >= 1, got " + it->dump());
    c.max_positions = it->get<std::int64_t>();
  }
  c.tie = j.value("tie_word_embeddings", false);
  c.qkv_bias = type == "qwen2" ? true : j.value("attention_bias", false);
  if (j.value("hidden_act", std::string("silu")) != "silu")
    throw wick::Error(who + ": hidden_act '" + j.value("hidden_act", std::string()) + "' is not supported (silu)");
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
    throw wick::Error(who + ": rope_scaling is not supported yet");
  finish_config(c, who);
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
          wick::opt_bool("tie_embeddings", false, "output head shares the token embedding")};
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
                      {"rope_theta", c.rope_theta},
                      {"rope_parameters", {{"rope_theta", c.rope_theta}, {"rope_type", "default"}}},
                      {"tie_word_embeddings", c.tie},
                      {"max_position_embeddings", c.max_positions},
                      {"torch_dtype", "float32"}};
  if (!qwen) j["attention_bias"] = c.qkv_bias;
  return j;
}

wick::NamedTensorList read_folder(const fs::path& dir, const std::string& who) {
  wick::NamedTensorList all;
  std::vector<fs::path> files;
  if (fs::exists(dir / "model.safetensors")) {
    files.push_back(dir / "model.safetensors");
  } else if (fs::exists(dir / "model.safetensors.index.json")) {
    std::set<std::string> shards;
    const nlohmann::json index = read_json(dir / "model.safetensors.index.json");
    for (const auto& [name, file] : index.at("weight_map").items()) shards.insert(file.get<std::string>());
    for (const auto& s : shards) files.push_back(dir / s);
  } else {
    throw wick::Error(who + ": " + dir.string() + " has no model.safetensors or model.safetensors.index.json");
  }
  for (const auto& f : files)
    for (auto& t : wick::read_safetensors(f).tensors) all.push_back(std::move(t));
  return all;
}

std::int64_t pick_token(const at::Tensor& l, const wick::GenerateOptions& g, at::Generator& gen) {
  if (g.temperature <= 0) return l.argmax().item<std::int64_t>();
  at::Tensor p = at::softmax(l / g.temperature, -1);
  auto [sorted, idx] = p.sort(/*dim=*/-1, /*descending=*/true);
  if (g.top_k > 0 && g.top_k < sorted.size(0)) sorted.narrow(0, g.top_k, sorted.size(0) - g.top_k).zero_();
  if (g.top_p < 1.0) {  // keep the smallest prefix whose mass reaches top_p
    at::Tensor before = sorted.cumsum(0) - sorted;
    sorted.masked_fill_(before.ge(g.top_p), 0.0);
  }
  const auto pick = at::multinomial(sorted / sorted.sum(), 1, false, gen).item<std::int64_t>();
  return idx[pick].item<std::int64_t>();
}

Decoder::Decoder(const Config& c, std::string body_prefix) : c_(c), prefix_(std::move(body_prefix)) {
  body = Body(c_);
  if (!c_.tie) lm_head = torch::nn::Linear(torch::nn::LinearOptions(c_.hidden, c_.vocab).bias(false));
  const auto half = c_.head_dim / 2;
  inv_freq_ = 1.0 / at::pow(c_.rope_theta, at::arange(0, 2 * half, 2, at::kLong).to(at::kFloat) / c_.head_dim);
}

void Decoder::register_with(torch::nn::Module& body_parent, const std::string& body_name, torch::nn::Module& owner) {
  body_parent.register_module(body_name, body);
  if (lm_head) owner.register_module("lm_head", lm_head);
}

at::Tensor Decoder::hidden(at::Tensor x, wick::Model* owner, Cache* cache, std::int64_t offset) {
  const auto T = x.size(1);
  at::Tensor pos = at::arange(offset, offset + T, at::TensorOptions().dtype(at::kFloat).device(x.device()));
  at::Tensor freqs = at::outer(pos, inv_freq_.to(x.device()));
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  at::Tensor cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
  if (cache) cache->resize(body->layers->size());
  std::size_t i = 0;
  for (const auto& layer : *body->layers) {
    auto* l = layer->as<Layer>();
    if (cache || !owner) {
      x = l->forward(x, cos, sin, cache ? &(*cache)[i] : nullptr);
    } else {  // a declared block: checkpointed when the recipe asks
      x = owner->run_block(prefix_ + ".layers." + std::to_string(i),
                           [l, cos, sin](const at::Tensor& h) { return l->forward(h, cos, sin, nullptr); }, x);
    }
    ++i;
  }
  return body->norm->forward(x);
}

at::Tensor Decoder::head(const at::Tensor& h) {
  return c_.tie ? at::linear(h, body->embed_tokens->weight) : lm_head->forward(h);
}

wick::ForwardResult Decoder::loss(const at::Tensor& out, const at::Tensor& labels) {
  at::Tensor y = labels.narrow(1, 1, labels.size(1) - 1).reshape({-1});
  at::Tensor l = out.narrow(1, 0, out.size(1) - 1).reshape({-1, out.size(-1)}).to(at::kFloat);
  wick::ForwardResult r;
  r.loss_sum = at::cross_entropy_loss(l, y, {}, at::Reduction::Sum, kIgnore);
  r.items = y.ne(kIgnore).sum().item<std::int64_t>();
  r.metrics["accuracy"] = l.argmax(-1).eq(y).logical_and(y.ne(kIgnore)).sum();
  return r;
}

std::vector<std::int64_t> Decoder::generate_from_embeds(const at::Tensor& embeds, const wick::GenerateOptions& g,
                                                        const std::string& who) {
  // Positions beyond the context are ones the model never learned: refused,
  // not generated (transformers only warns). This also bounds the key/value cache.
  const std::int64_t prompt = embeds.size(1), context = c_.max_positions;
  if (g.max_new_tokens > context - prompt)
    throw wick::Error(who + ": generate: a prompt of " + std::to_string(prompt) + " tokens and max_new_tokens=" +
                      std::to_string(g.max_new_tokens) + " exceed the model's context of " + std::to_string(context) +
                      " positions (max_position_embeddings), expected " +
                      (prompt < context ? "max_new_tokens <= " + std::to_string(context - prompt)
                                        : "a prompt shorter than " + std::to_string(context) + " tokens"));
  at::NoGradGuard no_grad;
  const auto dev = device();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(g.seed);
  Cache cache;
  std::vector<std::int64_t> out;
  at::Tensor x = embeds;
  std::int64_t offset = 0;
  for (std::int64_t n = 0; n < g.max_new_tokens; ++n) {
    at::Tensor l = logits_from_embeds(x, nullptr, &cache, offset).select(1, -1).squeeze(0).to(at::kFloat).cpu();
    offset += x.size(1);
    const std::int64_t next = pick_token(l, g, gen);
    out.push_back(next);
    if (g.on_token) g.on_token(next);
    if (next == g.eos_id) break;
    x = embed(at::full({1, 1}, next, at::TensorOptions().dtype(at::kLong).device(dev)));
  }
  return out;
}

std::vector<std::int64_t> Decoder::generate(const std::vector<std::int64_t>& prompt, const wick::GenerateOptions& g,
                                            const std::string& who) {
  if (prompt.empty()) throw wick::Error(who + ": generate needs a prompt of at least one token");
  for (auto t : prompt)
    if (t < 0 || t >= c_.vocab)
      throw wick::Error(who + ": prompt token " + std::to_string(t) + " is outside the vocabulary of " +
                        std::to_string(c_.vocab));
  at::NoGradGuard no_grad;
  return generate_from_embeds(embed(at::tensor(prompt, at::kLong).unsqueeze(0).to(device())), g, who);
}

std::vector<std::string> Decoder::blocks() const {
  std::vector<std::string> out;
  for (std::int64_t i = 0; i < c_.layers; ++i) out.push_back(prefix_ + ".layers." + std::to_string(i));
  return out;
}

std::vector<std::pair<std::string, wick::Linear>> Decoder::linear_layers() {
  std::vector<std::pair<std::string, wick::Linear>> out;
  std::int64_t i = 0;
  for (const auto& m : *body->layers) {
    auto* layer = m->as<Layer>();
    const std::string p = prefix_ + ".layers." + std::to_string(i++) + ".";
    out.emplace_back(p + "self_attn.q_proj", layer->self_attn->q_proj);
    out.emplace_back(p + "self_attn.k_proj", layer->self_attn->k_proj);
    out.emplace_back(p + "self_attn.v_proj", layer->self_attn->v_proj);
    out.emplace_back(p + "self_attn.o_proj", layer->self_attn->o_proj);
    out.emplace_back(p + "mlp.gate_proj", layer->mlp->gate_proj);
    out.emplace_back(p + "mlp.up_proj", layer->mlp->up_proj);
    out.emplace_back(p + "mlp.down_proj", layer->mlp->down_proj);
  }
  return out;
}

std::set<std::string> Decoder::ignored_on_load() const {
  if (c_.tie) return {"lm_head.weight"};
  return {};
}

}  // namespace wick::decoder
