// The Vision Transformer shared by the vision plugins: see vit.hpp.

#include "lib/vision/vit.hpp"

#include <wick/kit/deferred_build.hpp>
#include <wick/kit/hf_dtype_names.hpp>
#include <wick/kit/json_fields.hpp>
#include <wick/kit/safetensors.hpp>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/init.h>
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>

namespace fs = std::filesystem;

namespace wick::vision {

namespace {

std::string str(std::int64_t v) { return std::to_string(v); }

const std::vector<std::string>& known_activations() {
  static const std::vector<std::string> a = {"gelu", "quick_gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu"};
  return a;
}

void check_sizes(const VitConfig& c, const std::string& where) {
  if (c.style != "vit" && c.style != "clip")
    throw Error(where + ": style '" + c.style + "' is not supported (expected vit or clip)");
  if (c.image_size < 1 || c.patch_size < 1 || c.image_size % c.patch_size)
    throw Error(where + ": image_size " + str(c.image_size) + " is not a multiple of patch_size " + str(c.patch_size));
  if (c.heads < 1 || c.hidden % c.heads)
    throw Error(where + ": hidden_size " + str(c.hidden) + " is not a multiple of " + str(c.heads) + " heads");
  if (c.layers < 0) throw Error(where + ": layers must be >= 0, got " + str(c.layers));
  if (c.pool != "cls" && c.pool != "mean")
    throw Error(where + ": pool '" + c.pool + "' is not supported (expected cls or mean)");
  check_activation(c.act, where);
}

// a fresh standalone module to hold children under a dotted path
std::shared_ptr<torch::nn::Module> container(torch::nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<torch::nn::Module>());
}

// normal(0, std), drawn in place (the part is still fp32: it is converted
// once made), as transformers' init.normal_; its ViT's trunc_normal_ cuts at
// +-2 absolute, which a std of 0.02 never reaches
void init_normal(at::Tensor t, double std) {
  at::NoGradGuard g;
  t.normal_(0.0, std);
}

void init_linear(wick::LinearImpl& l, double std) {
  at::NoGradGuard g;
  init_normal(l.weight, std);
  if (l.bias.defined()) l.bias.zero_();
}

}  // namespace

void check_activation(const std::string& act, const std::string& where) {
  for (const auto& a : known_activations())
    if (a == act) return;
  std::string known;
  for (const auto& a : known_activations()) known += (known.empty() ? "" : ", ") + a;
  throw Error(where + ": activation '" + act + "' is not supported (expected one of " + known + ")");
}

at::Tensor activation(const at::Tensor& x, const std::string& act) {
  if (act == "gelu") return at::gelu(x);
  if (act == "quick_gelu") return x * at::sigmoid(x * 1.702);
  if (act == "gelu_new" || act == "gelu_pytorch_tanh") return at::gelu(x, "tanh");
  if (act == "relu") return at::relu(x);
  if (act == "silu") return at::silu(x);
  throw Error("vision: activation '" + act + "' is not supported");
}

// ---- block ----

