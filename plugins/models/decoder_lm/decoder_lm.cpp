// model `decoder_lm`: the LLaMA / Qwen2 decoder (token embedding, RMSNorm,
// rotary position embeddings, grouped-query attention through LibTorch's
// scaled-dot-product attention with a causal mask, SwiGLU MLP, optional q/k/v
// bias, tied or separate output head), with Hugging Face's parameter names, so
// a folder saved by `transformers` loads unchanged and wick's weights load
// back into `transformers`.
//
// Batches: input_ids [B, T] (int64), labels [B, T] (-100 = ignored; shifted
// inside, as Hugging Face does). Items are the target tokens.

#include <wick/model.hpp>
#include <wick/safetensors.hpp>
#include <wick/weights.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;

namespace {

constexpr std::int64_t kIgnore = -100;

struct Config {
  std::string family = "llama";
  std::int64_t vocab = 32000, hidden = 512, intermediate = 1376, layers = 6, heads = 8, kv_heads = 8, head_dim = 0;
  double rope_theta = 10000, eps = 1e-6;
  bool tie = false, qkv_bias = false;
};

class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(std::int64_t dim, double eps) : eps_(eps) { weight = register_parameter("weight", at::ones({dim})); }
  at::Tensor forward(const at::Tensor& x) {
    const auto dtype = x.scalar_type();
    at::Tensor h = x.to(at::kFloat);
    h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_);
    return weight * h.to(dtype);
  }
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

at::Tensor rotate_half(const at::Tensor& x) {
  const auto half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const Config& c) : c_(c) {
    q_proj = register_module("q_proj", wick::Linear(c.hidden, c.heads * c.head_dim, c.qkv_bias));
    k_proj = register_module("k_proj", wick::Linear(c.hidden, c.kv_heads * c.head_dim, c.qkv_bias));
    v_proj = register_module("v_proj", wick::Linear(c.hidden, c.kv_heads * c.head_dim, c.qkv_bias));
    o_proj = register_module("o_proj", wick::Linear(c.heads * c.head_dim, c.hidden, false));
  }
  // cache: this layer's keys and values of earlier positions, extended in place
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     std::pair<at::Tensor, at::Tensor>* cache = nullptr) {
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
  wick::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};

 private:
  Config c_;
};
TORCH_MODULE(Attention);

class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const Config& c) {
    gate_proj = register_module("gate_proj", wick::Linear(c.hidden, c.intermediate, false));
    up_proj = register_module("up_proj", wick::Linear(c.hidden, c.intermediate, false));
    down_proj = register_module("down_proj", wick::Linear(c.intermediate, c.hidden, false));
  }
  at::Tensor forward(const at::Tensor& x) {
    return down_proj->forward(at::silu(gate_proj->forward(x)) * up_proj->forward(x));
  }
  wick::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(Mlp);

class LayerImpl : public torch::nn::Module {
 public:
  explicit LayerImpl(const Config& c) {
    self_attn = register_module("self_attn", Attention(c));
    mlp = register_module("mlp", Mlp(c));
    input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden, c.eps));
    post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.hidden, c.eps));
  }
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     std::pair<at::Tensor, at::Tensor>* cache = nullptr) {
    x = x + self_attn->forward(input_layernorm->forward(x), cos, sin, cache);
    return x + mlp->forward(post_attention_layernorm->forward(x));
  }
  Attention self_attn{nullptr};
  Mlp mlp{nullptr};
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(Layer);

class BodyImpl : public torch::nn::Module {
 public:
  explicit BodyImpl(const Config& c) {
    embed_tokens = register_module("embed_tokens", torch::nn::Embedding(c.vocab, c.hidden));
    layers = register_module("layers", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c.layers; ++i) layers->push_back(Layer(c));
    norm = register_module("norm", RMSNorm(c.hidden, c.eps));
  }
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};
};
TORCH_MODULE(Body);

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  if (!in) throw wick::Error("cannot open " + p.string());
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw wick::Error(p.string() + " is not valid JSON: " + e.what());
  }
}

