#include "lib/decoder/decoder.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>

#include <wick/kit/deferred_build.hpp>
#include <wick/kit/heap.hpp>
#include <wick/kit/lookup.hpp>
#include <wick/kit/safetensors.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <set>

namespace fs = std::filesystem;

namespace wick::decoder {

RMSNormImpl::RMSNormImpl(std::int64_t dim, double eps, at::ScalarType dtype, bool gemma) : eps_(eps), gemma_(gemma) {
  const auto opt = at::TensorOptions().dtype(dtype);
  weight = register_parameter("weight", gemma ? at::zeros({dim}, opt) : at::ones({dim}, opt));
}

namespace {
// weight * (x * rsqrt(mean(x^2) + eps)) as transformers' LlamaRMSNorm computes
// it (in fp32, rounded to x's dtype before the weight), keeping for backward
// x and one fp32 number per row, where autograd's composition keeps x's fp32
// copy and the normalised rows: 24 MiB less per block of a 7 B model at
// 1,088 tokens. The same forward bits; gradients within rounding.
struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& w, double eps) {
    const at::Tensor xf = x.to(at::kFloat);
    const at::Tensor r = at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
    const at::Tensor y = w * (xf * r).to(x.scalar_type());
    ctx->save_for_backward({x, w, r});
    return {y};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &r = saved[2], &gy = grads[0];
    at::Tensor gx, gw;
    if (ctx->needs_input_grad(1)) {
      const at::Tensor n = (x.to(at::kFloat) * r).to(x.scalar_type());
      gw = (gy * n).sum_to_size(w.sizes()).to(w.scalar_type());
    }
    if (ctx->needs_input_grad(0)) {
      // h = x r, r = (mean(x^2) + eps)^-1/2: dx = r gh - x r^3 mean(gh x)
      const at::Tensor gh = (gy * w).to(at::kFloat), xf = x.to(at::kFloat);
      gx = (gh * r - xf * (r.pow(3) * (gh * xf).mean(-1, /*keepdim=*/true))).to(x.scalar_type());
    }
    return {gx, gw, at::Tensor()};
  }
};
}  // namespace

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  if (gemma_) {  // (x * w).to(dtype), where LLaMA rounds x first
    const at::Tensor h = x.to(at::kFloat);
    return (h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps_) * (1.0 + weight.to(at::kFloat))).to(x.scalar_type());
  }
  if (at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad()))
    return RmsNormFunction::apply(x, weight, eps_)[0];
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

namespace {
// A fresh weight as transformers' _init_weights makes it: normal(0, std),
// drawn in fp32 and rounded into t's dtype (so a bf16 build holds what an
// fp32 build converted holds).
void init_normal(at::Tensor& t, double std) {
  at::NoGradGuard no_grad;
  t.copy_(at::empty(t.sizes(), at::kFloat).normal_(0.0, std));
}

// init_normal now, or (a deferred build) as a recorded step making the same bits
void init_or_defer(at::Tensor& t, double std, const Build& b) {
  if (!b.deferral) return init_normal(t, std);
  // (the dtype it is built in: the host may have changed the hollow tensor's since)
  b.deferral->add_random([t, std, dtype = t.scalar_type()](const wick::Deferral::Emit& emit) {
    at::Tensor v = at::empty(t.sizes(), at::TensorOptions().dtype(dtype));
    init_normal(v, std);
    emit(t, v);
  });
}

// A deferred build's layer: hollow (quantized hollow with quantize_block
// and init), its values a recorded step drawing what linear() draws below.
wick::Linear deferred_linear(std::int64_t in, std::int64_t out, bool bias, const Config& c, const Build& b) {
  wick::Linear l(in, out, bias, b.dtype, wick::LinearImpl::Hollow{});
  const std::int64_t block = b.quantize_block;
  if (!b.init) return l;  // a folder's values: the model records them
  if (block > 0) l->hollow_nf4(at::kBFloat16, block);
  // (the weight tensor as built: a layer quantized after the build still gets its values through it, routed by the host)
  b.deferral->add_random([l, weight = l->weight, block, dtype = b.dtype, std = c.init_range](const wick::Deferral::Emit& emit) {
    at::Tensor w = at::empty({l->out_features, l->in_features}, dtype);
    init_normal(w, std);
    if (block > 0) l->emit_nf4_from(w, emit);
    else emit(weight, w);
    if (l->bias.defined()) emit(l->bias, at::zeros({l->out_features}, dtype));
  });
  return l;
}

wick::Linear linear(std::int64_t in, std::int64_t out, bool bias, const Config& c, const Build& b) {
  if (b.deferral) return deferred_linear(in, out, bias, c, b);
  wick::Linear l(in, out, bias, b.dtype, /*init=*/false, b.defer_linear);
  if (!b.init) return l;
  if (!b.defer_linear) init_normal(l->weight, c.init_range);
  if (bias) {
    at::NoGradGuard no_grad;
    l->bias.zero_();
  }
  if (!b.defer_linear && b.quantize_block > 0) l->quantize_nf4(at::kBFloat16, b.quantize_block);
  return l;
}
}  // namespace

wick::OptionSchema quantize_options() {
  return {wick::opt_string("quantize", "none",
                           "nf4: every linear layer of the language model but the head is stored as 4-bit NF4 "
                           "(double-quantized constants, as optim 'qlora' stores it), each weight quantized as its "
                           "tensor is read (or made), so the full-precision model never exists; qlora over it keeps "
                           "these weights")
              .one_of({"none", "nf4"}),
          wick::opt_int("quantize_block", 64, "weights per NF4 block with quantize = \"nf4\"").at_least(2)};
}