VitBlockImpl::VitBlockImpl(const VitConfig& c, at::ScalarType dtype, bool init) : c_(c) {
  const auto D = c.hidden, F = c.intermediate;
  const auto ln = [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({D}).eps(c.eps)); };
  // initialised in fp32 (the caller converts), or made in dtype for a folder's values, nothing drawn
  const auto linear = [&](std::int64_t in, std::int64_t out, bool bias) {
    return init ? wick::Linear(in, out, bias) : wick::Linear(in, out, bias, dtype, /*init=*/false);
  };
  q = linear(D, D, c.style == "clip" || c.qkv_bias);
  k = linear(D, D, c.style == "clip" || c.qkv_bias);
  v = linear(D, D, c.style == "clip" || c.qkv_bias);
  o = linear(D, D, true);
  fc1 = linear(D, F, true);
  fc2 = linear(F, D, true);
  ln1 = ln();
  ln2 = ln();
  if (c.style == "vit") {
    // ViTLayer's legacy names, the ones checkpoints on disk carry
    auto attention = container(*this, "attention");
    auto inner = attention->register_module("attention", std::make_shared<torch::nn::Module>());
    inner->register_module("query", q);
    inner->register_module("key", k);
    inner->register_module("value", v);
    attention->register_module("output", std::make_shared<torch::nn::Module>())->register_module("dense", o);
    container(*this, "intermediate")->register_module("dense", fc1);
    container(*this, "output")->register_module("dense", fc2);
    register_module("layernorm_before", ln1);
    register_module("layernorm_after", ln2);
    names_ = {{"attention.attention.query", q}, {"attention.attention.key", k}, {"attention.attention.value", v},
              {"attention.output.dense", o},    {"intermediate.dense", fc1},    {"output.dense", fc2}};
  } else {
    auto attn = container(*this, "self_attn");
    attn->register_module("q_proj", q);
    attn->register_module("k_proj", k);
    attn->register_module("v_proj", v);
    attn->register_module("out_proj", o);
    register_module("layer_norm1", ln1);
    auto mlp = container(*this, "mlp");
    mlp->register_module("fc1", fc1);
    mlp->register_module("fc2", fc2);
    register_module("layer_norm2", ln2);
    names_ = {{"self_attn.q_proj", q}, {"self_attn.k_proj", k}, {"self_attn.v_proj", v},
              {"self_attn.out_proj", o}, {"mlp.fc1", fc1},        {"mlp.fc2", fc2}};
  }
  if (!init) {
    convert_module(*this, dtype);  // (the norms)
  } else if (c.style == "vit") {
    for (auto* l : {q.get(), k.get(), v.get(), o.get(), fc1.get(), fc2.get()}) init_linear(*l, c.init_range);
  } else {  // CLIPAttention and CLIPMLP's scaled normals
    const double d = static_cast<double>(D), L = static_cast<double>(std::max<std::int64_t>(1, c.layers));
    const double in_proj = std::pow(d, -0.5) * std::pow(2.0 * L, -0.5) * c.init_factor;
    for (auto* l : {q.get(), k.get(), v.get()}) init_linear(*l, in_proj);
    init_linear(*o, std::pow(d, -0.5) * c.init_factor);
    init_linear(*fc1, std::pow(2.0 * d, -0.5) * c.init_factor);
    init_linear(*fc2, in_proj);
  }
}

at::Tensor VitBlockImpl::forward(const at::Tensor& x, const at::Tensor& mask, bool causal) {
  const auto N = x.size(0), L = x.size(1), H = c_.heads, hd = c_.hidden / c_.heads;
  at::Tensor h = ln1->forward(x);
  at::Tensor qs = q->forward(h).view({N, L, H, hd}).transpose(1, 2);
  at::Tensor ks = k->forward(h).view({N, L, H, hd}).transpose(1, 2);
  at::Tensor vs = v->forward(h).view({N, L, H, hd}).transpose(1, 2);
  // one dtype for the product (under autocast the projections may differ from x)
  ks = ks.to(qs.scalar_type());
  vs = vs.to(qs.scalar_type());
  at::Tensor y;
  if (mask.defined()) {
    at::Tensor allowed = mask.to(at::kBool);
    if (causal) allowed = allowed.logical_and(at::ones({L, L}, allowed.options()).tril());
    // additive, with the dtype's lowest value as Hugging Face does: a row
    // with no allowed key attends uniformly instead of giving NaN
    // (a half-precision product, under autocast: -65000, finite in fp16 and bf16;
    // fp32's lowest overflows bf16 and is refused)
    const double lowest = qs.scalar_type() == at::kFloat ? std::numeric_limits<float>::lowest() : -65000.0;
    at::Tensor bias = at::zeros(allowed.sizes(), qs.options()).masked_fill(allowed.logical_not(), lowest);
    y = at::scaled_dot_product_attention(qs, ks, vs, bias, 0.0, false);
  } else {
    y = at::scaled_dot_product_attention(qs, ks, vs, {}, 0.0, causal);
  }
  y = o->forward(y.transpose(1, 2).reshape({N, L, c_.hidden}));
  at::Tensor r = x + y.to(x.scalar_type());
  at::Tensor m = fc2->forward(activation(fc1->forward(ln2->forward(r)), c_.act));
  return r + m.to(r.scalar_type());
}

std::vector<std::pair<std::string, wick::Linear>> VitBlockImpl::linear_layers() const { return names_; }

// ---- encoder ----

void convert_module(torch::nn::Module& m, at::ScalarType dtype) {
  if (dtype == at::kFloat) return;
  at::NoGradGuard g;
  for (auto& p : m.parameters())
    if (p.is_floating_point() && p.scalar_type() != dtype) p.set_data(p.to(dtype));
  for (auto& b : m.buffers())
    if (b.is_floating_point() && b.scalar_type() != dtype) b.set_data(b.to(dtype));
}

