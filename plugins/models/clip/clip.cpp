// model `clip`: CLIP, an image encoder and a text encoder with projections
// into one space and a learnable temperature, trained with the symmetric
// contrastive loss. Hugging Face CLIPModel's names (vision_model.*,
// text_model.*, visual_projection, text_projection, logit_scale), so a folder
// saved by `transformers` loads unchanged and wick's weights load back.
//
// Batches: `image` [N, 3, H, W] (uint8, normalised on the device, or floating
// pixels already normalised), `input_ids` [N, L] int64 with an end-of-text
// token in every row, optional `attention_mask` [N, L] (1 = real token).
// Items are image-text pairs.
//
// The loss couples the samples: every other pair in the batch is a negative.
// accumulation = "exact" (default) makes the host compute it over the whole
// window (all micro-batches, all ranks) in two passes (GradCache): embed()
// gives each micro-batch's normalised embeddings, window_loss() the loss over
// their concatenation, so (micro 8, accumulate 8) equals (micro 64,
// accumulate 1). accumulation = "plain" takes each micro-batch's own loss
// (fewer negatives: a different, usually worse, objective).

#include <wick/kit/deferred_build.hpp>
#include <wick/kit/linear.hpp>
#include <wick/model.hpp>
#include <wick/kit/weights.hpp>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <wick/kit/json_fields.hpp>
#include <torch/nn/modules/container/modulelist.h>

#include <filesystem>
#include <limits>
#include <optional>
#include <set>

#include "lib/vision/plugin_util.hpp"
#include "lib/vision/vit.hpp"

namespace fs = std::filesystem;
using namespace wick::vision;

namespace {

struct TextConfig {
  std::int64_t vocab = 258, hidden = 128, intermediate = 512, layers = 4, heads = 4, max_len = 77;
  std::int64_t eos = 256, bos = -1, pad = -1;
  double eps = 1e-5, init_factor = 1.0;
  std::string act = "quick_gelu";
};

class TextModelImpl : public torch::nn::Module {
 public:
  /// Built in `dtype` part by part, as vision::VitImpl, for a folder's
  /// values as it is (`init` false: nothing drawn) and deferred as it is
  /// (`deferral`): the embeddings and each block made, then hollowed, the
  /// final norm whole.
  TextModelImpl(const TextConfig& c, at::ScalarType dtype, wick::Deferral* deferral = nullptr, bool init = true)
      : c_(c) {
    std::optional<wick::GeneratorKept> kept;  // a folder's values: the embeddings' own draws undone
    if (!init) kept.emplace();
    auto emb = register_module("embeddings", wick::deferred_part(
                                                 deferral,
                                                 [c, dtype] {
                                                   auto e = std::make_shared<torch::nn::Module>();
                                                   auto token = e->register_module(
                                                       "token_embedding", torch::nn::Embedding(c.vocab, c.hidden));
                                                   auto position = e->register_module(
                                                       "position_embedding", torch::nn::Embedding(c.max_len, c.hidden));
                                                   at::NoGradGuard g;  // CLIPTextEmbeddings, as transformers' _init_weights
                                                   token->weight.normal_(0, 0.02 * c.init_factor);
                                                   position->weight.normal_(0, 0.02 * c.init_factor);
                                                   convert_module(*e, dtype);
                                                   return e;
                                                 },
                                                 init));
    auto child = [&emb](const char* name) {
      return torch::nn::Embedding(std::dynamic_pointer_cast<torch::nn::EmbeddingImpl>(emb->named_children()[name]));
    };
    token_ = child("token_embedding");
    position_ = child("position_embedding");
    VitConfig bc;
    bc.style = "clip";
    bc.hidden = c.hidden, bc.intermediate = c.intermediate, bc.heads = c.heads, bc.eps = c.eps, bc.act = c.act;
    bc.layers = c.layers, bc.init_factor = c.init_factor;  // the blocks' initialisation scales with both
    auto list = register_module("encoder", std::make_shared<torch::nn::Module>())
                    ->register_module("layers", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < c.layers; ++i) {
      blocks_.push_back(wick::deferred_part(
          deferral,
          [bc, dtype, init] {
            VitBlock b(bc, dtype, init);
            convert_module(*b, dtype);
            return b;
          },
          init));
      list->push_back(blocks_.back());
    }
    final_ = register_module("final_layer_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden}).eps(c.eps)));
    convert_module(*final_, dtype);
  }

  // pooled [N, hidden]: the final-normed state at each row's end-of-text token
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& attention_mask, wick::Model* owner) {
    if (ids.dim() != 2) throw wick::Error("clip: expected input_ids [N, L], got " + c10::str(ids.sizes()));
    const auto N = ids.size(0), L = ids.size(1);
    if (L > c_.max_len)
      throw wick::Error("clip: input_ids have " + std::to_string(L) + " tokens, the text encoder's positions cover " +
                        std::to_string(c_.max_len) + " (max_length)");
    if (N > 0) {
      const auto lo = ids.min().item<std::int64_t>(), hi = ids.max().item<std::int64_t>();
      if (lo < 0 || hi >= c_.vocab)
        throw wick::Error("clip: token id " + std::to_string(lo < 0 ? lo : hi) + " is outside the vocabulary of " +
                          std::to_string(c_.vocab) + " (vocab_size)");
    }
    at::Tensor x = token_->forward(ids) + position_->weight.narrow(0, 0, L).unsqueeze(0);
    at::Tensor mask;
    if (attention_mask.defined()) {
      if (attention_mask.sizes() != ids.sizes())
        throw wick::Error("clip: attention_mask " + c10::str(attention_mask.sizes()) + " does not match input_ids " +
                          c10::str(ids.sizes()));
      mask = attention_mask.to(at::kBool).view({N, 1, 1, L}).expand({N, 1, L, L});  // padded keys hidden
    }
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      VitBlock b = blocks_[i];
      auto fn = [b, mask](const at::Tensor& h) mutable { return b->forward(h, mask, /*causal=*/true); };
      x = owner ? owner->run_block("text_model.encoder.layers." + std::to_string(i), fn, x) : fn(x);
    }
    x = final_->forward(x);
    at::Tensor pos;
    if (c_.eos == 2) {
      pos = ids.argmax(-1);  // the legacy configs: the highest id is end-of-text
    } else {
      at::Tensor is_eos = ids.eq(c_.eos);
      if (N > 0 && !is_eos.any(1).all().item<bool>())
        throw wick::Error("clip: a row of input_ids has no end-of-text token (eos_token_id " + std::to_string(c_.eos) +
                          "); the text features are taken there");
      pos = is_eos.to(at::kInt).argmax(-1);
    }
    return x.index({at::arange(N, ids.options().dtype(at::kLong)), pos});
  }

