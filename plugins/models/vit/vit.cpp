// model `vit`: a Vision Transformer image classifier, or (classes = 0) an
// image encoder. Batches: `image` uint8 [N, 3, H, W] as image_folder gives
// them (normalised on the device by image_mean / image_std) or floating
// pixels already normalised, and `label` [N]. Loads a Hugging Face ViTModel,
// ViTForImageClassification, CLIPVisionModel or CLIPModel folder (`path`).
// Parameter names: vit.* + classifier.* (style vit, as
// ViTForImageClassification) or vision_model.* + classifier.* (style clip).

#include <wick/kit/deferred_build.hpp>
#include <wick/kit/linear.hpp>
#include <wick/model.hpp>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <filesystem>

#include "lib/vision/plugin_util.hpp"
#include "lib/vision/vit.hpp"

namespace fs = std::filesystem;
using namespace wick::vision;

namespace {

class VitModel : public wick::Model, public wick::Predictor, public wick::AdapterTargets, public wick::Deferred {
 public:
  explicit VitModel(const wick::Options& o)
      : classes_(o.get_int("classes")), output_(o.get_string("output")), dtype_(dtype_named(o.get_string("dtype"))) {
    wick::Deferral* deferral = o.get_bool("deferred") ? &deferral_ : nullptr;
    if (o.has("path")) {
      const std::string dir = o.get_string("path");
      const std::string cfg_file = (fs::path(dir) / "config.json").string();
      if (!fs::exists(cfg_file)) throw wick::Error("vit: path " + dir + " has no config.json (expected a Hugging Face model folder)");
      VitConfig c = config_from_hf(read_json_file(cfg_file), cfg_file);
      c.pool = o.get_string("pool");
      auto tensors = read_hf_weights(dir, "vit");
      const std::string prefix = find_vit_prefix(tensors, c.style, dir);
      c.pooler = c.style == "vit" && has_vit_pooler(tensors, prefix);
      build(c, deferral, /*init=*/false);
      // a classification folder's head, when it has this many classes
      at::Tensor head_w, head_b;
      for (const auto& [name, t] : tensors) {
        if (name == "classifier.weight") head_w = t;
        if (name == "classifier.bias") head_b = t;
      }
      if (classifier_ && head_w.defined() && head_w.sizes() == classifier_->weight.sizes()) {
        at::NoGradGuard g;
        classifier_->weight.copy_(head_w);
        if (head_b.defined()) classifier_->bias.copy_(head_b);
      }
      head_w = head_b = at::Tensor();
      if (deferral)  // each tensor read when the host makes it
        defer_vit_weights(*vit_, std::move(tensors), prefix, dir, *deferral);
      else  // each tensor's pages released as it lands
        load_vit_weights(*vit_, std::move(tensors), prefix, dir);
      stats_ = pixel_stats_from_folder(dir, pixel_stats_from_options(o, c.style, "vit"));
    } else {
      VitConfig c = config_from_options(o);
      c.pooler = o.get_bool("pooler") && c.style == "vit";
      build(c, deferral, /*init=*/true);
      stats_ = pixel_stats_from_options(o, c.style, "vit");
    }
    vit_->set_interpolate(o.get_bool("interpolate_pos_encoding"));
    if (dtype_ != at::kFloat) to(dtype_);  // the head; the encoder was built in dtype_
  }

  // the encoder (initialised, or for a folder's values; deferred with a deferral) and the head
  void build(const VitConfig& c, wick::Deferral* deferral, bool init) {
    prefix_ = c.style == "vit" ? "vit." : "vision_model.";
    vit_ = register_module(c.style == "vit" ? "vit" : "vision_model", Vit(c, dtype_, deferral, init));
    if (classes_ > 0) {
      classifier_ = register_module("classifier", torch::nn::Linear(c.hidden, classes_));
      at::NoGradGuard g;  // as transformers' _init_weights
      classifier_->weight.normal_(0.0, c.init_range);
      classifier_->bias.zero_();
    }
  }

  at::Tensor pixels(const wick::Batch& b) {
    auto it = b.find("image");
    const at::Tensor& img = it != b.end() ? it->second
                                          : batch_tensor(b, "pixel_values", "vit", "images [N, 3, H, W]: 'image' or 'pixel_values'");
    return normalize_pixels(img, stats_.mean, stats_.std, dtype_);
  }