void check_nf4_block(const Config& c, std::int64_t block, const std::string& prefix, const std::string& who) {
  const std::string l0 = prefix + ".layers.0.";
  const std::int64_t q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
  const std::vector<std::pair<std::string, std::int64_t>> layers =
      c.fused ? std::vector<std::pair<std::string, std::int64_t>>{
                    {"self_attn.qkv_proj", c.hidden * (q + 2 * kv)}, {"self_attn.o_proj", q * c.hidden},
                    {"mlp.gate_up_proj", c.hidden * 2 * c.intermediate}, {"mlp.down_proj", c.intermediate * c.hidden}}
              : std::vector<std::pair<std::string, std::int64_t>>{
                    {"self_attn.q_proj", c.hidden * q},     {"self_attn.k_proj", c.hidden * kv},
                    {"self_attn.v_proj", c.hidden * kv},    {"self_attn.o_proj", q * c.hidden},
                    {"mlp.gate_proj", c.hidden * c.intermediate}, {"mlp.up_proj", c.hidden * c.intermediate},
                    {"mlp.down_proj", c.intermediate * c.hidden}};
  if (c.layers == 0) return;
  for (const auto& [name, n] : layers)
    if (n % block != 0 || n % 2 != 0)
      throw wick::Error(who + ": quantize_block " + std::to_string(block) + " does not divide layer " + l0 + name +
                        "'s " + std::to_string(n) + " weights, expected a block size that divides every linear "
                        "layer's weight count (an even count)");
}

AttentionImpl::AttentionImpl(const Config& c, const Build& b, std::int64_t layer)
    : c_(c), slides_(layer_slides(c, layer)) {
  const std::int64_t q = c.heads * c.head_dim, kv = c.kv_heads * c.head_dim;
  if (c.fused) {
    qkv_proj = register_module("qkv_proj", linear(c.hidden, q + 2 * kv, c.qkv_bias, c, b));
  } else {
    q_proj = register_module("q_proj", linear(c.hidden, q, c.qkv_bias, c, b));
    k_proj = register_module("k_proj", linear(c.hidden, kv, c.qkv_bias, c, b));
    v_proj = register_module("v_proj", linear(c.hidden, kv, c.qkv_bias, c, b));
  }
  o_proj = register_module("o_proj", linear(q, c.hidden, c.o_bias, c, b));
  if (c.qk_norm) {
    q_norm = register_module("q_norm", RMSNorm(c.head_dim, c.eps, b.dtype, c.gemma));
    k_norm = register_module("k_norm", RMSNorm(c.head_dim, c.eps, b.dtype, c.gemma));
  }
}

namespace {
// x [B, heads, T, head_dim] turned by the rotary tables [T, rotary]: the
// first `rotary` features of each head (all but with Phi's partial rotation)
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto rd = cos.size(-1), D = x.size(-1);
  if (rd == D) return x * cos + rotate_half(x) * sin;
  const at::Tensor r = x.narrow(-1, 0, rd);
  return at::cat({r * cos + rotate_half(r) * sin, x.narrow(-1, rd, D - rd)}, -1);
}
}  // namespace

at::Tensor sliding_window_mask(std::int64_t window, std::int64_t T, std::int64_t S, at::Device device) {
  if (window <= 0 || S <= window) return {};
  const auto opt = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor p = at::arange(S - T, S, opt).unsqueeze(1), j = at::arange(S, opt).unsqueeze(0);
  return j.le(p).logical_and(j.gt(p - window));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                  std::pair<at::Tensor, at::Tensor>* cache, const at::Tensor& window,
                                  const at::Tensor& documents) {
  const auto B = x.size(0), T = x.size(1);
  const std::int64_t nq = c_.heads * c_.head_dim, nkv = c_.kv_heads * c_.head_dim;
  at::Tensor q, k, v;
  if (c_.fused) {  // Phi-3's qkv_proj: q's rows, then k's, then v's
    const at::Tensor qkv = qkv_proj->forward(x);
    q = qkv.narrow(-1, 0, nq), k = qkv.narrow(-1, nq, nkv), v = qkv.narrow(-1, nq + nkv, nkv);
  } else {
    q = q_proj->forward(x), k = k_proj->forward(x), v = v_proj->forward(x);
  }
  q = q.reshape({B, T, c_.heads, c_.head_dim});
  k = k.reshape({B, T, c_.kv_heads, c_.head_dim});
  if (q_norm) q = q_norm->forward(q), k = k_norm->forward(k);  // Qwen3: each head's features, before the rotation
  q = rotate(q.transpose(1, 2), cos, sin);
  k = rotate(k.transpose(1, 2), cos, sin);
  v = v.reshape({B, T, c_.kv_heads, c_.head_dim}).transpose(1, 2);
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
  const std::optional<double> scale = c_.attn_scale > 0 ? std::optional<double>(c_.attn_scale) : std::nullopt;
  at::Tensor mask = slides_ && window.defined() ? window : at::Tensor();  // the window's mask holds the causal one
  if (documents.defined()) mask = mask.defined() ? documents.logical_and(mask) : documents;  // [B, 1, T, T], causal too
  at::Tensor y;
  if (c_.attn_softcap > 0) {
    // Gemma 2's capped scores, which scaled-dot-product attention cannot take:
    // the scores, cap * tanh(s / cap), the mask, a softmax in fp32
    at::Tensor s = at::matmul(q, k.transpose(-2, -1)) * (scale ? *scale : 1.0 / std::sqrt(static_cast<double>(c_.head_dim)));
    s = at::tanh(s / c_.attn_softcap) * c_.attn_softcap;
    at::Tensor allowed = mask;
    if (!allowed.defined() && !past) {
      const auto S = k.size(2);
      allowed = at::ones({T, S}, at::TensorOptions().dtype(at::kBool).device(x.device())).tril(S - T);
    }
    if (allowed.defined()) s = s.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
    y = at::matmul(at::softmax(s, -1, at::kFloat).to(q.scalar_type()), v);
  } else if (mask.defined()) {
    y = at::scaled_dot_product_attention(q, k, v, mask, 0.0, /*is_causal=*/false, scale);
  } else {
    y = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/!past, scale);
  }
  return o_proj->forward(y.transpose(1, 2).reshape({B, T, nq}));
}