  std::vector<VitBlock> blocks() const { return blocks_; }
  const TextConfig& config() const { return c_; }

 private:
  TextConfig c_;
  torch::nn::Embedding token_{nullptr}, position_{nullptr};
  std::vector<VitBlock> blocks_;
  torch::nn::LayerNorm final_{nullptr};
};
TORCH_MODULE(TextModel);

class Clip : public wick::Model,
             public wick::Predictor,
             public wick::WindowCoupled,
             public wick::AdapterTargets,
             public wick::Deferred {
 public:
  explicit Clip(const wick::Options& o)
      : exact_(o.get_string("accumulation") == "exact"), dtype_(dtype_named(o.get_string("dtype"))) {
    VitConfig vc;
    std::int64_t projection = o.get_int("projection_dim");
    double scale_init = o.get_number("logit_scale_init");
    wick::NamedTensorList tensors;
    std::string dir;
    if (o.has("path")) {
      dir = o.get_string("path");
      const std::string cfg_file = (fs::path(dir) / "config.json").string();
      if (!fs::exists(cfg_file)) throw wick::Error("clip: path " + dir + " has no config.json (expected a Hugging Face CLIPModel folder)");
      const nlohmann::json json = read_json_file(cfg_file);
      const wick::JsonFields j(json, "clip: " + cfg_file);
      if (j.string("model_type", "") != "clip") j.bad("model_type", "clip (a CLIPModel folder)");
      vc = config_from_hf(json, "clip: " + cfg_file);
      const nlohmann::json none = nlohmann::json::object();
      const wick::JsonFields t = j.has("text_config") ? j.object("text_config") : wick::JsonFields(none, "clip: " + cfg_file, "text_config.");
      const std::string tw = "clip: " + cfg_file + " text_config";
      constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
      tc_.vocab = t.integer("vocab_size", 49408, 1, kMax);
      tc_.hidden = t.integer("hidden_size", 512, 1, kMax);
      tc_.intermediate = t.integer("intermediate_size", 2048, 1, kMax);
      tc_.layers = t.integer("num_hidden_layers", 12, 0, kMax);
      tc_.heads = t.integer("num_attention_heads", 8, 1, kMax);
      tc_.max_len = t.integer("max_position_embeddings", 77, 1, kMax);
      tc_.eps = t.number("layer_norm_eps", 1e-5, 0);
      tc_.act = t.string("hidden_act", "quick_gelu");
      tc_.init_factor = t.number("initializer_factor", 1.0, 0);
      tc_.eos = t.integer("eos_token_id", 49407, -1, kMax);
      tc_.bos = t.integer("bos_token_id", -1, -1, kMax);
      tc_.pad = t.integer("pad_token_id", -1, -1, kMax);
      projection = j.integer("projection_dim", 512, 1, kMax);
      scale_init = j.number("logit_scale_init_value", 2.6592);
      check_activation(tc_.act, tw);
      tensors = read_hf_weights(dir, "clip");
    } else {
      // the vision tower is CLIP's whatever style says: the defaults follow clip
      auto values = o.values();
      values["style"] = wick::Value("clip");
      vc = config_from_options(wick::Options(values));
      tc_.vocab = o.get_int("vocab_size");
      tc_.hidden = o.get_int("text_hidden_size");
      tc_.intermediate = o.get_int("text_intermediate_size");
      tc_.layers = o.get_int("text_layers");
      tc_.heads = o.get_int("text_heads");
      tc_.max_len = o.get_int("max_length");
      tc_.eos = o.get_int("eos_token_id");
      tc_.eps = vc.eps;
      tc_.act = vc.act;
      if (tc_.eos >= tc_.vocab)
        throw wick::Error("clip: eos_token_id " + std::to_string(tc_.eos) + " is outside the vocabulary of " +
                          std::to_string(tc_.vocab));
    }
    if (tc_.hidden % tc_.heads)
      throw wick::Error("clip: text hidden size " + std::to_string(tc_.hidden) + " is not a multiple of " +
                        std::to_string(tc_.heads) + " heads");
    vc.style = "clip";
    if (!o.has("path")) vc.pool = o.get_string("pool");
    projection_ = projection;
    // deferred: both towers wait for the host (random values replayed, or the folder's read when made); the
    // projections and the temperature are made whole. A folder's towers draw nothing.
    wick::Deferral* deferral = o.get_bool("deferred") ? &deferral_ : nullptr;
    text_model_ = register_module("text_model", TextModel(tc_, dtype_, deferral, /*init=*/dir.empty()));
    vision_model_ = register_module("vision_model", Vit(vc, dtype_, deferral, /*init=*/dir.empty()));
    vision_model_->set_interpolate(o.get_bool("interpolate_pos_encoding"));
    visual_projection_ =
        register_module("visual_projection", torch::nn::Linear(torch::nn::LinearOptions(vc.hidden, projection).bias(false)));
    text_projection_ =
        register_module("text_projection", torch::nn::Linear(torch::nn::LinearOptions(tc_.hidden, projection).bias(false)));
    {
      at::NoGradGuard g;
      visual_projection_->weight.normal_(0, vc.init_factor / std::sqrt(static_cast<double>(vc.hidden)));
      text_projection_->weight.normal_(0, tc_.init_factor / std::sqrt(static_cast<double>(tc_.hidden)));
    }
    logit_scale_ = register_parameter("logit_scale", at::scalar_tensor(scale_init, at::kFloat));
    scale_init_ = scale_init;
    stats_ = pixel_stats_from_options(o, "clip", "clip");
    if (!dir.empty()) {
      stats_ = pixel_stats_from_folder(dir, stats_);
      // non-persistent buffers older files carry
      const std::set<std::string> ignore = {"text_model.embeddings.position_ids", "vision_model.embeddings.position_ids"};
      if (deferral)
        wick::defer_load_state(*this, std::move(tensors), dir, ignore, deferral_);
      else  // each tensor's pages released as it lands
        wick::load_state(*this, std::move(tensors), dir, ignore);
    }
    if (dtype_ != at::kFloat) to(dtype_);  // projections and logit_scale; the towers were built in dtype_
  }

  at::Tensor image_embeds(const wick::Batch& b) {
    const at::Tensor& img = batch_tensor(b, "image", "clip", "images [N, 3, H, W]");
    at::Tensor tokens = vision_model_->forward(normalize_pixels(img, stats_.mean, stats_.std, dtype_), this, "vision_model.");
    return visual_projection_->forward(vision_model_->pool(tokens));
  }

  at::Tensor text_embeds(const wick::Batch& b) {
    const at::Tensor& ids = batch_tensor(b, "input_ids", "clip", "token ids [N, L], int64");
    auto m = b.find("attention_mask");
    return text_projection_->forward(text_model_->forward(ids, m != b.end() ? m->second : at::Tensor(), this));
  }

  static at::Tensor normalized(const at::Tensor& x) {
    at::Tensor f = x.to(at::kFloat);
    return f / f.pow(2).sum(-1, /*keepdim=*/true).pow(0.5);
  }

  std::vector<at::Tensor> embed(const wick::Batch& b) override {
    at::Tensor i = normalized(image_embeds(b)), t = normalized(text_embeds(b));
    if (i.size(0) != t.size(0))
      throw wick::Error("clip: the batch has " + std::to_string(i.size(0)) + " images and " + std::to_string(t.size(0)) +
                        " texts; expected pairs");
    return {i, t};
  }

  // [N_text, N_image]: Hugging Face's logits_per_text
  at::Tensor logits_per_text(const at::Tensor& img, const at::Tensor& txt) {
    return txt.matmul(img.t()) * logit_scale_.to(at::kFloat).exp();
  }

  wick::ForwardResult loss(const at::Tensor& img, const at::Tensor& txt) {
    at::Tensor lt = logits_per_text(img, txt);
    const auto N = lt.size(0);
    at::Tensor target = at::arange(N, lt.options().dtype(at::kLong));
    wick::ForwardResult r;
    r.loss_sum = (at::cross_entropy_loss(lt, target, {}, at::Reduction::Sum) +
                  at::cross_entropy_loss(lt.t(), target, {}, at::Reduction::Sum)) /
                 2.0;
    r.items = N;
    r.metrics["accuracy"] = lt.t().argmax(-1).eq(target).sum();  // image -> its text
    return r;
  }

  wick::ForwardResult window_loss(const std::vector<at::Tensor>& e) override {
    if (e.size() != 2) throw wick::Error("clip: window_loss expects {image embeddings, text embeddings}");
    return loss(e[0], e[1]);
  }

  wick::ForwardResult forward(const wick::Batch& b) override {
    auto e = embed(b);
    return loss(e[0], e[1]);
  }

  std::int64_t count_items(const wick::Batch& b) const override {
    return batch_tensor(b, "image", "clip", "images [N, 3, H, W]").size(0);
  }

  bool window_coupled() const override { return exact_; }

  at::Tensor predict(const wick::Batch& b) override {
    const std::string& out = output_;
    if (out == "image_embeds") return normalized(image_embeds(b));
    if (out == "text_embeds") return normalized(text_embeds(b));
    auto e = embed(b);
    return logits_per_text(e[0], e[1]).t();  // logits_per_image
  }
  void set_output(std::string o) { output_ = std::move(o); }

  std::vector<std::string> blocks() const override {
    auto out = vision_model_->block_names("vision_model.");
    for (std::int64_t i = 0; i < tc_.layers; ++i) out.push_back("text_model.encoder.layers." + std::to_string(i));
    return out;
  }

  std::vector<std::pair<std::string, wick::Linear>> linear_layers() override {
    auto out = vision_model_->linear_layers("vision_model.");
    const auto tb = text_model_->blocks();
    for (std::size_t i = 0; i < tb.size(); ++i)
      for (const auto& [n, l] : tb[i]->linear_layers())
        out.emplace_back("text_model.encoder.layers." + std::to_string(i) + "." + n, l);
    return out;
  }

  bool deferred() const override { return wick::waits_for_values(*this, deferral_); }
  void materialize(const wick::Emit& emit) override { deferral_.run(emit); }

  std::map<std::string, wick::Value> attributes() const override {
    nlohmann::json vision = vision_model_->hf_config();
    nlohmann::json text = {{"model_type", "clip_text_model"},
                           {"vocab_size", tc_.vocab},
                           {"hidden_size", tc_.hidden},
                           {"intermediate_size", tc_.intermediate},
                           {"num_hidden_layers", tc_.layers},
                           {"num_attention_heads", tc_.heads},
                           {"max_position_embeddings", tc_.max_len},
                           {"layer_norm_eps", tc_.eps},
                           {"hidden_act", tc_.act},
                           {"eos_token_id", tc_.eos},
                           {"projection_dim", projection_}};
    if (tc_.bos >= 0) text["bos_token_id"] = tc_.bos;
    if (tc_.pad >= 0) text["pad_token_id"] = tc_.pad;
    vision["projection_dim"] = projection_;
    nlohmann::json j = {{"architectures", {"CLIPModel"}},
                        {"model_type", "clip"},
                        {"projection_dim", projection_},
                        {"logit_scale_init_value", scale_init_},
                        {"text_config", text},
                        {"vision_config", vision}};
    return {{"projection_dim", projection_},
            {"accumulation", std::string(exact_ ? "exact" : "plain")},
            {"window_coupled", exact_},
            {"image_size", vision_model_->config().image_size},
            {"vocab_size", tc_.vocab},
            {"max_length", tc_.max_len},
            {"eos_token_id", tc_.eos},
            {"hf_config", j.dump(2)}};
  }

 private:
  bool exact_;
  std::string output_ = "logits_per_image";
  TextConfig tc_;
  std::int64_t projection_ = 0;
  double scale_init_ = 2.6592;
  at::ScalarType dtype_ = at::kFloat;
  PixelStats stats_;
  TextModel text_model_{nullptr};
  Vit vision_model_{nullptr};
  torch::nn::Linear visual_projection_{nullptr}, text_projection_{nullptr};
  at::Tensor logit_scale_;
  wick::Deferral deferral_;  // deferred = true: the steps that make the towers' weights
};