namespace {

// The embeddings as a whole build makes them (their draws in this order),
// in dtype: style vit: cls_token, position_embeddings,
// patch_embeddings.projection; style clip: class_embedding, patch_embedding,
// position_embedding.
std::shared_ptr<torch::nn::Module> make_embeddings(const VitConfig& c, at::ScalarType dtype) {
  const auto D = c.hidden, p = c.patch_size;
  const auto P = (c.image_size / p) * (c.image_size / p);
  auto e = std::make_shared<torch::nn::Module>();
  at::NoGradGuard g;
  if (c.style == "vit") {
    auto cls = e->register_parameter("cls_token", at::zeros({1, 1, D}));
    auto pos = e->register_parameter("position_embeddings", at::zeros({1, P + 1, D}));
    auto patch = container(*e, "patch_embeddings")
                     ->register_module("projection", torch::nn::Conv2d(torch::nn::Conv2dOptions(c.channels, D, p).stride(p)));
    init_normal(cls, c.init_range);
    init_normal(pos, c.init_range);
    init_normal(patch->weight, c.init_range);
    patch->bias.zero_();
  } else {
    auto cls = e->register_parameter("class_embedding", at::zeros({D}));
    auto patch = e->register_module("patch_embedding",
                                    torch::nn::Conv2d(torch::nn::Conv2dOptions(c.channels, D, p).stride(p).bias(false)));
    auto table = e->register_module("position_embedding", torch::nn::Embedding(P + 1, D));
    init_normal(cls, std::pow(static_cast<double>(D), -0.5) * c.init_factor);
    init_normal(table->weight, c.init_range * c.init_factor);
    init_normal(patch->weight, c.init_range * c.init_factor);
  }
  convert_module(*e, dtype);
  return e;
}

}  // namespace

VitImpl::VitImpl(VitConfig c, at::ScalarType dtype, wick::Deferral* deferral, bool init) : c_(std::move(c)) {
  check_sizes(c_, "vit");
  // a folder's values: the torch layers' own draws (the embeddings', the pooler's) undone
  std::optional<wick::GeneratorKept> kept;
  if (!init) kept.emplace();
  const VitConfig cfg = c_;  // (what each deferred step makes its part from)
  const auto D = c_.hidden;
  auto ln = [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({D}).eps(c_.eps)); };
  // each part made and converted before the next (a deferred one made, then hollowed)
  auto embeddings =
      register_module("embeddings", wick::deferred_part(deferral, [cfg, dtype] { return make_embeddings(cfg, dtype); }, init));
  auto encoder = container(*this, "encoder");
  auto list = encoder->register_module(c_.style == "vit" ? "layer" : "layers", torch::nn::ModuleList());
  at::NoGradGuard g;
  auto child = [](torch::nn::Module& m, const std::string& path) {
    return m.named_modules("", /*include_self=*/false)[path];
  };
  if (c_.style == "vit") {
    cls_ = embeddings->named_parameters(false)["cls_token"];
    pos_ = embeddings->named_parameters(false)["position_embeddings"];
    patch_ = torch::nn::Conv2d(std::dynamic_pointer_cast<torch::nn::Conv2dImpl>(child(*embeddings, "patch_embeddings.projection")));
  } else {
    cls_ = embeddings->named_parameters(false)["class_embedding"];
    pos_ = embeddings->named_parameters()["position_embedding.weight"];
    patch_ = torch::nn::Conv2d(std::dynamic_pointer_cast<torch::nn::Conv2dImpl>(child(*embeddings, "patch_embedding")));
    pre_ = register_module("pre_layrnorm", ln());
    convert_module(*pre_, dtype);
  }
  for (std::int64_t i = 0; i < c_.layers; ++i) {
    blocks_.push_back(wick::deferred_part(
        deferral,
        [cfg, dtype, init] {
          VitBlock b(cfg, dtype, init);
          convert_module(*b, dtype);  // before the next block is made
          return b;
        },
        init));
    list->push_back(blocks_.back());
  }
  if (c_.style == "vit") {
    final_ = register_module("layernorm", ln());
    if (c_.pooler)
      pooler_ = container(*this, "pooler")
                    ->register_module("dense", wick::deferred_part(
                                                   deferral,
                                                   [cfg, dtype] {
                                                     torch::nn::Linear l(cfg.hidden, cfg.hidden);
                                                     at::NoGradGuard ng;
                                                     init_normal(l->weight, cfg.init_range);
                                                     l->bias.zero_();
                                                     convert_module(*l, dtype);
                                                     return l;
                                                   },
                                                   init));
  } else {
    final_ = register_module("post_layernorm", ln());
  }
  convert_module(*final_, dtype);
}

