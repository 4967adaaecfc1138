// model `video_classifier`: a Vision Transformer on every frame (the `vit`
// encoder, pooled per frame) and a temporal module over the T frames (mean,
// or a small pre-norm transformer with learned temporal positions), then a
// linear head. Batches: `video` uint8 [N, T, 3, H, W] as video_folder gives
// them (or `image` [N, 3, H, W]: one frame), `label` [N], and with clips of
// different lengths (max_frames = 0) `frame_mask` [N, T] (1 = a real frame):
// padded frames skip the encoder, no frame attends to them and the mean is
// over real frames, so each clip's logits are those of the clip alone.
// Items are samples.
//
// The frame encoder runs on all N x T frames at once (frame_chunk = 0), so
// its activation memory grows linearly with T (the data's max_frames); its
// blocks and the temporal blocks are declared, so checkpointing = true keeps
// one block's activations. frame_chunk = k sends k frames through it at a
// time: frozen, it then holds one chunk's activations; trained, each chunk
// is the block <encoder>.frames (vit.frames, vision_model.frames), which
// checkpointing recomputes chunk by chunk in backward, so the step keeps the
// input frames and one feature vector per frame, whatever T.
// Parameter names: vit.* (style vit) or vision_model.* (style clip) as the
// `vit` plugin, temporal.position_embeddings, temporal.layers.N.*,
// temporal.layernorm.*, classifier.*.

#include <wick/kit/deferred_build.hpp>
#include <wick/kit/linear.hpp>
#include <wick/model.hpp>

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>

#include "lib/vision/plugin_util.hpp"
#include "lib/vision/vit.hpp"

using namespace wick::vision;

