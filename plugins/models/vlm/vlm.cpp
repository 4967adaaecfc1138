// model `vlm`: a LLaVA-style vision-language model: a Vision Transformer
// (lib/vision/vit.hpp), a projector (LLaVA's multi_modal_projector: linear_1,
// gelu, linear_2; or linear_1 alone) and the LLaMA / Qwen2 decoder
// (decoder_lm/decoder.hpp), with the parameter names of transformers 5's
// LlavaForConditionalGeneration (model.vision_tower.embeddings...,
// model.multi_modal_projector..., model.language_model..., lm_head), so a
// LLaVA folder loads unchanged and wick's weights load back.
//
// Batches: input_ids [B, L] with exactly one image token per sample, labels
// [B, L] (-100 = ignored), and the picture: image [B, 3, H, W] (uint8, as
// image_folder gives it; normalised here), video [B, T, 3, H, W] (every
// frame's tokens become visual tokens, frame after frame), or pixel_values
// (floating, already normalised). The image token is replaced by the
// projected visual tokens; their positions carry no loss. Items are the
// answer tokens (labels other than -100). Clips of different lengths
// (video_folder's max_frames = 0) come padded with a frame_mask [B, T] (1 = a
// real frame): only real frames are encoded, row r gets its own clip's
// visual tokens and the rows are right-padded to the longest merged sequence
// (ignored positions a causal model's real ones never see), so each row's
// logits and loss are those of its clip alone.
//
// Frames, memory bounded: the tower sees `frame_chunk` frames at a time (a
// frozen tower keeps nothing of a chunk once its tokens are out; a trained
// one runs each chunk as the block model.vision_tower.frames, which
// checkpointing recomputes chunk by chunk in backward), each
// frame's patch grid is average-pooled to `frame_tokens` tokens (a g x g
// grid, as the LLaVA-Video family pools), and `time_pool` consecutive frames
// are averaged into one, before the projector: a clip of T frames gives
// ceil(T / time_pool) * frame_tokens tokens to the language model.

#include <wick/kit/linear.hpp>
#include <wick/model.hpp>
#include <wick/kit/weights.hpp>
#include <wick/kit/hf_dtype_names.hpp>
#include <wick/kit/json_fields.hpp>

#include "lib/decoder/decoder.hpp"
#include "lib/vision/plugin_util.hpp"
#include "lib/vision/vit.hpp"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/linear.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <memory>

namespace fs = std::filesystem;
namespace dec = wick::decoder;
namespace vis = wick::vision;

namespace {

constexpr const char* kWho = "vlm";
// The prefix of the tower's size options (vision_hidden_size, ...).
constexpr const char* kTower = "vision_";

class ProjectorImpl : public torch::nn::Module {
 public:
  /// Initialised as transformers' _init_weights makes LLaVA's: weights normal(0, std), biases 0.
  ProjectorImpl(std::int64_t in, std::int64_t out, bool mlp, bool bias, double std) {
    linear_1 = register_module("linear_1", torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias)));
    if (mlp) linear_2 = register_module("linear_2", torch::nn::Linear(torch::nn::LinearOptions(out, out).bias(bias)));
    at::NoGradGuard g;
    for (auto& l : {linear_1, linear_2}) {
      if (!l) continue;
      l->weight.normal_(0.0, std);
      if (l->bias.defined()) l->bias.zero_();
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = linear_1->forward(x);
    return linear_2 ? linear_2->forward(at::gelu(h)) : h;
  }
  torch::nn::Linear linear_1{nullptr}, linear_2{nullptr};
};
TORCH_MODULE(Projector);

std::string str(std::int64_t v) { return std::to_string(v); }