at::Tensor VitImpl::forward(const at::Tensor& pixels, wick::Model* owner, const std::string& prefix, int layer) {
  if (pixels.dim() != 4 || pixels.size(1) != c_.channels)
    throw Error("vit: expected images [N, " + str(c_.channels) + ", H, W], got " + c10::str(pixels.sizes()));
  const auto H = pixels.size(2), W = pixels.size(3), p = c_.patch_size;
  if (!c_.interpolate && (H != c_.image_size || W != c_.image_size))
    throw Error("vit: images are " + str(H) + "x" + str(W) + ", the encoder expects " + str(c_.image_size) + "x" +
                str(c_.image_size) + " (set the data's image_size to " + str(c_.image_size) +
                ", or interpolate_pos_encoding = true to interpolate its position embeddings)");
  if (H < p || W < p)
    throw Error("vit: images are " + str(H) + "x" + str(W) + ", smaller than one patch of " + str(p) + "x" + str(p));
  const std::int64_t L = c_.layers;
  const std::int64_t n = layer >= 0 ? layer + 1 : L + layer + 1;
  if (n < 0 || n > L)
    throw Error("vit: layer " + std::to_string(layer) + " is outside the encoder's " + str(L) +
                " blocks (expected -" + str(L + 1) + " .. " + str(L - 1) + ")");
  const auto N = pixels.size(0), D = c_.hidden;
  at::Tensor x = pixels.is_floating_point() ? pixels.to(patch_->weight.scalar_type()) : pixels.to(at::kFloat);
  x = patch_->forward(x).flatten(2).transpose(1, 2);  // [N, P, D]
  at::Tensor cls = (c_.style == "vit" ? cls_ : cls_.view({1, 1, D})).expand({N, 1, D}).to(x.scalar_type());
  // positions() takes the patch count, x's before the class token joins it
  // (it was given one less, so every forward resized the table to its own
  // size: a bicubic pass and a float copy each time, 12.5 ms of seed 001's
  // 100 ms GPU step at 2 layers)
  const auto patches = x.size(1);
  x = at::cat({cls, x}, 1) + positions(H, W, patches);
  if (pre_) x = pre_->forward(x);
  const auto names = block_names(prefix);
  for (std::int64_t i = 0; i < n; ++i) {
    VitBlock b = blocks_[static_cast<std::size_t>(i)];
    auto fn = [b](const at::Tensor& h) mutable { return b->forward(h); };
    x = owner ? owner->run_block(names[static_cast<std::size_t>(i)], fn, x) : fn(x);
  }
  if (c_.style == "vit" && n == L) x = final_->forward(x);
  return x;
}

at::Tensor VitImpl::positions(std::int64_t H, std::int64_t W, std::int64_t patches) {
  const auto D = c_.hidden, P = num_patches();
  const at::Tensor pos = pos_.view({1, -1, D});
  if (patches == P && H == W) return pos;
  // transformers' interpolate_pos_encoding: the class position as it is, the
  // patch grid bicubically resized (align_corners false) to the image's
  const auto g = static_cast<std::int64_t>(std::sqrt(static_cast<double>(P)));
  at::Tensor grid = pos.narrow(1, 1, P).reshape({1, g, g, D}).permute({0, 3, 1, 2});
  grid = at::upsample_bicubic2d(grid, {H / c_.patch_size, W / c_.patch_size}, /*align_corners=*/false);
  grid = grid.permute({0, 2, 3, 1}).reshape({1, -1, D});
  return at::cat({pos.narrow(1, 0, 1), grid}, 1);
}

at::Tensor VitImpl::pool(const at::Tensor& tokens) {
  if (c_.pool == "mean") return tokens.narrow(1, 1, tokens.size(1) - 1).mean(1);
  at::Tensor first = tokens.select(1, 0);
  if (c_.style == "clip") return final_->forward(first);
  if (pooler_) return at::tanh(pooler_->forward(first));
  return first;
}