  at::Tensor logits(const wick::Batch& b) {
    at::Tensor tokens = vit_->forward(pixels(b), this, prefix_);
    return classifier_->forward(vit_->pool(tokens));
  }

  wick::ForwardResult forward(const wick::Batch& b) override {
    if (!classifier_)
      throw wick::Error("vit: this model has no classification head (classes = 0): set classes to train it, or use "
                        "predict() for its features");
    at::Tensor y = checked_labels(b, classes_, "vit");
    return classification(logits(b), y);
  }

  at::Tensor predict(const wick::Batch& b) override {
    const std::string out = output_ == "auto" ? (classifier_ ? "logits" : "hidden") : output_;
    if (out == "logits") {
      if (!classifier_) throw wick::Error("vit: output = \"logits\" needs a classification head (classes > 0)");
      return logits(b);
    }
    at::Tensor tokens = vit_->forward(pixels(b), this, prefix_);
    return out == "hidden" ? tokens : vit_->pool(tokens);
  }

  std::vector<std::string> blocks() const override { return vit_->block_names(prefix_); }

  std::vector<std::pair<std::string, wick::Linear>> linear_layers() override { return vit_->linear_layers(prefix_); }

  // deferred = true: the encoder waits for the host (the head is made whole)
  bool deferred() const override { return wick::waits_for_values(*this, deferral_); }
  void materialize(const wick::Emit& emit) override { deferral_.run(emit); }

  std::map<std::string, wick::Value> attributes() const override {
    const auto& c = vit_->config();
    std::map<std::string, wick::Value> a = {{"hidden_size", c.hidden},   {"image_size", c.image_size},
                                            {"patch_size", c.patch_size}, {"layers", c.layers},
                                            {"classes", classes_},        {"style", c.style}};
    nlohmann::json j = vit_->hf_config();
    if (c.style == "vit") {
      j["architectures"] = {classes_ > 0 ? "ViTForImageClassification" : "ViTModel"};
      if (classes_ > 0) {
        nlohmann::json id2label = nlohmann::json::object(), label2id = nlohmann::json::object();
        for (std::int64_t i = 0; i < classes_; ++i) {
          id2label[std::to_string(i)] = "LABEL_" + std::to_string(i);
          label2id["LABEL_" + std::to_string(i)] = i;
        }
        j["id2label"] = id2label;
        j["label2id"] = label2id;
      }
      a["hf_config"] = j.dump(2);
    } else if (classes_ == 0) {
      j["architectures"] = {"CLIPVisionModel"};
      a["hf_config"] = j.dump(2);
    }
    return a;
  }

 private:
  std::int64_t classes_;
  std::string output_, prefix_;
  at::ScalarType dtype_ = at::kFloat;
  PixelStats stats_;
  Vit vit_{nullptr};
  torch::nn::Linear classifier_{nullptr};
  wick::Deferral deferral_;  // deferred = true: the steps that make the encoder's weights
};

wick::OptionSchema schema() {
  wick::OptionSchema s = {
      wick::opt_string("path", wick::Value(),
                       "Hugging Face folder (ViTModel, ViTForImageClassification, CLIPVisionModel or CLIPModel); "
                       "overrides the sizes")
          .optional(),
      wick::opt_int("classes", 0, "classes of the linear head on the pooled features (0: encoder only)").at_least(0),
      wick::opt_bool("pooler", false, "style vit: ViTModel's pooler (dense + tanh on the class token); a folder decides itself"),
      wick::opt_string("output", "auto", "what predict() gives: logits, pooled features, hidden (last_hidden_state), or auto "
                                         "(logits with a head, else hidden)")
          .one_of({"auto", "logits", "pooled", "hidden"}),
      wick::opt_string("dtype", "fp32", "weight dtype").one_of(wick::enum_names(wick::kDtypeNames)),
      wick::deferred_option("the encoder (the classification head is built whole)")};
  for (auto& o : vit_options()) s.push_back(o);
  return s;
}

}  // namespace

WICK_PLUGIN(wick::plugin<VitModel>("vit", "Vision Transformer image classifier or encoder (Hugging Face ViT / CLIP names and folders)",
                                         schema()))