Config config_from(const wick::Options& o, nlohmann::json* hf) {
  Config c;
  if (hf) {
    const auto& j = *hf;
    const std::string type = j.value("model_type", "llama");
    if (type != "llama" && type != "qwen2")
      throw wick::Error("decoder_lm: model_type '" + type + "' is not supported (expected llama or qwen2)");
    c.family = type;
    c.vocab = j.at("vocab_size").get<std::int64_t>();
    c.hidden = j.at("hidden_size").get<std::int64_t>();
    c.intermediate = j.at("intermediate_size").get<std::int64_t>();
    c.layers = j.at("num_hidden_layers").get<std::int64_t>();
    c.heads = j.at("num_attention_heads").get<std::int64_t>();
    c.kv_heads = j.value("num_key_value_heads", c.heads);
    if (j.contains("head_dim") && !j["head_dim"].is_null()) c.head_dim = j["head_dim"].get<std::int64_t>();
    // older configs: rope_theta (and rope_scaling); newer: rope_parameters {rope_theta, rope_type}
    c.rope_theta = j.value("rope_theta", 10000.0);
    if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) {
      const auto& rp = j["rope_parameters"];
      c.rope_theta = rp.value("rope_theta", c.rope_theta);
      const std::string kind = rp.value("rope_type", std::string("default"));
      if (kind != "default") throw wick::Error("decoder_lm: rope_type '" + kind + "' is not supported yet (default)");
    }
    if (j.value("mlp_bias", false)) throw wick::Error("decoder_lm: mlp_bias is not supported");
    c.eps = j.value("rms_norm_eps", 1e-6);
    c.tie = j.value("tie_word_embeddings", false);
    c.qkv_bias = type == "qwen2" ? true : j.value("attention_bias", false);
    if (j.value("hidden_act", std::string("silu")) != "silu")
      throw wick::Error("decoder_lm: hidden_act '" + j.value("hidden_act", std::string()) + "' is not supported (silu)");
    if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
      throw wick::Error("decoder_lm: rope_scaling is not supported yet");
  } else {
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
  }
  if (c.head_dim == 0) {
    if (c.hidden % c.heads) throw wick::Error("decoder_lm: hidden size " + std::to_string(c.hidden) +
                                              " is not a multiple of " + std::to_string(c.heads) + " heads");
    c.head_dim = c.hidden / c.heads;
  }
  if (c.heads % c.kv_heads)
    throw wick::Error("decoder_lm: " + std::to_string(c.heads) + " heads are not a multiple of " +
                      std::to_string(c.kv_heads) + " key/value heads");
  return c;
}