std::vector<std::string> VitImpl::block_names(const std::string& prefix) const {
  std::string p = prefix;
  if (!p.empty() && p.back() != '.') p += '.';
  p += c_.style == "vit" ? "encoder.layer." : "encoder.layers.";
  std::vector<std::string> out;
  for (std::int64_t i = 0; i < c_.layers; ++i) out.push_back(p + str(i));
  return out;
}

std::vector<std::pair<std::string, wick::Linear>> VitImpl::linear_layers(const std::string& prefix) const {
  std::vector<std::pair<std::string, wick::Linear>> out;
  const auto names = block_names(prefix);
  for (std::size_t i = 0; i < blocks_.size(); ++i)
    for (const auto& [n, l] : blocks_[i]->linear_layers()) out.emplace_back(names[i] + "." + n, l);
  return out;
}

nlohmann::json VitImpl::hf_config() const {
  nlohmann::json j = {{"hidden_size", c_.hidden},
                      {"intermediate_size", c_.intermediate},
                      {"num_hidden_layers", c_.layers},
                      {"num_attention_heads", c_.heads},
                      {"image_size", c_.image_size},
                      {"patch_size", c_.patch_size},
                      {"num_channels", c_.channels},
                      {"layer_norm_eps", c_.eps},
                      {"hidden_act", c_.act},
                      {"initializer_range", c_.init_range}};
  if (c_.style == "clip") j["initializer_factor"] = c_.init_factor;
  if (c_.style == "vit") {
    j["model_type"] = "vit";
    j["qkv_bias"] = c_.qkv_bias;
    j["hidden_dropout_prob"] = 0.0;
    j["attention_probs_dropout_prob"] = 0.0;
  } else {
    j["model_type"] = "clip_vision_model";
  }
  return j;
}

// ---- configs and options ----

void check_saved_dtype(const wick::JsonFields& j) {
  for (const char* key : {"dtype", "torch_dtype"}) {
    if (!j.has(key)) continue;
    const std::string d = j.string(key);
    if (wick::dtype_of_hf_name(d).empty())
      j.bad(key, "float32, bfloat16 or float16 (the dtypes wick loads weights in)");
  }
}

VitConfig config_from_hf(const nlohmann::json& config, const std::string& where) {
  const wick::JsonFields top(config, where);
  const bool nested = top.has("vision_config") && config["vision_config"].is_object();
  const wick::JsonFields j = nested ? top.object("vision_config") : top;
  check_saved_dtype(top);
  if (nested) check_saved_dtype(j);
  std::string type = j.string("model_type", "");
  if (type.empty() && nested) type = "clip_vision_model";  // a nested vision_config without its type
  VitConfig c;
  if (type == "vit") {
    c.style = "vit";
    c.image_size = 224, c.patch_size = 16, c.hidden = 768, c.intermediate = 3072, c.layers = 12, c.heads = 12;
    c.eps = 1e-12, c.act = "gelu";
  } else if (type == "clip_vision_model" || type == "clip") {
    c.style = "clip";
    c.image_size = 224, c.patch_size = 32, c.hidden = 768, c.intermediate = 3072, c.layers = 12, c.heads = 12;
    c.eps = 1e-5, c.act = "quick_gelu";
  } else {
    throw Error(where + ": model_type '" + type + "' is not a vision transformer wick reads (expected vit, clip or " +
                "clip_vision_model, or a config with a vision_config)");
  }
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  c.image_size = j.integer("image_size", c.image_size, 1, kMax);
  c.patch_size = j.integer("patch_size", c.patch_size, 1, kMax);
  c.channels = j.integer("num_channels", c.channels, 1, kMax);
  c.hidden = j.integer("hidden_size", c.hidden, 1, kMax);
  c.intermediate = j.integer("intermediate_size", c.intermediate, 1, kMax);
  c.layers = j.integer("num_hidden_layers", c.layers, 0, kMax);
  c.heads = j.integer("num_attention_heads", c.heads, 1, kMax);
  c.eps = j.number("layer_norm_eps", c.eps, 0);
  c.act = j.string("hidden_act", c.act);
  c.init_range = j.number("initializer_range", c.init_range, 0);
  if (c.style == "clip") c.init_factor = j.number("initializer_factor", c.init_factor, 0);
  if (c.style == "vit") {
    c.qkv_bias = j.flag("qkv_bias", true);
    if (j.string("pooler_act", "tanh") != "tanh") j.bad("pooler_act", "tanh");
    if (j.integer("pooler_output_size", c.hidden, 1, kMax) != c.hidden)
      j.bad("pooler_output_size", "hidden_size (" + str(c.hidden) + "; another size is not supported)");
  }
  check_sizes(c, where);
  return c;
}