namespace {

class VideoClassifier : public wick::Model, public wick::Predictor, public wick::AdapterTargets, public wick::Deferred {
 public:
  explicit VideoClassifier(const wick::Options& o)
      : classes_(o.get_int("classes")),
        temporal_(o.get_string("temporal")),
        freeze_(o.get_bool("freeze_vision")),
        frame_chunk_(o.get_int("frame_chunk")),
        dtype_(dtype_named(o.get_string("dtype"))) {
    // deferred: the frame encoder (the bulk) waits for the host; the temporal part and head are made whole
    wick::Deferral* deferral = o.get_bool("deferred") ? &deferral_ : nullptr;
    if (o.has("vision_path")) {
      const std::string dir = o.get_string("vision_path");
      vit_ = vit_from_folder(dir, "video_classifier", o.get_string("pool"), dtype_, deferral);
      stats_ = pixel_stats_from_folder(dir, pixel_stats_from_options(o, vit_->config().style, "video_classifier"));
    } else {
      vit_ = Vit(config_from_options(o), dtype_, deferral);
      stats_ = pixel_stats_from_options(o, vit_->config().style, "video_classifier");
    }
    vit_->set_interpolate(o.get_bool("interpolate_pos_encoding"));
    const VitConfig& fc = vit_->config();
    prefix_ = fc.style == "vit" ? "vit." : "vision_model.";
    register_module(fc.style == "vit" ? "vit" : "vision_model", vit_);
    const auto D = fc.hidden;
    if (temporal_ == "transformer") {
      VitConfig tc = fc;
      tc.heads = o.has("temporal_heads") ? o.get_int("temporal_heads") : fc.heads;
      tc.layers = o.get_int("temporal_layers");
      if (D % tc.heads)
        throw wick::Error("video_classifier: hidden_size " + std::to_string(D) + " is not a multiple of temporal_heads " +
                          std::to_string(tc.heads));
      auto t = register_module("temporal", std::make_shared<torch::nn::Module>());
      max_frames_ = o.get_int("max_frames");
      {
        at::NoGradGuard g;
        temporal_pos_ = t->register_parameter("position_embeddings", at::randn({1, max_frames_, D}) * fc.init_range);
      }
      auto list = t->register_module("layers", torch::nn::ModuleList());
      for (std::int64_t i = 0; i < tc.layers; ++i) {
        temporal_blocks_.push_back(VitBlock(tc));
        list->push_back(temporal_blocks_.back());
      }
      temporal_norm_ = t->register_module("layernorm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({D}).eps(fc.eps)));
    }
    classifier_ = register_module("classifier", torch::nn::Linear(D, classes_));
    {  // transformers' _init_weights for a classification head: normal(0, initializer_range), bias 0
      at::NoGradGuard g;
      classifier_->weight.normal_(0.0, fc.init_range);
      classifier_->bias.zero_();
    }
    if (freeze_)
      for (auto& p : vit_->parameters()) p.set_requires_grad(false);
    if (dtype_ != at::kFloat) to(dtype_);  // the small parts; the encoder was built in dtype_
  }

  // [N, T, D]: the pooled features of every frame. With a frame_mask
  // (clips of different lengths, padded), `valid` [N, T] gets the real
  // frames; only they go through the encoder, the padding's features are 0.
  at::Tensor frame_features(const wick::Batch& b, at::Tensor& valid) {
    at::Tensor video;
    if (auto it = b.find("video"); it != b.end()) {
      video = it->second;
      if (video.dim() != 5)
        throw wick::Error("video_classifier: expected video [N, T, 3, H, W], got " + c10::str(video.sizes()));
    } else if (auto im = b.find("image"); im != b.end()) {
      video = im->second.unsqueeze(1);  // still images: clips of one frame
    } else {
      batch_tensor(b, "video", "video_classifier", "clips [N, T, 3, H, W] from video_folder");
    }
    valid = frame_mask(b, video, "video_classifier");
    if (valid.defined()) {  // up to the last real frame of any clip (a re-split batch may hold only padding past it)
      const auto last = valid.any(0).nonzero().max().item<std::int64_t>() + 1;
      video = video.narrow(1, 0, last);
      valid = valid.narrow(1, 0, last);
    }
    const auto N = video.size(0), T = video.size(1);
    if (temporal_ == "transformer" && T > max_frames_)
      throw wick::Error("video_classifier: clips have " + std::to_string(T) + " frames, the temporal positions cover " +
                        std::to_string(max_frames_) + " (set the model's max_frames to at least the data's)");
    at::Tensor flat = video.flatten(0, 1);
    if (valid.defined()) flat = flat.index({valid.flatten()});
    // frozen now (freeze_vision, or model:freeze later): the encoder keeps no activations for backward
    bool trains = false;
    for (const auto& p : vit_->parameters()) trains = trains || p.requires_grad();
    // frame_chunk frames through the encoder at a time; a trained encoder's
    // chunks are the block frames_block(), recomputed chunk by chunk in backward
    auto encode = [this, trains](const at::Tensor& r) {
      const at::Tensor frames = normalize_pixels(r, stats_.mean, stats_.std, dtype_);
      return vit_->pool(trains ? vit_->forward(frames, this, prefix_) : vit_->forward(frames));
    };
    at::Tensor pooled = encode_frames(*this, frames_block(), flat, frame_chunk_, trains, encode);
    if (valid.defined())
      pooled = at::zeros({N * T, pooled.size(-1)}, pooled.options()).index_put({valid.flatten()}, pooled);
    return pooled.view({N, T, -1});
  }

  at::Tensor logits(const wick::Batch& b) {
    at::Tensor valid;
    at::Tensor h = frame_features(b, valid);
    if (temporal_ == "transformer") {
      h = h + temporal_pos_.narrow(1, 0, h.size(1)).to(h.scalar_type());
      // padded frames are keys no frame attends to
      at::Tensor attend;
      if (valid.defined()) attend = valid.view({h.size(0), 1, 1, h.size(1)}).expand({h.size(0), 1, h.size(1), h.size(1)});
      for (std::size_t i = 0; i < temporal_blocks_.size(); ++i) {
        VitBlock blk = temporal_blocks_[i];
        h = run_block("temporal.layers." + std::to_string(i),
                      [blk, attend](const at::Tensor& x) mutable { return blk->forward(x, attend); }, h);
      }
      h = temporal_norm_->forward(h);
    }
    if (!valid.defined()) return classifier_->forward(h.mean(1));
    // the mean over each clip's real frames
    const at::Tensor w = valid.to(h.scalar_type()).unsqueeze(-1);
    return classifier_->forward((h * w).sum(1) / w.sum(1));
  }

  wick::ForwardResult forward(const wick::Batch& b) override {
    at::Tensor y = checked_labels(b, classes_, "video_classifier");
    return classification(logits(b), y);
  }

  at::Tensor predict(const wick::Batch& b) override { return logits(b); }

  // The encoder over one chunk of frames (frame_chunk), when it trains and
  // the frames take several chunks; the encoder's blocks run inside it.
  std::string frames_block() const { return prefix_ + "frames"; }

  std::vector<std::string> blocks() const override {
    auto out = vit_->block_names(prefix_);
    out.insert(out.begin(), frames_block());
    for (std::size_t i = 0; i < temporal_blocks_.size(); ++i) out.push_back("temporal.layers." + std::to_string(i));
    return out;
  }

  std::vector<std::pair<std::string, wick::Linear>> linear_layers() override {
    auto out = vit_->linear_layers(prefix_);
    for (std::size_t i = 0; i < temporal_blocks_.size(); ++i)
      for (const auto& [n, l] : temporal_blocks_[i]->linear_layers())
        out.emplace_back("temporal.layers." + std::to_string(i) + "." + n, l);
    return out;
  }

  bool deferred() const override { return wick::waits_for_values(*this, deferral_); }
  void materialize(const wick::Emit& emit) override { deferral_.run(emit); }

  std::map<std::string, wick::Value> attributes() const override {
    const auto& c = vit_->config();
    return {{"hidden_size", c.hidden}, {"image_size", c.image_size}, {"classes", classes_},
            {"temporal", temporal_},   {"style", c.style},           {"frozen_vision", freeze_}};
  }

 private:
  std::int64_t classes_, max_frames_ = 0;
  std::string temporal_, prefix_;
  bool freeze_;
  std::int64_t frame_chunk_;
  at::ScalarType dtype_ = at::kFloat;
  PixelStats stats_;
  Vit vit_{nullptr};
  wick::Deferral deferral_;  // deferred = true: the steps that make the frame encoder's weights
  at::Tensor temporal_pos_;
  std::vector<VitBlock> temporal_blocks_;
  torch::nn::LayerNorm temporal_norm_{nullptr};
  torch::nn::Linear classifier_{nullptr};
};

wick::OptionSchema schema() {
  wick::OptionSchema s = {
      wick::opt_int("classes", wick::Value(), "classes (data.num_classes)").at_least(1).required(),
      wick::opt_string("vision_path", wick::Value(),
                       "Hugging Face folder for the frame encoder (ViT, CLIPVision or CLIP); overrides the sizes")
          .optional(),
      wick::opt_bool("freeze_vision", false, "keep the frame encoder fixed (no gradients, no stored activations)"),
      wick::opt_string("temporal", "mean", "temporal module: mean of the frame features, or transformer")
          .one_of({"mean", "transformer"}),
      wick::opt_int("temporal_layers", 1, "temporal transformer blocks").at_least(1),
      wick::opt_int("temporal_heads", wick::Value(), "temporal attention heads (default: the encoder's)").at_least(1).optional(),
      wick::opt_int("frame_chunk", 0,
                    "frames through the encoder at a time (with checkpointing, a trained encoder's memory then "
                    "holds one chunk's activations whatever the frame count); 0: all at once").at_least(0),
      wick::opt_int("max_frames", 64, "frames the temporal position table covers (at least the data's max_frames)").at_least(1),
      wick::opt_string("dtype", "fp32", "weight dtype").one_of(wick::enum_names(wick::kDtypeNames)),
      wick::deferred_option("the frame encoder (the temporal module and head are built whole)")};
  for (auto& o : vit_options()) s.push_back(o);
  return s;
}

}  // namespace

WICK_PLUGIN(wick::plugin<VideoClassifier>(
    "video_classifier", "video classifier: a ViT per frame, then mean or a temporal transformer over the frames", schema()))
