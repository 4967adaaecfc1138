#include "lib/decoder/decoder.hpp"

#include <wick/kit/safetensors.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
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

wick::NamedTensorList read_folder(const fs::path& dir, const std::string& who) {
  return wick::read_safetensors_folder(dir, who);
}

void untie_if_distinct(Config& c, const wick::NamedTensorList& weights, const std::string& embed,
                       const std::string& head, const std::string& where) {
  if (!c.tie) return;
  const at::Tensor *e = nullptr, *h = nullptr;
  for (const auto& [n, t] : weights) {
    if (n == embed) e = &t;
    if (n == head) h = &t;
  }
  if (!h || (e && e->sizes() == h->sizes() && e->scalar_type() == h->scalar_type() && at::equal(*e, *h))) return;
  c.tie = false;
  std::fprintf(stderr,
               "wick: %s: tie_word_embeddings is true but the weights hold a %s other than %s: it stays a separate "
               "output head, as transformers leaves it\n",
               where.c_str(), head.c_str(), embed.c_str());
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