std::vector<wick::OptionSpec> vit_options() {
  return {
      wick::opt_string("style", "vit", "parameter names and details: vit (ViTModel) or clip (CLIP's vision tower)")
          .one_of({"vit", "clip"}),
      wick::opt_int("image_size", 224, "input image side, pixels").at_least(1),
      wick::opt_int("patch_size", 16, "patch side, pixels").at_least(1),
      wick::opt_int("hidden_size", 192, "encoder width").at_least(1),
      wick::opt_int("intermediate_size", 768, "MLP width").at_least(1),
      wick::opt_int("layers", 12, "encoder blocks").at_least(0),
      wick::opt_int("heads", 3, "attention heads").at_least(1),
      wick::opt_number("layer_norm_eps", wick::Value(), "LayerNorm epsilon (default: 1e-12 for vit, 1e-5 for clip)")
          .at_least(0)
          .optional(),
      wick::opt_string("act", wick::Value(), "MLP activation (default: gelu for vit, quick_gelu for clip)")
          .one_of(known_activations())
          .optional(),
      wick::opt_string("pool", "cls", "image features: cls (the class token; clip: post_layernorm of it) or mean (of the patch tokens)")
          .one_of({"cls", "mean"}),
      wick::opt_bool("interpolate_pos_encoding", false,
                     "take images of another size than image_size: the patch position embeddings bicubically "
                     "interpolated to the image's patch grid (transformers' interpolate_pos_encoding)"),
      wick::opt(std::string("image_mean"), wick::OptionType::NumberList, wick::Value(),
                "per-channel mean of the 0..1 pixels (default: 0.5 for vit, CLIP's for clip)")
          .optional(),
      wick::opt(std::string("image_std"), wick::OptionType::NumberList, wick::Value(),
                "per-channel std of the 0..1 pixels (default: 0.5 for vit, CLIP's for clip)")
          .at_least(1e-12)
          .optional(),
  };
}

std::string vit_option_key(const std::string& name, const std::string& prefix) {
  const bool shared = name == "image_size" || name == "patch_size" || name == "interpolate_pos_encoding";
  return shared ? name : prefix + name;
}

wick::OptionSpec vit_option_as(const std::string& name, const std::string& prefix, wick::Value def, std::string doc) {
  for (wick::OptionSpec spec : vit_options()) {
    if (spec.name != name) continue;
    spec.name = vit_option_key(name, prefix);
    spec.default_value = std::move(def);
    spec.doc = std::move(doc);
    auto d = std::find(spec.choices.begin(), spec.choices.end(), spec.default_value.is_string() ? spec.default_value.as_string() : "");
    if (d != spec.choices.end()) std::rotate(spec.choices.begin(), d, d + 1);
    return spec;
  }
  throw Error("vit_option_as: vit_options() declares no option " + name);
}

VitConfig config_from_options(const wick::Options& o, const std::string& prefix) {
  auto key = [&](const char* name) { return vit_option_key(name, prefix); };
  VitConfig c;
  c.style = o.get_string(key("style"));
  c.image_size = o.get_int(key("image_size"));
  c.patch_size = o.get_int(key("patch_size"));
  c.hidden = o.get_int(key("hidden_size"));
  c.intermediate = o.get_int(key("intermediate_size"));
  c.layers = o.get_int(key("layers"));
  c.heads = o.get_int(key("heads"));
  c.eps = o.has(key("layer_norm_eps")) ? o.get_number(key("layer_norm_eps")) : (c.style == "clip" ? 1e-5 : 1e-12);
  c.act = o.has(key("act")) ? o.get_string(key("act")) : (c.style == "clip" ? "quick_gelu" : "gelu");
  if (o.has(key("pool"))) c.pool = o.get_string(key("pool"));
  if (o.has(key("interpolate_pos_encoding"))) c.interpolate = o.get_bool(key("interpolate_pos_encoding"));
  check_sizes(c, "vit options");
  return c;
}

PixelStats default_pixel_stats(const std::string& style) {
  if (style == "clip") return {{0.48145466, 0.4578275, 0.40821073}, {0.26862954, 0.26130258, 0.27577711}};
  return {{0.5, 0.5, 0.5}, {0.5, 0.5, 0.5}};
}