MlpImpl::MlpImpl(const Config& c, const Build& b) : gelu_(c.gemma) {
  if (c.fused) {
    gate_up_proj = register_module("gate_up_proj", linear(c.hidden, 2 * c.intermediate, false, c, b));
  } else {
    gate_proj = register_module("gate_proj", linear(c.hidden, c.intermediate, false, c, b));
    up_proj = register_module("up_proj", linear(c.hidden, c.intermediate, false, c, b));
  }
  down_proj = register_module("down_proj", linear(c.intermediate, c.hidden, false, c, b));
}

namespace {
// silu(g) * u, keeping g and u for backward but not silu(g): made again
// there. The same ops, forward and backward, as autograd's composition, and
// one [tokens, intermediate] tensor less in a block's recomputation.
struct SwiGlu : torch::autograd::Function<SwiGlu> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& g,
                                                const at::Tensor& u) {
    ctx->save_for_backward({g, u});
    return {at::silu(g) * u};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &g = saved[0], &u = saved[1], &dy = grads[0];
    // one [tokens, intermediate] temporary at a time
    at::Tensor dg = ctx->needs_input_grad(0) ? at::silu_backward(dy * u, g) : at::Tensor();
    at::Tensor du = ctx->needs_input_grad(1) ? at::silu(g).mul_(dy) : at::Tensor();
    return {dg, du};
  }
};
}  // namespace

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  at::Tensor g, u;
  if (gate_up_proj) {  // Phi-3: gate's rows, then up's
    const at::Tensor gu = gate_up_proj->forward(x);
    const auto n = gu.size(-1) / 2;
    g = gu.narrow(-1, 0, n), u = gu.narrow(-1, n, n);
  } else {
    g = gate_proj->forward(x), u = up_proj->forward(x);
  }
  if (gelu_) return down_proj->forward(at::gelu(g, "tanh") * u);  // Gemma's GeGLU
  const at::Tensor h = at::GradMode::is_enabled() && (g.requires_grad() || u.requires_grad())
                           ? SwiGlu::apply(g, u)[0]
                           : at::silu(g) * u;
  return down_proj->forward(h);
}

LayerImpl::LayerImpl(const Config& c, const Build& b, std::int64_t index) {
  self_attn = register_module("self_attn", Attention(c, b, index));
  mlp = register_module("mlp", Mlp(c, b));
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden, c.eps, b.dtype, c.gemma));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.hidden, c.eps, b.dtype, c.gemma));
  if (c.gemma) {
    pre_feedforward_layernorm = register_module("pre_feedforward_layernorm", RMSNorm(c.hidden, c.eps, b.dtype, true));
    post_feedforward_layernorm = register_module("post_feedforward_layernorm", RMSNorm(c.hidden, c.eps, b.dtype, true));
  }
}

at::Tensor LayerImpl::forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                              std::pair<at::Tensor, at::Tensor>* cache, const at::Tensor& window,
                              const at::Tensor& documents) {
  if (pre_feedforward_layernorm) {  // Gemma: each branch's output normalised too
    x = x + post_attention_layernorm->forward(
                self_attn->forward(input_layernorm->forward(x), cos, sin, cache, window, documents));
    return x + post_feedforward_layernorm->forward(mlp->forward(pre_feedforward_layernorm->forward(x)));
  }
  x = x + self_attn->forward(input_layernorm->forward(x), cos, sin, cache, window, documents);
  return x + mlp->forward(post_attention_layernorm->forward(x));
}


BodyImpl::BodyImpl(const Config& c, const Build& b) {
  // made in its dtype; a fresh one initialised as transformers does, else the folder's values fill it
  const auto opts = at::TensorOptions().dtype(b.dtype);
  embed_tokens = register_module(
      "embed_tokens", torch::nn::Embedding(torch::nn::EmbeddingOptions(c.vocab, c.hidden)
                                               ._weight(b.deferral ? wick::hollow({c.vocab, c.hidden}, opts)
                                                                   : at::empty({c.vocab, c.hidden}, opts))));
  if (b.init) init_or_defer(embed_tokens->weight, c.init_range, b);
  layers = register_module("layers", torch::nn::ModuleList());
  for (std::int64_t i = 0; i < c.layers; ++i) layers->push_back(Layer(c, b, i));
  norm = register_module("norm", RMSNorm(c.hidden, c.eps, b.dtype, c.gemma));
}

wick::NamedTensorList read_folder(const fs::path& dir, const std::string& who) {
  return wick::read_safetensors_folder(dir, who);
}