class ClipPlugin : public Clip {
 public:
  explicit ClipPlugin(const wick::Options& o) : Clip(o) { set_output(o.get_string("output")); }
};

wick::OptionSchema schema() {
  wick::OptionSchema s = {
      wick::opt_string("path", wick::Value(), "Hugging Face CLIPModel folder; overrides the sizes").optional(),
      wick::opt_string("accumulation", "exact",
                       "exact: the contrastive loss over the whole window (all micro-batches and ranks, two passes as "
                       "GradCache), equal to one large batch; plain: each micro-batch's own loss (fewer negatives)")
          .one_of({"exact", "plain"}),
      wick::opt_int("projection_dim", 128, "width of the shared image-text space").at_least(1),
      wick::opt_number("logit_scale_init", 2.6592, "initial log temperature (log(1/0.07))"),
      wick::opt_int("vocab_size", 258, "text vocabulary (258: wick's byte tokenizer)").at_least(1),
      wick::opt_int("eos_token_id", 256, "end-of-text token, where the text features are taken (256: the byte tokenizer's)")
          .at_least(0),
      wick::opt_int("max_length", 77, "text positions").at_least(1),
      wick::opt_int("text_hidden_size", 128, "text encoder width").at_least(1),
      wick::opt_int("text_intermediate_size", 512, "text encoder MLP width").at_least(1),
      wick::opt_int("text_layers", 4, "text encoder blocks").at_least(0),
      wick::opt_int("text_heads", 4, "text encoder attention heads").at_least(1),
      wick::opt_string("output", "logits_per_image", "what predict() gives: logits_per_image [N, N], or the normalised "
                                                     "image_embeds or text_embeds")
          .one_of({"logits_per_image", "image_embeds", "text_embeds"}),
      wick::opt_string("dtype", "fp32", "weight dtype").one_of(wick::enum_names(wick::kDtypeNames)),
      wick::deferred_option("the image and text encoders (the projections are built whole)")};
  for (auto& o : vit_options()) s.push_back(o);
  return s;
}

}  // namespace

WICK_PLUGIN(wick::plugin<ClipPlugin>(
    "clip", "CLIP image-text model with the symmetric contrastive loss, exact over accumulation windows (GradCache)",
    schema()))