PixelStats pixel_stats_from_options(const wick::Options& o, const std::string& style, const std::string& who) {
  PixelStats s = default_pixel_stats(style);
  if (o.has("image_mean")) s.mean = o.get_number_list("image_mean");
  if (o.has("image_std")) s.std = o.get_number_list("image_std");
  if (s.mean.size() != 3 || s.std.size() != 3)
    throw Error(who + ": image_mean and image_std need 3 numbers each (one per channel), got " +
                std::to_string(s.mean.size()) + " and " + std::to_string(s.std.size()));
  return s;
}

PixelStats pixel_stats_from_folder(const std::string& dir, const PixelStats& fallback) {
  const fs::path p = fs::path(dir) / "preprocessor_config.json";
  if (!fs::exists(p)) return fallback;
  const nlohmann::json j = read_json_file(p.string());
  PixelStats s = fallback;
  const wick::JsonFields f(j, p.string());
  // a list of 3 numbers (one per channel), std above 0; anything else is named, never skipped
  auto three = [&](const char* key, std::vector<double>& out, bool positive) {
    if (!f.has(key)) return;
    const auto& v = *f.find(key);
    const char* want = positive ? "a list of 3 numbers above 0 (one per channel)" : "a list of 3 numbers (one per channel)";
    if (!v.is_array() || v.size() != 3) f.bad(key, want);
    std::vector<double> xs;
    for (const auto& x : v) {
      if (!x.is_number() || !std::isfinite(x.get<double>()) || (positive && !(x.get<double>() > 0))) f.bad(key, want);
      xs.push_back(x.get<double>());
    }
    out = xs;
  };
  three("image_mean", s.mean, false);
  three("image_std", s.std, true);
  return s;
}

at::Tensor normalize_pixels(const at::Tensor& images, const std::vector<double>& mean, const std::vector<double>& std,
                            at::ScalarType dtype) {
  if (images.dim() < 3) throw Error("vision: expected images [..., 3, H, W], got " + c10::str(images.sizes()));
  if (images.is_floating_point()) return images.to(dtype);
  const auto C = images.size(-3);
  if (static_cast<std::int64_t>(mean.size()) != C || static_cast<std::int64_t>(std.size()) != C)
    throw Error("vision: images have " + str(C) + " channels, the normalisation statistics " + str(mean.size()));
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(images.device());
  at::Tensor m = at::tensor(mean, at::kDouble).to(opts).view({C, 1, 1});
  at::Tensor s = at::tensor(std, at::kDouble).to(opts).view({C, 1, 1});
  // (x / 255 - mean) / std as one multiply-add
  return (images.to(at::kFloat) * (1.0 / 255.0) - m).div(s).to(dtype);
}

// ---- folders ----

nlohmann::json read_json_file(const std::string& file) { return wick::read_json_file(file); }

wick::NamedTensorList read_hf_weights(const std::string& dir, const std::string& who) {
  return wick::read_safetensors_folder(dir, who);
}

std::string find_vit_prefix(const wick::NamedTensorList& tensors, const std::string& style, const std::string& source) {
  // the patch embedding, in the legacy and the transformers 5 names
  const std::vector<std::string> marks = style == "vit"
                                             ? std::vector<std::string>{"embeddings.patch_embeddings.projection.weight"}
                                             : std::vector<std::string>{"embeddings.patch_embedding.weight"};
  std::vector<std::string> found;
  for (const auto& [name, t] : tensors)
    for (const auto& m : marks)
      if (name.size() >= m.size() && name.compare(name.size() - m.size(), m.size(), m) == 0) {
        const std::string p = name.substr(0, name.size() - m.size());
        if (p.empty() || p.back() == '.') found.push_back(p);
      }
  if (found.empty())
    throw Error("weights in " + source + " hold no " + (style == "vit" ? "ViT" : "CLIP vision") +
                " encoder (no tensor named ...." + marks[0] + ")");
  if (found.size() > 1) {
    std::string list;
    for (const auto& f : found) list += (list.empty() ? "'" : ", '") + f + "'";
    throw Error("weights in " + source + " hold several vision encoders (under " + list + "); expected one");
  }
  return found[0];
}

bool has_vit_pooler(const wick::NamedTensorList& tensors, const std::string& prefix) {
  const std::string want = prefix + "pooler.dense.weight";
  for (const auto& [name, t] : tensors)
    if (name == want) return true;
  return false;
}

namespace {

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }

void replace_once(std::string& s, const std::string& from, const std::string& to) {
  const auto at = s.find(from);
  if (at != std::string::npos) s.replace(at, from.size(), to);
}

// transformers 5's own ViT names (layers.N.attention.q_proj, ...) to the legacy ones
std::string legacy_vit_name(std::string n) {
  if (!starts_with(n, "layers.")) return n;
  n = "encoder.layer." + n.substr(7);
  replace_once(n, ".attention.q_proj.", ".attention.attention.query.");
  replace_once(n, ".attention.k_proj.", ".attention.attention.key.");
  replace_once(n, ".attention.v_proj.", ".attention.attention.value.");
  replace_once(n, ".attention.o_proj.", ".attention.output.dense.");
  replace_once(n, ".mlp.fc1.", ".intermediate.dense.");
  replace_once(n, ".mlp.fc2.", ".output.dense.");
  return n;
}

}  // namespace

namespace {

// The encoder's tensors of a file (named as in the encoder) and the names the
// encoder may leave out of them.
std::pair<wick::NamedTensorList, std::set<std::string>> vit_tensors(const VitImpl& vit, wick::NamedTensorList&& tensors,
                                                                     const std::string& prefix) {
  static const std::vector<std::string> parts = {"embeddings.", "encoder.",       "layers.",       "layernorm.",
                                                 "pooler.",     "pre_layrnorm.", "post_layernorm."};
  wick::NamedTensorList mine;
  std::set<std::string> ignore = {"embeddings.position_ids"};  // a non-persistent buffer older files carry
  for (auto& [name, t] : tensors) {
    if (!starts_with(name, prefix)) continue;
    std::string n = name.substr(prefix.size());
    bool ours = false;
    for (const auto& p : parts) ours = ours || starts_with(n, p);
    if (!ours) continue;
    if (vit.config().style == "vit") n = legacy_vit_name(n);
    if (!vit.config().pooler && starts_with(n, "pooler.")) ignore.insert(n);
    mine.emplace_back(n, std::move(t));
  }
  tensors.clear();  // (the rest of a file's views: their pages go)
  // layers beyond the encoder's (a tower built shorter than the file's) are not an error
  for (const auto& [n, t] : mine)
    for (const std::string p : {"encoder.layer.", "encoder.layers."})
      if (starts_with(n, p) && std::strtoll(n.c_str() + p.size(), nullptr, 10) >= vit.config().layers) ignore.insert(n);
  return {std::move(mine), std::move(ignore)};
}

std::string vit_source(const std::string& source, const std::string& prefix) {
  return prefix.empty() ? source : source + " (under '" + prefix + "')";
}

}  // namespace

void load_vit_weights(VitImpl& vit, wick::NamedTensorList tensors, const std::string& prefix,
                      const std::string& source) {
  auto [mine, ignore] = vit_tensors(vit, std::move(tensors), prefix);
  // each view dropped as it lands: a mapped file's pages go with it
  wick::load_state(vit, std::move(mine), vit_source(source, prefix), ignore);
}

void defer_vit_weights(VitImpl& vit, wick::NamedTensorList tensors, const std::string& prefix,
                       const std::string& source, wick::Deferral& deferral) {
  auto [mine, ignore] = vit_tensors(vit, std::move(tensors), prefix);
  wick::defer_load_state(vit, std::move(mine), vit_source(source, prefix), ignore, deferral);
}

Vit vit_from_folder(const std::string& dir, const std::string& who, const std::string& pool, at::ScalarType dtype,
                    wick::Deferral* deferral) {
  const std::string cfg_file = (fs::path(dir) / "config.json").string();
  if (!fs::exists(cfg_file)) throw Error(who + ": " + dir + " has no config.json (expected a Hugging Face model folder)");
  VitConfig c = config_from_hf(read_json_file(cfg_file), cfg_file);
  if (!pool.empty()) c.pool = pool;
  auto tensors = read_hf_weights(dir, who);
  const std::string prefix = find_vit_prefix(tensors, c.style, dir);
  c.pooler = c.style == "vit" && has_vit_pooler(tensors, prefix);
  Vit vit(c, dtype, deferral, /*init=*/false);
  if (deferral)
    defer_vit_weights(*vit, std::move(tensors), prefix, dir, *deferral);
  else
    load_vit_weights(*vit, std::move(tensors), prefix, dir);
  return vit;
}

}  // namespace wick::vision