void load_quantizing(torch::nn::Module& m, wick::NamedTensorList&& weights, const std::string& source,
                     const std::set<std::string>& ignore,
                     const std::vector<std::pair<std::string, wick::Linear>>& layers, std::int64_t block) {
  std::map<std::string, wick::Linear> quantized;  // "<layer>.weight" -> the layer
  if (block > 0)
    for (const auto& [name, lin] : layers) quantized.emplace(name + ".weight", lin);
  wick::load_state(m, std::move(weights), source, ignore, [&](const std::string& name, const at::Tensor& t) {
    auto it = quantized.find(name);
    if (it == quantized.end()) return false;
    it->second->quantize_nf4_from(t, at::kBFloat16, block);
    wick::release_free_heap();
    return true;
  });
}

void defer_loading(torch::nn::Module& m, wick::NamedTensorList&& weights, const std::string& source,
                   const std::set<std::string>& ignore, const std::vector<std::pair<std::string, wick::Linear>>& layers,
                   std::int64_t block, wick::Deferral& deferral) {
  std::map<std::string, wick::Linear> quantized;  // "<layer>.weight" -> the layer
  if (block > 0)
    for (const auto& [name, lin] : layers) quantized.emplace(name + ".weight", lin);
  // (the file's tensors emitted in its dtype: the host converts what it keeps, a rank its chunk)
  wick::defer_load_state(m, std::move(weights), source, ignore, deferral,
                         [quantized](const std::string& name, const at::Tensor& t, const wick::Emit& emit) {
                           auto q = quantized.find(name);
                           if (q == quantized.end()) return false;
                           q->second->emit_nf4_from(t, emit);
                           wick::release_free_heap();
                           return true;
                         });
  for (auto& [name, lin] : quantized) lin->hollow_nf4(at::kBFloat16, block);
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

wick::OptionSchema loss_options() {
  return {wick::opt_int("loss_chunk", wick::Value(),
                        "tokens per chunk of the output head and cross-entropy in training: each chunk's logits are "
                        "made, used and dropped, and made again in backward, so the [tokens, vocab] logits and their "
                        "gradient never exist whole (0: the whole logits at once, as transformers does; default: as "
                        "many tokens as keep a chunk's fp32 logits within 64 MiB, 32 to 1024)")
              .at_least(0)
              .optional()};
}

std::int64_t budget_loss_chunk(std::int64_t vocab) {
  return std::clamp<std::int64_t>(kLossChunkBytes / (std::max<std::int64_t>(vocab, 1) * 4), kLossChunkMin, kLossChunkMax);
}

namespace {

// The dtype the head's product runs in: autocast's for h's device when it is
// on (at::linear would be cast to it), else the weight's.
at::ScalarType head_dtype(const at::Tensor& h, const at::Tensor& w) {
  const auto type = h.device().type();
  if (at::isFloatingType(w.scalar_type()) && w.scalar_type() != at::kDouble && at::autocast::is_autocast_enabled(type))
    return at::autocast::get_autocast_dtype(type);
  return w.scalar_type();
}

// The rows [s, s + n) with at least one label that counts, as chunk starts.
std::vector<std::pair<std::int64_t, std::int64_t>> live_chunks(const at::Tensor& labels_cpu, std::int64_t chunk) {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  const auto N = labels_cpu.size(0);
  const auto* y = labels_cpu.data_ptr<std::int64_t>();
  for (std::int64_t s = 0; s < N; s += chunk) {
    const auto n = std::min(chunk, N - s);
    for (std::int64_t i = s; i < s + n; ++i)
      if (y[i] != kIgnore) {
        out.emplace_back(s, n);
        break;
      }
  }
  return out;
}

struct ChunkedHeadLoss : torch::autograd::Function<ChunkedHeadLoss> {
  // h [N, H], w [V, H], y [N] (int64, on h's device), y_cpu: the same on the CPU
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h,
                                                const at::Tensor& w, const at::Tensor& y, const at::Tensor& y_cpu,
                                                std::int64_t chunk, bool into_grad, double softcap) {
    const at::ScalarType dt = head_dtype(h, w);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // the casts are explicit
    const auto fopt = h.options().dtype(at::kFloat);
    at::Tensor loss = at::zeros({}, fopt), right = at::zeros({}, y.options());
    at::Tensor lse = at::zeros({h.size(0)}, fopt);  // log-sum-exp per row: backward's softmax without a second reduction
    const at::Tensor wc = w.to(dt);
    for (const auto& [s, n] : live_chunks(y_cpu, chunk)) {
      const at::Tensor yc = y.narrow(0, s, n), keep = yc.ne(kIgnore);
      at::Tensor logits = at::mm(h.narrow(0, s, n).to(dt), wc.t()).to(at::kFloat);
      if (softcap > 0) logits = at::tanh(logits / softcap) * softcap;
      const at::Tensor l = at::logsumexp(logits, {1});
      lse.narrow(0, s, n).copy_(l);
      const at::Tensor target = logits.gather(1, yc.masked_fill(keep.logical_not(), 0).unsqueeze(1)).squeeze(1);
      loss.add_(at::where(keep, l - target, at::zeros({}, fopt)).sum());
      right.add_(logits.argmax(1).eq(yc).logical_and(keep).sum());
    }
    ctx->save_for_backward({h, w, y, y_cpu, lse});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["into_grad"] = into_grad && w.is_leaf() && w.requires_grad();
    ctx->saved_data["dtype"] = static_cast<std::int64_t>(dt);
    ctx->mark_non_differentiable({right});
    return {loss, right};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &h = saved[0], &w = saved[1], &y = saved[2], &y_cpu = saved[3], &lse = saved[4];
    const auto chunk = ctx->saved_data["chunk"].toInt();
    const double softcap = ctx->saved_data["softcap"].toDouble();
    const auto dt = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const bool want_h = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    const bool into_grad = ctx->saved_data["into_grad"].toBool();
    if (!grads[0].defined() || (!want_h && !want_w))
      return {want_h ? at::zeros_like(h) : at::Tensor(), want_w && !into_grad ? at::zeros_like(w) : at::Tensor(),
              at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    at::Tensor gh = want_h ? at::zeros_like(h) : at::Tensor(), gw;
    if (want_w && into_grad) {
      // the tied weight's own gradient takes the head's part in place
      at::Tensor w_leaf = w;
      if (!w_leaf.grad().defined()) w_leaf.mutable_grad() = at::zeros_like(w_leaf, at::MemoryFormat::Contiguous);
      gw = w_leaf.grad();
    } else if (want_w) {
      gw = at::zeros_like(w);
    }
    const at::Tensor g = grads[0].to(at::kFloat);
    const at::Tensor wc = w.to(dt);
    for (const auto& [s, n] : live_chunks(y_cpu, chunk)) {
      const at::Tensor yc = y.narrow(0, s, n), drop = yc.eq(kIgnore).unsqueeze(1);
      const at::Tensor hc = h.narrow(0, s, n).to(dt);
      // d loss / d logits = (softmax - one_hot(label)) * g on the rows that count
      at::Tensor p = at::mm(hc, wc.t()).to(at::kFloat), t;
      if (softcap > 0) {  // logits cap * tanh(z / cap): d/dz = 1 - tanh^2
        t = p.div_(softcap).tanh_();
        p = t * softcap;
      }
      p.sub_(lse.narrow(0, s, n).unsqueeze(1)).exp_();
      p.scatter_add_(1, yc.masked_fill(drop.squeeze(1), 0).unsqueeze(1), drop.logical_not().to(at::kFloat).neg());
      p.mul_(g).masked_fill_(drop, 0);
      if (softcap > 0) p.mul_(t.square_().neg_().add_(1));
      const at::Tensor pc = p.to(dt);
      p = at::Tensor();
      if (want_h) gh.narrow(0, s, n).copy_(at::mm(pc, wc));
      if (want_w) {
        if (gw.scalar_type() == dt) gw.addmm_(pc.t(), hc);
        else gw.add_(at::mm(pc.t(), hc));
      }
    }
    return {gh, into_grad ? at::Tensor() : gw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::pair<at::Tensor, at::Tensor> chunked_head_loss(const at::Tensor& h, const at::Tensor& w, const at::Tensor& labels,
                                                    std::int64_t chunk, bool into_grad, double softcap) {
  if (chunk <= 0) throw wick::Error("chunked_head_loss: chunk " + std::to_string(chunk) + ", expected a positive count");
  const at::Tensor y = labels.to(at::kLong).contiguous();
  auto out = ChunkedHeadLoss::apply(h, w, y, y.cpu(), chunk, into_grad, softcap);
  return {out[0], out[1]};
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

Decoder::Decoder(const Config& c, std::string body_prefix, const Build& b) : c_(c), prefix_(std::move(body_prefix)) {
  body = Body(c_, b);
  if (!c_.tie) {
    lm_head = b.deferral ? wick::Linear(c_.hidden, c_.vocab, /*bias=*/false, b.dtype, wick::LinearImpl::Hollow{})
                         : wick::Linear(c_.hidden, c_.vocab, /*bias=*/false, b.dtype, /*init=*/false);
    if (b.init) init_or_defer(lm_head->weight, c_.init_range, b);
  }
  std::tie(inv_freq_, rope_scale_) = rope_frequencies(c_, c_.max_positions);
  original_inv_freq_ = inv_freq_;
  // transformers builds the lookup with padding_idx = pad_token_id (within the vocabulary)
  if (c_.token_ids.contains("pad_token_id") && c_.token_ids["pad_token_id"].is_number_integer()) {
    const auto pad = c_.token_ids["pad_token_id"].get<std::int64_t>();
    if (pad >= 0 && pad < c_.vocab) padding_idx_ = pad;
  }
  if (c_.rope_local_theta > 0) {  // Gemma 3's sliding layers: their base, no scaling
    Config local = c_;
    local.rope = RopeScaling{};
    local.rope_theta = c_.rope_local_theta;
    local_inv_freq_ = rope_frequencies(local, c_.max_positions).first;
  }
  rope_cached_ = c_.max_positions;
}

std::pair<at::Tensor, double> rope_frequencies(const Config& c, std::int64_t seq_len) {
  // fp32 throughout, as transformers computes them (python numbers where it uses them)
  const RopeScaling& r = c.rope;
  const std::int64_t dim = rotary_dim(c);  // Phi's partial rotation turns fewer features
  const at::Tensor exponents = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  const at::Tensor inv = 1.0 / at::pow(c.rope_theta, exponents);
  if (r.type == "default") return {inv, 1.0};
  if (r.type == "linear") return {inv / r.factor, 1.0};
  if (r.type == "dynamic") {
    // NTK-aware: a larger base once the sequence outgrows the context (seq_len a tensor there: fp32 arithmetic)
    const at::Tensor len = at::scalar_tensor(std::max(seq_len, c.max_positions), at::kLong);
    const at::Tensor base = c.rope_theta * (r.factor * len / static_cast<double>(c.max_positions) - (r.factor - 1))
                                               .pow(static_cast<double>(dim) / static_cast<double>(dim - 2));
    return {1.0 / at::pow(base, exponents), 1.0};
  }
  if (r.type == "llama3") {
    const double old_len = static_cast<double>(r.original_max);
    const double low_wavelen = old_len / r.low_freq_factor, high_wavelen = old_len / r.high_freq_factor;
    const at::Tensor wavelen = 2 * M_PI / inv;
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
    const at::Tensor smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
    const at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
    const at::Tensor medium = wavelen.ge(high_wavelen).logical_and(wavelen.le(low_wavelen));
    return {at::where(medium, smoothed, scaled), 1.0};
  }
  // yarn: interpolate the low frequencies, keep the high ones, ramp between
  auto mscale = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
  double attention = r.attention_factor;
  if (attention <= 0)
    attention = r.mscale > 0 && r.mscale_all_dim > 0 ? mscale(r.factor, r.mscale) / mscale(r.factor, r.mscale_all_dim)
                                                    : mscale(r.factor, 1.0);
  const at::Tensor pos_freqs = at::pow(c.rope_theta, exponents);
  const at::Tensor extrapolation = 1.0 / pos_freqs, interpolation = 1.0 / (r.factor * pos_freqs);
  auto correction_dim = [&](double rotations) {
    return (static_cast<double>(dim) * std::log(static_cast<double>(r.original_max) / (rotations * 2 * M_PI))) /
           (2 * std::log(c.rope_theta));
  };
  double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
  if (r.truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // no singularity
  const at::Tensor ramp = ((at::arange(dim / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
  const at::Tensor keep = 1 - ramp;  // the share of extrapolation
  return {interpolation * (1 - keep) + extrapolation * keep, attention};
}

void Decoder::register_with(torch::nn::Module& body_parent, const std::string& body_name, torch::nn::Module& owner) {
  body_parent.register_module(body_name, body);
  if (lm_head) owner.register_module("lm_head", lm_head);
}

at::Tensor document_mask(const at::Tensor& position_ids) {
  // a document starts where the position does not follow the one before (as
  // transformers' find_packed_sequence_indices reads position_ids)
  const auto B = position_ids.size(0), T = position_ids.size(1);
  at::Tensor starts = at::ones({B, T}, position_ids.options().dtype(at::kLong));
  if (T > 1) starts.narrow(1, 1, T - 1).copy_(position_ids.narrow(1, 1, T - 1).sub(position_ids.narrow(1, 0, T - 1)).ne(1));
  const at::Tensor doc = starts.cumsum(1);                                       // [B, T]: each token's document
  const at::Tensor same = doc.unsqueeze(2).eq(doc.unsqueeze(1));                 // [B, T, T]
  const at::Tensor causal = at::ones({T, T}, same.options()).tril();
  return same.logical_and(causal).unsqueeze(1);                                  // [B, 1, T, T]
}

at::Tensor Decoder::hidden(at::Tensor x, wick::Model* owner, Cache* cache, std::int64_t offset,
                           const at::Tensor& position_ids) {
  const auto T = x.size(1);
  const bool packed = position_ids.defined();
  if (packed && (cache || offset != 0))
    throw wick::Error("decoder: position_ids with a key/value cache are not supported");
  if (packed && (position_ids.dim() != 2 || position_ids.size(0) != x.size(0) || position_ids.size(1) != T)) {
    auto shape = [](at::IntArrayRef s) {
      std::string out = "[";
      for (std::size_t d = 0; d < s.size(); ++d) out += (d ? ", " : "") + std::to_string(s[d]);
      return out + "]";
    };
    throw wick::Error("decoder: position_ids of shape " + shape(position_ids.sizes()) + " beside tokens of shape " +
                      shape(x.sizes().slice(0, 2)) + ", expected the same [batch, tokens]");
  }
  if (c_.rope.type == "dynamic") {
    // transformers' dynamic update: grow past the cached length, back to the
    // original frequencies once a sequence fits the context again (the
    // longest position + 1 with position_ids, as transformers takes it)
    const std::int64_t seq = packed ? position_ids.max().item<std::int64_t>() + 1 : offset + T;
    if (seq > rope_cached_) {
      inv_freq_ = rope_frequencies(c_, seq).first;
      rope_cached_ = seq;
    } else if (seq < c_.max_positions && rope_cached_ > c_.max_positions) {
      inv_freq_ = original_inv_freq_;
      rope_cached_ = c_.max_positions;
    }
  }
  // positions [T] (offset, offset + 1, ...), or [B, 1, T] from position_ids: the tables then broadcast over heads
  const at::Tensor pos = packed ? position_ids.to(x.device(), at::kFloat).unsqueeze(1)
                                : at::arange(offset, offset + T, at::TensorOptions().dtype(at::kFloat).device(x.device()));
  auto tables = [&](const at::Tensor& inv, double scale) {
    const at::Tensor freqs = pos.unsqueeze(-1) * inv.to(x.device());
    const at::Tensor emb = at::cat({freqs, freqs}, -1);
    at::Tensor cos = emb.cos(), sin = emb.sin();
    if (scale != 1.0) cos = cos * scale, sin = sin * scale;
    return std::make_pair(cos.to(x.scalar_type()), sin.to(x.scalar_type()));
  };
  const auto [cos, sin] = tables(inv_freq_, rope_scale_);
  const auto [local_cos, local_sin] = local_inv_freq_.defined() ? tables(local_inv_freq_, 1.0) : std::make_pair(cos, sin);
  if (cache) cache->resize(body->layers->size());
  // the sliding layers' mask, once for all of them (undefined while every position fits the window)
  const at::Tensor window = sliding_window_mask(c_.sliding_window, T, offset + T, x.device());
  // packed documents: each token sees its own document's tokens up to it
  const at::Tensor documents = packed ? document_mask(position_ids.to(x.device())) : at::Tensor();
  std::size_t i = 0;
  for (const auto& layer : *body->layers) {
    auto* l = layer->as<Layer>();
    const bool local = l->self_attn->slides();
    const at::Tensor &c = local ? local_cos : cos, &s = local ? local_sin : sin;
    if (cache || !owner) {
      x = l->forward(x, c, s, cache ? &(*cache)[i] : nullptr, window, documents);
    } else {  // a declared block: checkpointed when the recipe asks
      x = owner->run_block(prefix_ + ".layers." + std::to_string(i),
                           [l, c, s, window, documents](const at::Tensor& h) {
                             return l->forward(h, c, s, nullptr, window, documents);
                           },
                           x);
    }
    ++i;
  }
  return body->norm->forward(x);
}

at::Tensor Decoder::embed(const at::Tensor& ids) {
  const at::Tensor& w = body->embed_tokens->weight;
  // tied: a sparse gradient (the looked-up rows), added in place into the
  // dense gradient the head made first; untied, the optimizers want it dense
  // (wick::lookup: the table may stay in host memory, offload_embeddings)
  at::Tensor e = wick::lookup(w, ids, padding_idx_, /*sparse=*/c_.tie && w.requires_grad() && loss_chunk_ != 0);
  // Gemma: times sqrt(hidden), rounded to the weight's dtype first as transformers does
  if (c_.gemma) e = e * at::scalar_tensor(std::sqrt(static_cast<double>(c_.hidden)), at::kFloat).to(w.scalar_type());
  return e;
}

at::Tensor Decoder::head(const at::Tensor& h) {
  at::Tensor out = c_.tie ? at::linear(h, body->embed_tokens->weight) : lm_head->forward(h);
  if (c_.final_softcap > 0) out = at::tanh(out / c_.final_softcap) * c_.final_softcap;  // Gemma 2
  return out;
}

wick::ForwardResult Decoder::loss(const at::Tensor& out, const at::Tensor& labels, std::int64_t items) {
  at::Tensor y = labels.narrow(1, 1, labels.size(1) - 1).reshape({-1});
  at::Tensor l = out.narrow(1, 0, out.size(1) - 1).reshape({-1, out.size(-1)}).to(at::kFloat);
  wick::ForwardResult r;
  r.loss_sum = at::cross_entropy_loss(l, y, {}, at::Reduction::Sum, kIgnore);
  r.items = items >= 0 ? items : y.ne(kIgnore).sum().item<std::int64_t>();
  r.metrics["accuracy"] = l.argmax(-1).eq(y).logical_and(y.ne(kIgnore)).sum();
  return r;
}

wick::ForwardResult Decoder::loss_from_hidden(const at::Tensor& h, const at::Tensor& labels,
                                              const at::Tensor& host_labels) {
  at::Tensor y = labels.narrow(1, 1, labels.size(1) - 1).reshape({-1});
  if (host_labels.defined() && (!host_labels.is_cpu() || host_labels.sizes() != labels.sizes()))
    throw std::logic_error("Decoder::loss_from_hidden: host_labels must be labels' values in host memory");
  // the labels' values on the host: given (copied early, EarlyHost), or read now (on a GPU: after the whole forward)
  const at::Tensor y_cpu =
      (host_labels.defined() ? host_labels.narrow(1, 1, labels.size(1) - 1).reshape({-1}) : y)
          .to(at::kCPU, at::kLong)
          .contiguous();
  // a label the head cannot score fails here, in words, before any kernel (a GPU would assert)
  const at::Tensor bad = y_cpu.ne(kIgnore).logical_and(y_cpu.lt(0).logical_or(y_cpu.ge(c_.vocab)));
  if (bad.any().item<bool>()) {
    const auto v = y_cpu.masked_select(bad)[0].item<std::int64_t>();
    throw wick::Error("labels: " + std::to_string(v) + " is outside the vocabulary of " + std::to_string(c_.vocab) +
                      ", expected -100 (ignored) or 0.." + std::to_string(c_.vocab - 1));
  }
  const at::Tensor live = y_cpu.ne(kIgnore);
  const std::int64_t items = live.sum().item<std::int64_t>();
  if (loss_chunk_ == 0) return loss(head(h), labels, items);
  const auto H = h.size(-1);
  at::Tensor x = h.narrow(1, 0, h.size(1) - 1).reshape({-1, H});
  if (items < y_cpu.size(0)) {
    // only the rows that carry a label reach the head: a prompt's or a
    // picture's positions (most of a VLM's sequence) cost no vocabulary product
    // (the row numbers reach a GPU from pinned memory, queued: no wait)
    at::Tensor rows = live.nonzero().reshape({-1});
    if (x.is_cuda()) rows = at::empty(rows.sizes(), rows.options().pinned_memory(true)).copy_(rows);
    rows = rows.to(x.device(), /*non_blocking=*/true);
    x = x.index_select(0, rows);
    y = y.index_select(0, rows.to(y.device()));
  }
  // tied: the embedding's lookup accumulates into the same weight after the head (Decoder::embed)
  auto [sum, right] = chunked_head_loss(x, head_weight(), y, loss_chunk(), /*into_grad=*/c_.tie, c_.final_softcap);
  wick::ForwardResult r;
  r.loss_sum = sum;
  r.items = items;
  r.metrics["accuracy"] = right;
  return r;
}

std::vector<std::int64_t> Decoder::generate_from_embeds(const at::Tensor& embeds, const wick::GenerateOptions& g,
                                                        const std::string& who,
                                                        const std::vector<std::int64_t>& prompt_ids) {
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
  // the tokens seen so far (prompt and generated), each once, for the repetition penalty
  std::vector<std::int64_t> seen;
  std::vector<bool> is_seen;
  const bool penalise = g.repetition_penalty != 1.0;
  auto see = [&](std::int64_t t) {
    if (!penalise || t < 0 || t >= c_.vocab) return;
    if (is_seen.empty()) is_seen.assign(static_cast<std::size_t>(c_.vocab), false);
    if (!is_seen[static_cast<std::size_t>(t)]) is_seen[static_cast<std::size_t>(t)] = true, seen.push_back(t);
  };
  for (auto t : prompt_ids) see(t);
  for (std::int64_t n = 0; n < g.max_new_tokens; ++n) {
    at::Tensor l = logits_from_embeds(x, nullptr, &cache, offset).select(1, -1).squeeze(0).to(at::kFloat).cpu();
    offset += x.size(1);
    if (penalise && !seen.empty()) {  // transformers' RepetitionPenaltyLogitsProcessor, in fp32
      const at::Tensor idx = at::tensor(seen, at::kLong);
      const at::Tensor v = l.index_select(0, idx);
      l = l.index_copy(0, idx, at::where(v < 0, v * g.repetition_penalty, v / g.repetition_penalty));
    }
    const std::int64_t next = pick_token(l, g, gen);
    out.push_back(next);
    see(next);
    if (g.on_token) g.on_token(next);
    if (next == g.eos_id || std::find(g.eos_ids.begin(), g.eos_ids.end(), next) != g.eos_ids.end()) break;
    if (g.stop && g.stop()) break;
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
  return generate_from_embeds(embed(at::tensor(prompt, at::kLong).unsqueeze(0).to(device())), g, who, prompt);
}

std::vector<std::string> Decoder::blocks() const {
  std::vector<std::string> out;
  for (std::int64_t i = 0; i < c_.layers; ++i) out.push_back(prefix_ + ".layers." + std::to_string(i));
  return out;
}

std::int64_t Decoder::nf4_layers() {
  std::int64_t n = 0;
  for (auto& [name, lin] : linear_layers()) n += lin->quantized() ? 1 : 0;
  return n;
}

void Decoder::check_nf4_training(const std::string& who, const std::string& freeze) {
  if (nf4_checked_ || !at::GradMode::is_enabled() || !body->is_training()) return;
  std::int64_t quantized = 0;
  for (auto& [name, lin] : linear_layers()) {
    if (lin->has_adapter()) quantized = -1;
    if (quantized >= 0 && lin->quantized()) ++quantized;
  }
  bool all_train = true;
  for (const auto& p : body->parameters()) all_train = all_train && p.requires_grad();
  if (lm_head)
    for (const auto& p : lm_head->parameters()) all_train = all_train && p.requires_grad();
  if (quantized > 0 && all_train)
    throw wick::Error(who + ": quantize = \"nf4\" keeps " + std::to_string(quantized) +
                      " linear layers in 4 bits, which do not train, and no LoRA adapters are on them: training would "
                      "change only the embeddings, norms and head; expected adapters (QLoRA: wick.optim(\"qlora\", "
                      "{...}):apply(model) before training), or a freeze of what should not train (" + freeze +
                      ") to train the rest alone");
  nf4_checked_ = true;
}

std::vector<std::pair<std::string, wick::Linear>> Decoder::linear_layers() {
  std::vector<std::pair<std::string, wick::Linear>> out;
  std::int64_t i = 0;
  for (const auto& m : *body->layers) {
    auto* layer = m->as<Layer>();
    const std::string p = prefix_ + ".layers." + std::to_string(i++) + ".";
    if (c_.fused) {
      out.emplace_back(p + "self_attn.qkv_proj", layer->self_attn->qkv_proj);
    } else {
      out.emplace_back(p + "self_attn.q_proj", layer->self_attn->q_proj);
      out.emplace_back(p + "self_attn.k_proj", layer->self_attn->k_proj);
      out.emplace_back(p + "self_attn.v_proj", layer->self_attn->v_proj);
    }
    out.emplace_back(p + "self_attn.o_proj", layer->self_attn->o_proj);
    if (c_.fused) {
      out.emplace_back(p + "mlp.gate_up_proj", layer->mlp->gate_up_proj);
    } else {
      out.emplace_back(p + "mlp.gate_proj", layer->mlp->gate_proj);
      out.emplace_back(p + "mlp.up_proj", layer->mlp->up_proj);
    }
    out.emplace_back(p + "mlp.down_proj", layer->mlp->down_proj);
  }
  return out;
}

std::set<std::string> Decoder::ignored_on_load() const {
  if (c_.tie) return {"lm_head.weight"};
  return {};
}

}  // namespace wick::decoder