class Vlm : public wick::Model,
            public wick::Predictor,
            public wick::Generator,
            public wick::AdapterTargets,
            public wick::Deferred,
            public wick::HostLookups {
 public:
  explicit Vlm(const wick::Options& o) {
    Parts parts = read_parts(o);
    read_frame_options(o, parts.vc);
    check_image_token(parts.lc);
    read_weights(parts);
    build(o, parts);
    load_weights(o, parts);
    freeze(o);
    if (o.get_bool("quantize_vision")) quantize_vision(o);
    describe_for_llava(o, parts);
    dec_->set_loss_chunk(o.has("loss_chunk") ? o.get_int("loss_chunk") : dec::kDefaultLossChunk);
  }

 private:
  // What the constructor learns before it builds: the parts' configs, the
  // folders they come from and, read ahead, the folders' weights.
  struct Parts {
    vis::VitConfig vc;
    dec::Config lc;
    std::string projector;
    bool projector_bias = true;
    std::string llava, vision_dir, language_dir;
    wick::NamedTensorList llava_weights, language_weights;
  };

  Parts read_parts(const wick::Options& o) {
    Parts p;
    p.projector = o.get_string("projector");
    image_token_id_ = o.get_int("image_token_id");
    layer_ = static_cast<int>(o.get_int("vision_feature_layer"));
    select_ = o.get_string("vision_feature_select");
    if (o.has("path")) {
      read_llava_config(o.get_string("path"), p);
    } else {
      read_vision_config(o, p);
      read_language_config(o, p);
    }
    return p;
  }

  // A LLaVA folder: its config fixes the parts and how they meet.
  void read_llava_config(const std::string& llava, Parts& p) {
    p.llava = llava;
    const auto file = (fs::path(llava) / "config.json").string();
    const nlohmann::json json = vis::read_json_file(file);
    const wick::JsonFields j(json, std::string(kWho) + ": " + file);
    if (!j.has("vision_config") || !j.has("text_config"))
      throw wick::Error(std::string(kWho) + ": " + file + " is not a LLaVA config (expected vision_config and text_config)");
    vis::check_saved_dtype(j);  // the parts' own are checked as they are read
    p.vc = vis::config_from_hf(j.object("vision_config").json(), std::string(kWho) + ": " + file);
    p.lc = dec::config_from_hf(j.object("text_config").json(), std::string(kWho) + ": " + file, "text_config.");
    p.projector = j.string("projector_hidden_act", "gelu") == "gelu" ? "mlp2x_gelu" : "";
    if (p.projector.empty()) j.bad("projector_hidden_act", "gelu (the other projectors are not supported)");
    p.projector_bias = j.flag("multimodal_projector_bias", true);
    constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
    image_token_id_ = j.has("image_token_id") ? j.integer("image_token_id", 0, kMax)
                                              : j.integer("image_token_index", image_token_id_, 0, kMax);
    if (j.has("vision_feature_layer")) {
      if (!j.json()["vision_feature_layer"].is_number_integer())
        j.bad("vision_feature_layer", "one integer (a list of layers is not supported)");
      layer_ = static_cast<int>(j.integer("vision_feature_layer", -1000, 1000));
    }
    select_ = j.string("vision_feature_select_strategy", "default");
  }

  // The tower: a folder's config, else the vision_* sizes.
  static void read_vision_config(const wick::Options& o, Parts& p) {
    if (!o.has("vision_path")) {
      p.vc = vis::config_from_options(o, kTower);
      return;
    }
    p.vision_dir = o.get_string("vision_path");
    const auto file = (fs::path(p.vision_dir) / "config.json").string();
    p.vc = vis::config_from_hf(vis::read_json_file(file), std::string(kWho) + ": " + file);
  }

  // The language model: a folder's config, else the sizes.
  static void read_language_config(const wick::Options& o, Parts& p) {
    if (!o.has("language_path")) {
      p.lc = dec::config_from_options(o);
      p.lc.dtype = o.get_string("dtype");  // built in it: the size check counts it
      dec::finish_config(p.lc, kWho, /*hf=*/false, o.get_string("quantize") == "nf4");
      return;
    }
    p.language_dir = o.get_string("language_path");
    const auto file = fs::path(p.language_dir) / "config.json";
    p.lc = dec::config_from_hf(dec::read_json(file), std::string(kWho) + ": " + file.string());
  }

  // frame_tokens, frame_chunk and time_pool; frame_tokens a square grid the tower's patches pool to.
  void read_frame_options(const wick::Options& o, const vis::VitConfig& vc) {
    frame_tokens_ = o.get_int("frame_tokens");
    frame_chunk_ = o.get_int("frame_chunk");
    time_pool_ = o.get_int("time_pool");
    const std::int64_t grid = vc.image_size / vc.patch_size;
    const auto g = static_cast<std::int64_t>(std::llround(std::sqrt(static_cast<double>(frame_tokens_))));
    if (frame_tokens_ != 0 && (g * g != frame_tokens_ || g > grid))
      throw wick::Error(std::string(kWho) + ": frame_tokens " + str(frame_tokens_) +
                        " is not a square grid of at most the tower's " + str(grid) + "x" + str(grid) +
                        " patches, expected 0 (every patch) or one of 1, 4, 9, ..., " + str(grid * grid));
    pool_grid_ = frame_tokens_ == 0 ? 0 : g;
  }

  void check_image_token(const dec::Config& lc) const {
    if (select_ != "default" && select_ != "full")
      throw wick::Error(std::string(kWho) + ": vision_feature_select '" + select_ + "' is not default or full");
    if (image_token_id_ < 0 || image_token_id_ >= lc.vocab)
      throw wick::Error(std::string(kWho) + ": image_token_id " + str(image_token_id_) +
                        " is outside the language model's vocabulary of " + str(lc.vocab) +
                        " (give the data's image_token_id and vocab_size)");
  }

  // The weights, read before the language model is made: tie_word_embeddings
  // with a separate head in the file that differs from the embedding leaves
  // the head untied, as transformers does (dec::untie_if_distinct).
  static void read_weights(Parts& p) {
    if (!p.llava.empty()) {
      p.llava_weights = vis::read_hf_weights(p.llava, kWho);
      const bool t5 = transformers5(p.llava_weights);
      dec::untie_if_distinct(p.lc, p.llava_weights,
                             t5 ? "model.language_model.embed_tokens.weight" : "language_model.model.embed_tokens.weight",
                             t5 ? "lm_head.weight" : "language_model.lm_head.weight", std::string(kWho) + ": " + p.llava);
    }
    if (!p.language_dir.empty()) {
      p.language_weights = dec::read_folder(p.language_dir, kWho);
      dec::untie_if_distinct(p.lc, p.language_weights, "model.embed_tokens.weight", "lm_head.weight",
                             std::string(kWho) + ": " + p.language_dir);
    }
  }

  static at::ScalarType weight_dtype(const wick::Options& o) {
    return wick::parse_enum(wick::kDtypeNames, o.get_string("dtype"), "dtype");
  }

  // LlavaForConditionalGeneration: model.{vision_tower, multi_modal_projector, language_model}, lm_head
  void build(const wick::Options& o, const Parts& p) {
    const at::ScalarType wdtype = weight_dtype(o);
    auto inner = register_module("model", std::make_shared<torch::nn::Module>("LlavaModel"));
    // deferred: the language model's weights (most of a LLaVA's) and the
    // tower's wait for the host; the projector is built whole
    deferred_build_ = o.get_bool("deferred");
    const bool tower_from_folder = !p.llava.empty() || !p.vision_dir.empty();
    // transformers 5's CLIPVisionModel and ViTModel hold the encoder's parts directly
    vit_ = inner->register_module(
        "vision_tower", vis::Vit(p.vc, wdtype, deferred_build_ ? &deferral_ : nullptr, /*init=*/!tower_from_folder));
    vision_prefix_ = "model.vision_tower";
    projector_ = inner->register_module("multi_modal_projector",
                                        Projector(p.vc.hidden, p.lc.hidden, p.projector == "mlp2x_gelu",
                                                  p.projector_bias, p.lc.init_range));
    vis::convert_module(*projector_, wdtype);
    const bool from_folder = !p.llava.empty() || !p.language_dir.empty();
    const bool nf4 = o.get_string("quantize") == "nf4";
    const std::int64_t block = o.get_int("quantize_block");
    if (nf4) dec::check_nf4_block(p.lc, block, "model.language_model", kWho);
    dec::Build build;
    build.dtype = wdtype;
    build.init = !from_folder;
    build.defer_linear = from_folder && nf4;     // a folder's weights arrive quantized, tensor by tensor
    build.quantize_block = nf4 ? block : 0;      // random ones are quantized layer by layer as they are made
    quantize_block_ = nf4 ? block : 0;
    if (deferred_build_) build.deferral = &deferral_;
    dec_ = std::make_unique<dec::Decoder>(p.lc, "model.language_model", build);
    dec_->register_with(*inner, "language_model", *this);
  }

  // The folders' weights (each list released once loaded) and the pixel statistics.
  void load_weights(const wick::Options& o, Parts& p) {
    stats_ = vis::default_pixel_stats(p.vc.style);
    if (!p.llava.empty()) {
      stats_ = vis::pixel_stats_from_folder(p.llava, stats_);
      load_llava(p.llava, p.llava_weights);
      p.llava_weights.clear();
    }
    if (!p.vision_dir.empty()) {
      stats_ = vis::pixel_stats_from_folder(p.vision_dir, stats_);
      auto t = vis::read_hf_weights(p.vision_dir, kWho);
      const std::string prefix = vis::find_vit_prefix(t, p.vc.style, p.vision_dir);
      load_tower(std::move(t), prefix, p.vision_dir);
    }
    if (!p.language_dir.empty()) {
      load_language_tensors(p.language_weights, "model.", "lm_head.weight", p.language_dir);
      p.language_weights.clear();
    }
    if (o.has("image_mean")) stats_.mean = o.get_number_list("image_mean");
    if (o.has("image_std")) stats_.std = o.get_number_list("image_std");
    if (stats_.mean.size() != 3 || stats_.std.size() != 3)
      throw wick::Error(std::string(kWho) + ": image_mean and image_std need 3 numbers each");
  }

  void freeze(const wick::Options& o) {
    if (o.get_bool("freeze_vision"))
      for (auto& p : vit_->parameters()) p.set_requires_grad(false);
    if (o.get_bool("freeze_language")) {
      for (auto& p : dec_->body->parameters()) p.set_requires_grad(false);
      if (dec_->lm_head)
        for (auto& p : dec_->lm_head->parameters()) p.set_requires_grad(false);
    }
    if (o.get_bool("freeze_projector"))
      for (auto& p : projector_->parameters()) p.set_requires_grad(false);
  }

  // A frozen tower's linear weights as 4-bit NF4 too, as bitsandbytes'
  // load_in_4bit quantizes every linear layer but the output head.
  void quantize_vision(const wick::Options& o) {
    const std::int64_t block = o.get_int("quantize_block");
    if (o.get_string("quantize") != "nf4")
      throw wick::Error(std::string(kWho) + ": quantize_vision needs quantize = \"nf4\" (got quantize = \"" +
                        o.get_string("quantize") + "\")");
    if (!o.get_bool("freeze_vision"))
      throw wick::Error(std::string(kWho) + ": quantize_vision needs freeze_vision = true (4-bit weights do not train)");
    for (auto& [name, lin] : vit_->linear_layers(vision_prefix_)) {
      const std::int64_t n = lin->in_features * lin->out_features;
      if (n % block != 0 || n % 2 != 0)
        throw wick::Error(std::string(kWho) + ": quantize_block " + str(block) + " does not divide layer " + name +
                          "'s " + str(n) + " weights, expected a block size that divides every linear layer's "
                          "weight count (an even count)");
    }
    for (auto& [name, lin] : vit_->linear_layers(vision_prefix_)) {
      lin->quantize_nf4(/*compute=*/weight_dtype(o), block);
    }
  }

 public:

  // A LLaMA / Qwen2 folder (model.* -> model.language_model.*, lm_head.weight)
  // or a LLaVA folder's language model: its tensors are taken out of `all`
  // and each released as it lands; with quantize = "nf4" the layers' linear
  // weights are quantized as they arrive.
  void load_language_tensors(wick::NamedTensorList& all, const std::string& body_prefix, const std::string& head_name,
                             const std::string& dir) {
    wick::NamedTensorList body, head;
    for (auto& [n, t] : all) {
      if (n.rfind(body_prefix, 0) == 0) body.emplace_back(n.substr(body_prefix.size()), std::move(t));
      else if (n == head_name) head.emplace_back("weight", std::move(t));
    }
    std::vector<std::pair<std::string, wick::Linear>> layers;  // named as in the body
    const std::string mine = "model.language_model.";
    for (auto& [n, l] : dec_->linear_layers()) layers.emplace_back(n.substr(mine.size()), l);
    const std::string source = dir + " (language model under " + body_prefix + ")";
    if (deferred_build_) {  // each tensor read when the host makes it
      dec::defer_loading(*dec_->body, std::move(body), source, {}, layers, quantize_block_, deferral_);
      if (dec_->lm_head)
        dec::defer_loading(*dec_->lm_head, std::move(head), dir + " (" + head_name + ")", {}, {}, 0, deferral_);
      return;
    }
    dec::load_quantizing(*dec_->body, std::move(body), source, {}, layers, quantize_block_);
    if (dec_->lm_head) wick::load_state(*dec_->lm_head, std::move(head), dir + " (" + head_name + ")");
  }

  // A LLaVA folder, in transformers 5's names (model.vision_tower.*,
  // model.multi_modal_projector.*, model.language_model.*, lm_head.weight) or
  // the ones save_pretrained writes (vision_tower.*, multi_modal_projector.*,
  // language_model.model.*, language_model.lm_head.weight).
  // transformers 5's names (model.language_model.*) rather than save_pretrained's older ones
  static bool transformers5(const wick::NamedTensorList& all) {
    for (const auto& [n, t] : all)
      if (n.rfind("model.language_model.", 0) == 0) return true;
    return false;
  }

  // the tower's tensors of a folder (the list consumed: a copy where the
  // caller still reads it): read now, or when the host makes them (a deferred tower)
  void load_tower(wick::NamedTensorList all, const std::string& prefix, const std::string& dir) {
    if (deferred_build_) vis::defer_vit_weights(*vit_, std::move(all), prefix, dir, deferral_);
    else vis::load_vit_weights(*vit_, std::move(all), prefix, dir);
  }

  void load_llava(const std::string& dir, wick::NamedTensorList& all) {
    load_tower(all, vis::find_vit_prefix(all, vit_->config().style, dir), dir);
    wick::NamedTensorList proj;
    for (const auto& [n, t] : all) {
      const auto at = n.find("multi_modal_projector.");
      if (at != std::string::npos) proj.emplace_back(n.substr(at + 22), t);
    }
    wick::load_state(*projector_, proj, dir + " (multi_modal_projector)");
    if (transformers5(all)) load_language_tensors(all, "model.language_model.", "lm_head.weight", dir);
    else load_language_tensors(all, "language_model.model.", "language_model.lm_head.weight", dir);
  }

  // [n, tokens, vision hidden]: one frame's tokens after the tower (block
  // vision_feature_layer), the class token dropped (select default), the
  // patch grid average-pooled to frame_tokens.
  at::Tensor frame_features(const at::Tensor& pix) {
    at::Tensor f = vit_->forward(pix, this, vision_prefix_, layer_);
    at::Tensor cls;
    if (select_ == "full") cls = f.narrow(1, 0, 1);
    f = f.narrow(1, 1, f.size(1) - 1);
    if (pool_grid_ > 0) {
      const auto n = f.size(0), D = f.size(2);
      const auto grid = vit_->config().image_size / vit_->config().patch_size;
      f = at::adaptive_avg_pool2d(f.transpose(1, 2).reshape({n, D, grid, grid}), {pool_grid_, pool_grid_})
              .flatten(2)
              .transpose(1, 2);
    }
    return cls.defined() ? at::cat({cls, f}, 1) : f;
  }

  // Each picture's visual tokens [V_r, text hidden], r over the batch. A
  // video with a frame_mask (clips of different lengths, padded: max_frames =
  // 0) sends only real frames through the tower, so V_r follows clip r's own
  // frame count.
  std::vector<at::Tensor> visual_tokens(const wick::Batch& b) {
    at::Tensor raw;  // [frames, 3, H, W]: uint8 to be normalised, or floating pixels
    std::vector<std::int64_t> frames = frame_counts(b);
    bool normalised = false;
    if (auto it = b.find("video"); it != b.end()) {
      const auto& v = it->second;
      raw = v.flatten(0, 1);
      const at::Tensor valid = vis::frame_mask(b, v, kWho);
      if (valid.defined()) raw = raw.index({valid.flatten()});
    } else if (auto it = b.find("image"); it != b.end()) {
      raw = it->second;
    } else if (auto it = b.find("pixel_values"); it != b.end()) {
      raw = it->second;
      normalised = true;
    } else {
      throw wick::Error(std::string(kWho) + ": the batch has no image, video or pixel_values");
    }
    // the weights' dtype now (precision = bf16-true converts them after they are made)
    const auto dtype = projector_->linear_1->weight.scalar_type();
    bool vision_trains = false;
    for (const auto& p : vit_->parameters()) vision_trains = vision_trains || p.requires_grad();
    // frame_chunk frames through the tower at a time; a trained tower's
    // chunks are the block frames_block(), so checkpointing keeps a chunk's
    // input frames and pooled tokens only and runs tower and pooling again,
    // one chunk at a time, in backward
    auto encode = [this, normalised, dtype](const at::Tensor& r) {
      return frame_features(normalised ? r.to(dtype) : vis::normalize_pixels(r, stats_.mean, stats_.std, dtype));
    };
    at::Tensor feats = vis::encode_frames(*this, frames_block(), raw, frame_chunk_, vision_trains, encode);  // [frames, tokens, D]
    // each picture's frames; consecutive ones averaged, the last group maybe shorter
    std::vector<at::Tensor> rows;
    std::int64_t at_frame = 0;
    for (const auto T : frames) {
      at::Tensor f = feats.narrow(0, at_frame, T);  // [T, P, D]
      at_frame += T;
      if (time_pool_ > 1 && T > 1) {
        std::vector<at::Tensor> groups;
        for (std::int64_t t = 0; t < T; t += time_pool_) groups.push_back(f.narrow(0, t, std::min(time_pool_, T - t)).mean(0));
        f = at::stack(groups, 0);
      }
      rows.push_back(f.flatten(0, 1));
    }
    feats = projector_->forward(at::cat(rows, 0).to(dtype));
    std::vector<std::int64_t> sizes;
    for (const auto& r : rows) sizes.push_back(r.size(0));
    return feats.split_with_sizes(sizes, 0);
  }

  // The frame count of each picture of the batch: video's T, or each clip's
  // real frames under a frame_mask; 1 for images.
  std::vector<std::int64_t> frame_counts(const wick::Batch& b) const {
    if (auto it = b.find("video"); it != b.end()) {
      const auto& v = it->second;
      if (v.dim() != 5) throw wick::Error(std::string(kWho) + ": video must be [N, T, 3, H, W], got " + c10::str(v.sizes()));
      const at::Tensor valid = vis::frame_mask(b, v, kWho);
      if (!valid.defined()) return std::vector<std::int64_t>(static_cast<std::size_t>(v.size(0)), v.size(1));
      const at::Tensor n = valid.sum(1).cpu();
      return std::vector<std::int64_t>(n.data_ptr<std::int64_t>(), n.data_ptr<std::int64_t>() + n.numel());
    }
    for (const char* k : {"image", "pixel_values"})
      if (auto it = b.find(k); it != b.end()) return std::vector<std::int64_t>(static_cast<std::size_t>(it->second.size(0)), 1);
    throw wick::Error(std::string(kWho) + ": the batch has no image, video or pixel_values");
  }

  // The position of each row's image token; exactly one per row.
  std::vector<std::int64_t> image_positions(const at::Tensor& ids) const {
    at::Tensor hits = ids.eq(image_token_id_).cpu();
    std::vector<std::int64_t> out;
    for (std::int64_t r = 0; r < ids.size(0); ++r) {
      at::Tensor at_r = hits[r].nonzero();
      if (at_r.size(0) != 1)
        throw wick::Error(std::string(kWho) + ": sample " + str(r) + " of the batch has " + str(at_r.size(0)) +
                          " image tokens (id " + str(image_token_id_) + "); expected exactly one (put image_token in "
                          "the data's prompt)");
      out.push_back(at_r[0][0].item<std::int64_t>());
    }
    return out;
  }

  // Row r with its image token replaced by fill[r]; rows
  // shorter than the longest padded at the end with `pad` (right padding: a
  // causal model's real positions never see it).
  static at::Tensor widen(const at::Tensor& x, const std::vector<std::int64_t>& pos, const std::vector<at::Tensor>& fill,
                          const at::Tensor& pad) {
    std::vector<at::Tensor> rows;
    std::int64_t longest = 0;
    const auto L = x.size(1);
    for (std::int64_t r = 0; r < x.size(0); ++r) {
      const auto p = pos[static_cast<std::size_t>(r)];
      rows.push_back(at::cat({x[r].narrow(0, 0, p), fill[static_cast<std::size_t>(r)], x[r].narrow(0, p + 1, L - p - 1)}));
      longest = std::max(longest, rows.back().size(0));
    }
    for (auto& row : rows)
      if (row.size(0) < longest) {
        auto shape = row.sizes().vec();
        shape[0] = longest - row.size(0);
        row = at::cat({row, pad.expand(shape)});
      }
    return at::stack(rows);
  }

  // Labels with each row's image token widened to V[r] ignored positions.
  static at::Tensor expand_labels(const at::Tensor& labels, const std::vector<std::int64_t>& pos,
                                  const std::vector<std::int64_t>& V) {
    std::vector<at::Tensor> fill;
    for (const auto v : V) fill.push_back(at::full({v}, dec::kIgnore, labels.options()));
    return widen(labels, pos, fill, at::full({1}, dec::kIgnore, labels.options()));
  }

  // Visual tokens of one frame (frame_tokens, or every patch; with the class token for select full).
  std::int64_t tokens_per_frame() const {
    return (pool_grid_ > 0 ? pool_grid_ * pool_grid_ : vit_->num_patches()) + (select_ == "full" ? 1 : 0);
  }

  // Each picture's visual token count.
  std::vector<std::int64_t> tokens_per_picture(const wick::Batch& b) const {
    std::vector<std::int64_t> V;
    for (const auto T : frame_counts(b)) V.push_back(tokens_per_frame() * ((T + time_pool_ - 1) / time_pool_));
    return V;
  }

  // Input embeddings with the visual tokens in place of the image token.
  at::Tensor merged_embeds(const at::Tensor& ids, const std::vector<std::int64_t>& pos, const std::vector<at::Tensor>& feats) {
    at::Tensor emb = dec_->embed(ids.masked_fill(ids.eq(image_token_id_), 0));
    std::vector<at::Tensor> fill;
    for (const auto& f : feats) fill.push_back(f.to(emb.scalar_type()));
    return widen(emb, pos, fill, at::zeros({1, emb.size(2)}, emb.options()));
  }

  static at::Tensor labels_of(const wick::Batch& b) {
    auto it = b.find("labels");
    return it != b.end() ? it->second : b.at("input_ids");
  }

  std::int64_t count_items(const wick::Batch& b) const override {
    const at::Tensor ids = b.at("input_ids").cpu();
    at::Tensor l = expand_labels(labels_of(b).cpu(), image_positions(ids), tokens_per_picture(b));
    return l.narrow(1, 1, l.size(1) - 1).ne(dec::kIgnore).sum().item<std::int64_t>();
  }

  // The language model's final hidden states over the merged sequence; pos
  // and V: each row's image token position and visual token count.
  at::Tensor hidden_states(const wick::Batch& b, std::vector<std::int64_t>& pos, std::vector<std::int64_t>& V) {
    const at::Tensor& ids = b.at("input_ids");
    pos = image_positions(ids);
    const std::vector<at::Tensor> feats = visual_tokens(b);
    if (static_cast<std::int64_t>(feats.size()) != ids.size(0))
      throw wick::Error(std::string(kWho) + ": " + str(static_cast<std::int64_t>(feats.size())) + " pictures for " +
                        str(ids.size(0)) + " token rows");
    V.clear();
    for (const auto& f : feats) V.push_back(f.size(0));
    return dec_->hidden(merged_embeds(ids, pos, feats), this);
  }

  wick::ForwardResult forward(const wick::Batch& b) override {
    dec_->check_nf4_training(kWho, "freeze_language = true, or model:freeze");
    std::vector<std::int64_t> pos, V;
    // the labels on the host before the towers' kernels are queued (image_positions reads the ids there anyway),
    // so that the loss's checks wait for nothing
    const at::Tensor labels_host = labels_of(b).cpu();
    at::Tensor h = hidden_states(b, pos, V);
    return dec_->loss_from_hidden(h, expand_labels(labels_of(b), pos, V), expand_labels(labels_host, pos, V));
  }

  at::Tensor predict(const wick::Batch& b) override {
    std::vector<std::int64_t> pos, V;
    return dec_->head(hidden_states(b, pos, V));
  }

  // Text-only generation: the language model alone.
  std::vector<std::int64_t> generate(const std::vector<std::int64_t>& prompt, const wick::GenerateOptions& g) override {
    const bool was_training = is_training();
    train(false);
    auto out = dec_->generate(prompt, g, kWho);
    train(was_training);
    return out;
  }

  // The first sample's picture and prompt: its tokens before the first label
  // (the answer), else its attention_mask's tokens, else all of them.
  std::vector<std::int64_t> generate_from(const wick::Batch& in, const wick::GenerateOptions& g) override {
    const auto dev = dec_->device();
    wick::Batch b;
    for (const auto& [k, t] : in) b[k] = t.narrow(0, 0, 1).to(dev);
    at::Tensor ids = b.at("input_ids").cpu();
    std::int64_t n = ids.size(1);
    if (auto it = b.find("labels"); it != b.end()) {
      at::Tensor answer = it->second.cpu()[0].ne(dec::kIgnore).nonzero();
      if (answer.size(0) > 0) n = answer[0][0].item<std::int64_t>();
    } else if (auto m = b.find("attention_mask"); m != b.end()) {
      n = m->second.cpu()[0].sum().item<std::int64_t>();
    }
    b["input_ids"] = b["input_ids"].narrow(1, 0, n);
    const bool was_training = is_training();
    train(false);
    std::vector<std::int64_t> out;
    {
      at::NoGradGuard no_grad;
      const auto pos = image_positions(b["input_ids"]);
      at::Tensor emb = merged_embeds(b["input_ids"], pos, visual_tokens(b));
      const at::Tensor prompt = b["input_ids"].select(0, 0).to(at::kCPU, at::kLong).contiguous();
      const auto* p = prompt.data_ptr<std::int64_t>();
      out = dec_->generate_from_embeds(emb, g, kWho, std::vector<std::int64_t>(p, p + prompt.numel()));
    }
    train(was_training);
    return out;
  }

  std::string item_name() const override { return "tokens"; }

  // The tower over one chunk of frames (frame_chunk), when the tower trains
  // and the frames take several chunks; the tower's blocks run inside it.
  std::string frames_block() const { return vision_prefix_ + ".frames"; }

  std::vector<std::string> blocks() const override {
    auto out = vit_->block_names(vision_prefix_);
    out.insert(out.begin(), frames_block());
    for (auto& n : dec_->blocks()) out.push_back(n);
    return out;
  }
  // The language model's linear layers: lora / qlora adapt the LM only.
  std::vector<std::pair<std::string, wick::Linear>> linear_layers() override { return dec_->linear_layers(); }

  // deferred while a tensor still waits (wick::waits_for_values)
  bool deferred() const override { return wick::waits_for_values(*this, deferral_); }
  // offload_embeddings: the language model's input embedding, when untied
  std::vector<at::Tensor> host_lookup_tables() override { return dec_->host_lookup_tables(); }
  std::string host_lookup_refusal() const override { return dec_->host_lookup_refusal(); }
  void materialize(const wick::Emit& emit) override { deferral_.run(emit); }

  std::map<std::string, wick::Value> attributes() const override {
    const auto& c = dec_->config();
    const auto& v = vit_->config();
    std::map<std::string, wick::Value> a = attributes_of_parts(c, v);
    // wick.save_pretrained writes a LLaVA folder: its config.json, and the
    // tokenizer files and preprocessor_config.json of the folder it came from
    if (hf_refused_.empty()) a["hf_config"] = llava_config().dump(2);
    else a["hf_config_refused"] = hf_refused_;
    a["source_path"] = source_;
    return a;
  }

 private:
  // What LlavaForConditionalGeneration cannot describe, said once: its config
  // would load a model that computes otherwise.
  void describe_for_llava(const wick::Options& o, const Parts& p) {
    source_ = !p.llava.empty() ? p.llava : p.language_dir;
    projector_bias_ = p.projector_bias;
    dtype_ = o.get_string("dtype");
    std::vector<std::string> why;
    if (p.projector != "mlp2x_gelu") why.push_back("projector = \"" + p.projector + "\" (LLaVA's is mlp2x_gelu)");
    if (frame_tokens_ != 0) why.push_back("frame_tokens = " + str(frame_tokens_) + " (LLaVA keeps every patch)");
    if (time_pool_ != 1) why.push_back("time_pool = " + str(time_pool_) + " (LLaVA pools no frames)");
    if (o.get_bool("quantize_vision")) why.push_back("quantize_vision = true (its 4-bit tower is not written back)");
    for (std::size_t i = 0; i < why.size(); ++i) hf_refused_ += (i ? ", " : "") + why[i];
  }

  nlohmann::json llava_config() const {
    const std::string dtype = wick::hf_dtype_name(dtype_);
    return {{"architectures", {"LlavaForConditionalGeneration"}},
            {"model_type", "llava"},
            {"vision_config", vit_->hf_config()},
            {"text_config", dec::hf_config(dec_->config())},
            {"image_token_id", image_token_id_},
            {"projector_hidden_act", "gelu"},
            {"multimodal_projector_bias", projector_bias_},
            {"vision_feature_layer", layer_},
            {"vision_feature_select_strategy", select_},
            {"tie_word_embeddings", dec_->config().tie},
            {"torch_dtype", dtype}};
  }

  std::map<std::string, wick::Value> attributes_of_parts(const dec::Config& c, const vis::VitConfig& v) const {
    return {{"vocab_size", c.vocab},
            {"hidden_size", c.hidden},
            {"layers", c.layers},
            {"vision_hidden_size", v.hidden},
            {"vision_layers", v.layers},
            {"image_size", v.image_size},
            {"image_token_id", image_token_id_},
            {"visual_tokens", tokens_per_frame()},
            {"vision_feature_layer", static_cast<std::int64_t>(layer_)}};
  }

 private:
  vis::Vit vit_{nullptr};
  Projector projector_{nullptr};
  wick::Deferral deferral_;  // deferred = true: the steps that make the language model's and the tower's weights
  bool deferred_build_ = false;
  std::unique_ptr<dec::Decoder> dec_;
  std::string vision_prefix_, select_;
  vis::PixelStats stats_;
  std::string source_, dtype_, hf_refused_;
  bool projector_bias_ = true;
  std::int64_t image_token_id_ = 0;
  int layer_ = -2;
  std::int64_t frame_tokens_ = 0, pool_grid_ = 0, frame_chunk_ = 0, time_pool_ = 1, quantize_block_ = 0;
};