class DecoderLM : public wick::Model {
 public:
  explicit DecoderLM(const wick::Options& o) {
    std::unique_ptr<nlohmann::json> hf;
    fs::path dir;
    if (o.has("path")) {
      dir = o.get_string("path");
      hf = std::make_unique<nlohmann::json>(read_json(dir / "config.json"));
    }
    c_ = config_from(o, hf.get());
    model = register_module("model", Body(c_));
    if (!c_.tie) lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c_.hidden, c_.vocab).bias(false)));
    const auto half = c_.head_dim / 2;
    inv_freq_ = 1.0 / at::pow(c_.rope_theta, at::arange(0, 2 * half, 2, at::kLong).to(at::kFloat) / c_.head_dim);
    if (hf) load_folder(dir);
    const std::string dtype = o.get_string("dtype");
    if (dtype == "bf16") to(at::kBFloat16);
    else if (dtype == "fp16") to(at::kHalf);
  }

  // Weights from model.safetensors or the shards of model.safetensors.index.json.
  void load_folder(const fs::path& dir) {
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
      throw wick::Error("decoder_lm: " + dir.string() + " has no model.safetensors or model.safetensors.index.json");
    }
    for (const auto& f : files)
      for (auto& t : wick::read_safetensors(f).tensors) all.push_back(std::move(t));
    // a tied head is the embedding: a file may still carry a copy of it
    std::set<std::string> ignore;
    if (c_.tie) ignore.insert("lm_head.weight");
    wick::load_state(*this, all, dir.string(), ignore);
  }

  using Cache = std::vector<std::pair<at::Tensor, at::Tensor>>;

  // Logits for `ids` at positions offset, offset + 1, ...; with a cache, the
  // keys and values of the positions before are reused and these appended.
  at::Tensor logits(const at::Tensor& ids, Cache* cache = nullptr, std::int64_t offset = 0) {
    const auto T = ids.size(1);
    at::Tensor pos = at::arange(offset, offset + T, at::TensorOptions().dtype(at::kFloat).device(ids.device()));
    at::Tensor freqs = at::outer(pos, inv_freq_.to(ids.device()));
    at::Tensor emb = at::cat({freqs, freqs}, -1);
    at::Tensor x = model->embed_tokens->forward(ids);
    at::Tensor cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
    if (cache) cache->resize(model->layers->size());
    std::size_t i = 0;
    for (const auto& layer : *model->layers) {
      auto* l = layer->as<Layer>();
      if (cache) x = l->forward(x, cos, sin, &(*cache)[i]);
      else  // a declared block: checkpointed when the recipe asks
        x = run_block("model.layers." + std::to_string(i),
                      [l, cos, sin](const at::Tensor& h) { return l->forward(h, cos, sin, nullptr); }, x);
      ++i;
    }
    x = model->norm->forward(x);
    return c_.tie ? at::linear(x, model->embed_tokens->weight) : lm_head->forward(x);
  }

  static at::Tensor targets(const wick::Batch& b) {
    auto it = b.find("labels");
    const at::Tensor& labels = it != b.end() ? it->second : b.at("input_ids");
    return labels.narrow(1, 1, labels.size(1) - 1);
  }

  std::int64_t count_items(const wick::Batch& b) const override {
    return targets(b).ne(kIgnore).sum().item<std::int64_t>();
  }

  wick::ForwardResult forward(const wick::Batch& b) override {
    const at::Tensor& ids = b.at("input_ids");
    at::Tensor out = logits(ids);
    at::Tensor y = targets(b).reshape({-1});
    at::Tensor l = out.narrow(1, 0, out.size(1) - 1).reshape({-1, out.size(-1)}).to(at::kFloat);
    wick::ForwardResult r;
    r.loss_sum = at::cross_entropy_loss(l, y, {}, at::Reduction::Sum, kIgnore);
    r.items = y.ne(kIgnore).sum().item<std::int64_t>();
    r.metrics["accuracy"] = l.argmax(-1).eq(y).logical_and(y.ne(kIgnore)).sum();
    return r;
  }

  at::Tensor predict(const wick::Batch& b) override { return logits(b.at("input_ids")); }

  // Greedy or sampled continuation with a key/value cache: the prompt once,
  // then one position per new token.
  std::vector<std::int64_t> generate(const std::vector<std::int64_t>& prompt, const wick::GenerateOptions& g) override {
    if (prompt.empty()) throw wick::Error("decoder_lm: generate needs a prompt of at least one token");
    for (auto t : prompt)
      if (t < 0 || t >= c_.vocab)
        throw wick::Error("decoder_lm: prompt token " + std::to_string(t) + " is outside the vocabulary of " +
                          std::to_string(c_.vocab));
    const bool was_training = is_training();
    train(false);
    at::NoGradGuard no_grad;
    const auto device = model->embed_tokens->weight.device();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(g.seed);
    Cache cache;
    std::vector<std::int64_t> out;
    at::Tensor step_ids = at::tensor(prompt, at::kLong).unsqueeze(0).to(device);
    std::int64_t offset = 0;
    for (std::int64_t n = 0; n < g.max_new_tokens; ++n) {
      at::Tensor l = logits(step_ids, &cache, offset).select(1, -1).squeeze(0).to(at::kFloat).cpu();
      offset += step_ids.size(1);
      std::int64_t next;
      if (g.temperature <= 0) {
        next = l.argmax().item<std::int64_t>();
      } else {
        at::Tensor p = at::softmax(l / g.temperature, -1);
        auto [sorted, idx] = p.sort(/*dim=*/-1, /*descending=*/true);
        if (g.top_k > 0 && g.top_k < sorted.size(0)) sorted.narrow(0, g.top_k, sorted.size(0) - g.top_k).zero_();
        if (g.top_p < 1.0) {  // keep the smallest prefix whose mass reaches top_p
          at::Tensor before = sorted.cumsum(0) - sorted;
          sorted.masked_fill_(before.ge(g.top_p), 0.0);
        }
        const auto pick = at::multinomial(sorted / sorted.sum(), 1, false, gen).item<std::int64_t>();
        next = idx[pick].item<std::int64_t>();
      }
      out.push_back(next);
      if (next == g.eos_id) break;
      step_ids = at::full({1, 1}, next, at::TensorOptions().dtype(at::kLong).device(device));
    }
    train(was_training);
    return out;
  }

  std::string item_name() const override { return "tokens"; }

  std::vector<std::string> blocks() const override {
    std::vector<std::string> out;
    for (std::int64_t i = 0; i < c_.layers; ++i) out.push_back("model.layers." + std::to_string(i));
    return out;
  }

  std::vector<std::pair<std::string, wick::Linear>> linear_layers() override {
    std::vector<std::pair<std::string, wick::Linear>> out;
    std::int64_t i = 0;
    for (const auto& m : *model->layers) {
      auto* layer = m->as<Layer>();
      const std::string p = "model.layers." + std::to_string(i++) + ".";
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

  std::vector<std::string> targets() const override {
    std::vector<std::string> out;
    for (std::int64_t i = 0; i < c_.layers; ++i)
      for (const char* n : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
        out.push_back("model.layers." + std::to_string(i) + "." + n);
    return out;
  }

  std::map<std::string, wick::Value> attributes() const override {
    return {{"vocab_size", c_.vocab}, {"hidden_size", c_.hidden}, {"layers", c_.layers}, {"family", c_.family},
            {"tie_embeddings", c_.tie}, {"hf_config", hf_config().dump(2)}};
  }

  // The config.json that transformers reads for this model.
  nlohmann::json hf_config() const {
    const bool qwen = c_.family == "qwen2";
    nlohmann::json j = {
        {"architectures", {qwen ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
        {"model_type", c_.family},
        {"vocab_size", c_.vocab},
        {"hidden_size", c_.hidden},
        {"intermediate_size", c_.intermediate},
        {"num_hidden_layers", c_.layers},
        {"num_attention_heads", c_.heads},
        {"num_key_value_heads", c_.kv_heads},
        {"head_dim", c_.head_dim},
        {"hidden_act", "silu"},
        {"rms_norm_eps", c_.eps},
        {"rope_theta", c_.rope_theta},
        {"rope_parameters", {{"rope_theta", c_.rope_theta}, {"rope_type", "default"}}},
        {"tie_word_embeddings", c_.tie},
        {"max_position_embeddings", 4096},
        {"torch_dtype", "float32"}};
    if (!qwen) j["attention_bias"] = c_.qkv_bias;
    return j;
  }

  Body model{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  Config c_;
  at::Tensor inv_freq_;
};

}  // namespace

WICK_PLUGIN(wick::model_plugin<DecoderLM>(
    "decoder_lm", "LLaMA/Qwen2 decoder language model (Hugging Face names and folders)",
    {wick::opt_string("path", wick::Value(), "Hugging Face model folder (config.json + safetensors); overrides the sizes below").optional(),
     wick::opt_string("family", "llama", "llama, or qwen2 (q/k/v bias)").one_of({"llama", "qwen2"}),
     wick::opt_int("vocab_size", 256, "vocabulary size").at_least(1),
     wick::opt_int("hidden_size", 256, "model width").at_least(1),
     wick::opt_int("intermediate_size", 688, "MLP width").at_least(1),
     wick::opt_int("layers", 4, "decoder layers").at_least(1),
     wick::opt_int("heads", 4, "attention heads").at_least(1),
     wick::opt_int("kv_heads", wick::Value(), "key/value heads (grouped-query attention; default: heads)").at_least(1).optional(),
     wick::opt_float("rope_theta", 10000.0, "rotary embedding base").at_least(1),
     wick::opt_float("rms_norm_eps", 1e-6, "RMSNorm epsilon").at_least(0),
     wick::opt_bool("tie_embeddings", false, "output head shares the token embedding"),
     wick::opt_string("dtype", "fp32", "weight dtype").one_of({"fp32", "bf16", "fp16"})}))