// The tower's sizes where no folder gives it: vit_options()' own, named as
// config_from_options(o, kTower) reads them, with a small CLIP tower's defaults.

std::vector<wick::OptionSpec> tower_options() {
  const std::string without = "vision tower without a folder: ";
  wick::OptionSpec layers = vis::vit_option_as("layers", kTower, 4, without + "blocks");
  layers.min = 1;  // the visual tokens are a block's (vision_feature_layer)
  return {
      vis::vit_option_as("style", kTower, "clip", without + "clip or vit names"),
      vis::vit_option_as("image_size", kTower, 224, without + "image side"),
      vis::vit_option_as("patch_size", kTower, 16, without + "patch side"),
      vis::vit_option_as("hidden_size", kTower, 192, without + "width"),
      vis::vit_option_as("intermediate_size", kTower, 768, without + "MLP width"),
      layers,
      vis::vit_option_as("heads", kTower, 3, without + "attention heads"),
  };
}

wick::OptionSchema schema() {
  wick::OptionSchema s = {
      wick::opt_string("path", wick::Value(), "a LLaVA folder (config.json with vision_config and text_config, "
                                              "safetensors): all parts and how they meet").optional(),
      wick::opt_string("vision_path", wick::Value(), "vision tower: a CLIP, CLIPVision or ViT folder (else the vision_* sizes)").optional(),
      wick::opt_string("language_path", wick::Value(), "language model: a LLaMA or Qwen2 folder (else the sizes below)").optional(),
      wick::opt_string("projector", "mlp2x_gelu", "linear (linear_1) or mlp2x_gelu (linear_1, gelu, linear_2, as LLaVA)")
          .one_of({"linear", "mlp2x_gelu"}),
      wick::opt_int("vision_feature_layer", -2, "the vision block whose tokens become visual tokens (-1: the last)"),
      wick::opt_string("vision_feature_select", "default", "default (patch tokens only) or full (with the class token)")
          .one_of({"default", "full"}),
      wick::opt_int("image_token_id", 257, "the token the visual tokens replace (the data's image_token_id; 257 for bytes)").at_least(0),
      wick::opt_bool("freeze_vision", true, "keep the vision tower's weights fixed (it then keeps no activations)"),
      wick::opt_bool("freeze_language", false, "keep the language model's weights fixed"),
      wick::opt_bool("freeze_projector", false, "keep the projector's weights fixed"),
      wick::opt(std::string("image_mean"), wick::OptionType::NumberList, wick::Value(),
                "per-channel mean of the 0..1 pixels (default: the folder's preprocessor_config.json, else CLIP's or 0.5)").optional(),
      wick::opt(std::string("image_std"), wick::OptionType::NumberList, wick::Value(),
                "per-channel std of the 0..1 pixels (default: as image_mean)").optional(),
  };
  for (auto& o : tower_options()) s.push_back(o);
  for (auto& o : dec::size_options()) s.push_back(o);
  s.push_back(wick::opt_string("dtype", "fp32", "weight dtype").one_of(wick::enum_names(wick::kDtypeNames)));
  s.push_back(wick::opt_int("frame_tokens", 0,
                            "visual tokens per frame (or image): the patch grid average-pooled to a g x g grid "
                            "(1, 4, 9, 16, ...); 0: every patch").at_least(0));
  s.push_back(wick::opt_int("frame_chunk", 0,
                            "frames through the vision tower at a time (a frozen tower then holds one chunk's "
                            "activations, whatever the frame count; a trained one too, with the block "
                            "model.vision_tower.frames checkpointed); 0: all at once").at_least(0));
  s.push_back(wick::opt_int("time_pool", 1, "consecutive frames averaged into one before the projector").at_least(1));
  for (auto& o : dec::quantize_options()) s.push_back(o);
  s.push_back(wick::opt_bool("quantize_vision", false,
                             "with quantize = \"nf4\": the frozen vision tower's linear weights as NF4 too"));
  for (auto& o : dec::loss_options()) s.push_back(o);
  s.push_back(wick::deferred_option("the language model and the vision tower (the projector is built whole)"));
  return s;
}

}  // namespace

WICK_PLUGIN(wick::plugin<Vlm>("vlm",
                                    "LLaVA-style vision-language model: ViT, projector, LLaMA/Qwen2 decoder (Hugging Face names)",
                                    schema()))
