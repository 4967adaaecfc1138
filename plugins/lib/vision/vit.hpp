#pragma once
// The Vision Transformer shared by the vision plugins (vit, video_classifier,
// clip, vlm): patch embedding, class token, learned position embeddings,
// pre-norm blocks, with Hugging Face's parameter names in two styles so
// folders saved by `transformers` load unchanged and wick's weights load back:
//   style "vit":  ViTModel      (embeddings.patch_embeddings.projection,
//                 encoder.layer.N.attention.attention.query, ..., layernorm, pooler.dense)
//   style "clip": CLIPVisionModel's vision_model (embeddings.patch_embedding,
//                 pre_layrnorm, encoder.layers.N.self_attn.q_proj, ..., post_layernorm)
// Built once into the static library wick_vision and linked into each plugin.

#include <wick/kit/deferral.hpp>
#include <wick/kit/json_fields.hpp>
#include <wick/kit/linear.hpp>
#include <wick/model.hpp>
#include <wick/options.hpp>
#include <wick/kit/weights.hpp>

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <string>
#include <vector>

namespace wick::vision {

struct VitConfig {
  std::string style = "vit";  ///< "vit" or "clip": parameter names and details (pre_layrnorm, final norm)
  std::int64_t image_size = 224, patch_size = 16, channels = 3;
  std::int64_t hidden = 768, intermediate = 3072, layers = 12, heads = 12;
  double eps = 1e-12;         ///< LayerNorm epsilon
  std::string act = "gelu";   ///< gelu (exact), quick_gelu, gelu_new / gelu_pytorch_tanh
  std::string pool = "cls";   ///< cls (class token) or mean (mean of the patch tokens)
  bool pooler = false;        ///< style vit: ViTModel's pooler (dense + tanh on the class token)
  bool qkv_bias = true;       ///< style vit: biases on query, key, value (ViTConfig.qkv_bias)
  /// A fresh encoder's initialisation, as transformers' _init_weights: style
  /// vit: weights normal(0, init_range); style clip: CLIP's scaled normals
  /// (q/k/v and fc2 D^-0.5 (2 layers)^-0.5, out_proj D^-0.5, fc1 (2D)^-0.5,
  /// each times init_factor). Biases 0, norms 1.
  double init_range = 0.02, init_factor = 1.0;
  /// Images of another size than image_size: the patch position embeddings
  /// bicubically interpolated to the image's patch grid, as transformers'
  /// interpolate_pos_encoding (not a config.json field: a run's choice).
  bool interpolate = false;
};

/// The config of a Hugging Face folder's config.json: a ViTConfig, a
/// CLIPVisionConfig, or a CLIPConfig (its vision_config). `where` names the
/// file in errors.
VitConfig config_from_hf(const nlohmann::json& config, const std::string& where);

/// Refuses a dtype (or torch_dtype) in `j` that wick does not load weights
/// in: the model is built in the dtype option, and a float64 folder would
/// otherwise be rounded to it unsaid.
void check_saved_dtype(const wick::JsonFields& j);

/// The options every vision plugin shares for its encoder (sizes, style,
/// pooling, image normalisation) and the config they describe.
std::vector<wick::OptionSpec> vit_options();
/// `prefix` names the size options of a model with other parts (the vlm's
/// "vision_": vision_style, vision_hidden_size, ...; image_size and
/// patch_size keep their names).
VitConfig config_from_options(const wick::Options& o, const std::string& prefix = "");
/// The key config_from_options(o, prefix) reads vit_options()' `name` under:
/// prefix + name, but image_size, patch_size and interpolate_pos_encoding
/// keep their names (a model has one picture size).
std::string vit_option_key(const std::string& name, const std::string& prefix);
/// vit_options()' `name` as a model with other parts declares it: under
/// vit_option_key(name, prefix), of the tower's type and range, with the
/// model's own default and doc (its choices list the default first).
wick::OptionSpec vit_option_as(const std::string& name, const std::string& prefix, wick::Value def, std::string doc);

/// One pre-norm transformer block, in either naming style:
///   vit:  ViTLayer (layernorm_before, attention.attention.{query,key,value},
///         attention.output.dense, layernorm_after, intermediate.dense, output.dense)
///   clip: CLIPEncoderLayer (layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2)
/// x + attn(ln1(x)), then x + mlp(ln2(x)). Also the layer of CLIP's text encoder
/// (causal, with a padding mask).
class VitBlockImpl : public torch::nn::Module {
 public:
  /// Initialised in fp32 as transformers' _init_weights (the caller
  /// converts it), or, with `init` false, made in `dtype` with nothing drawn
  /// (a folder's values fill it).
  explicit VitBlockImpl(const VitConfig& c, at::ScalarType dtype = at::kFloat, bool init = true);
  /// x [N, L, hidden]; mask: optional bool [N or 1, 1, L, L], true = may attend;
  /// causal: each position sees itself and the ones before (combined with mask).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& mask = {}, bool causal = false);
  /// The block's linear layers by their names inside the block (LoRA targets).
  std::vector<std::pair<std::string, wick::Linear>> linear_layers() const;

  wick::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};

 private:
  VitConfig c_;
  std::vector<std::pair<std::string, wick::Linear>> names_;
};
TORCH_MODULE(VitBlock);

/// The activation by Hugging Face's name (gelu, quick_gelu, gelu_new,
/// gelu_pytorch_tanh, relu, silu); `where` names the option or file in errors.
at::Tensor activation(const at::Tensor& x, const std::string& act);
void check_activation(const std::string& act, const std::string& where);

class VitImpl : public torch::nn::Module {
 public:
  /// Built in `dtype` part by part: each block (and the embeddings) is
  /// initialised in fp32 and converted before the next is made, so the
  /// encoder never exists whole in fp32 (a ViT-L/14 tower in bf16 peaks at
  /// its bf16 size plus one fp32 block while it is built).
  /// With `init` false its values come from a folder (load_vit_weights,
  /// defer_vit_weights): nothing is initialised, and the random generator is
  /// left as it was found.
  /// With `deferral` (a deferred build, wick/kit/deferred_build.hpp) the
  /// embeddings, blocks and pooler are made and then hollowed one at a
  /// time, the random generator moving on as a whole build moves it; with
  /// `init` each is a step of the deferral that makes it again. The norms
  /// are made whole.
  explicit VitImpl(VitConfig c, at::ScalarType dtype = at::kFloat, wick::Deferral* deferral = nullptr,
                   bool init = true);

  /// pixels: floating [N, 3, H, W], normalised. Returns the tokens after
  /// block `layer` (-1: the last, -2: the one before, ... as LLaVA's
  /// vision_feature_layer), [N, 1 + patches, hidden], as Hugging Face's
  /// last_hidden_state (style vit: after the final layernorm; style clip:
  /// before post_layernorm) for layer -1. Blocks run through owner->run_block
  /// (so the recipe can checkpoint them) when owner is given, under the names
  /// block_names(prefix).
  at::Tensor forward(const at::Tensor& pixels, wick::Model* owner = nullptr, const std::string& prefix = "",
                     int layer = -1);
  /// [N, hidden]: Hugging Face's pooler_output for pool = cls (style clip:
  /// post_layernorm of the class token; style vit: the pooler if present,
  /// else the class token), or the mean of the patch tokens for pool = mean.
  at::Tensor pool(const at::Tensor& tokens);
  /// Names of the blocks as run_block sees them: prefix + this module's path to block i.
  std::vector<std::string> block_names(const std::string& prefix) const;
  const VitConfig& config() const { return c_; }
  /// Patches per image: (image_size / patch_size)^2.
  std::int64_t num_patches() const { return (c_.image_size / c_.patch_size) * (c_.image_size / c_.patch_size); }
  /// The position embeddings [1, 1 + patches, D] for an H x W image of
  /// `patches` patches: the table itself, or interpolated (VitConfig::interpolate).
  at::Tensor positions(std::int64_t H, std::int64_t W, std::int64_t patches);
  /// Whether images of another size are taken (VitConfig::interpolate).
  void set_interpolate(bool on) { c_.interpolate = on; }
  /// The encoder blocks, in order.
  std::vector<VitBlock> layers() const { return blocks_; }
  /// Every block's linear layers, named prefix + path (LoRA targets).
  std::vector<std::pair<std::string, wick::Linear>> linear_layers(const std::string& prefix) const;
  /// Hugging Face's config.json fields for this encoder (a ViTConfig or a CLIPVisionConfig).
  nlohmann::json hf_config() const;

 private:
  VitConfig c_;
  std::vector<VitBlock> blocks_;
  torch::nn::Conv2d patch_{nullptr};
  at::Tensor cls_, pos_;             // views of the class token and position table parameters
  torch::nn::LayerNorm pre_{nullptr}, final_{nullptr};
  torch::nn::Linear pooler_{nullptr};
};
TORCH_MODULE(Vit);

/// Per-channel image statistics for normalize_pixels.
struct PixelStats {
  std::vector<double> mean, std;
};
/// The standard statistics of a style: clip -> OpenAI CLIP's, vit -> 0.5 / 0.5
/// (Hugging Face's ViT image processor).
PixelStats default_pixel_stats(const std::string& style);
/// image_mean / image_std from vit_options(), else the style's defaults;
/// `who` names the plugin in errors.
PixelStats pixel_stats_from_options(const wick::Options& o, const std::string& style, const std::string& who);
/// A folder's preprocessor_config.json image_mean / image_std when it has one,
/// else `fallback`.
PixelStats pixel_stats_from_folder(const std::string& dir, const PixelStats& fallback);

/// Reads a JSON file; errors name the file.
nlohmann::json read_json_file(const std::string& file);
/// The tensors of a Hugging Face folder: model.safetensors or the shards
/// model.safetensors.index.json names. `who` names the plugin in errors.
wick::NamedTensorList read_hf_weights(const std::string& dir, const std::string& who);
/// Where the encoder's tensors start in a file's names: "" (ViTModel,
/// CLIPVisionModel), "vit." (ViTForImageClassification), "vision_model."
/// (CLIPModel, older CLIPVisionModel), "vision_tower.vision_model." (LLaVA),
/// ...: the part before the style's patch embedding name. Throws, naming
/// `source`, when there is none or more than one.
std::string find_vit_prefix(const wick::NamedTensorList& tensors, const std::string& style, const std::string& source);
/// Whether the file holds ViTModel's pooler under prefix.
bool has_vit_pooler(const wick::NamedTensorList& tensors, const std::string& prefix);
/// Loads the encoder's weights from `tensors` (names under `prefix`; the
/// transformers 5 ViT names layers.N.attention.q_proj, ... are accepted too).
/// Everything of the encoder must be there; tensors outside it are ignored.
/// The list is consumed, each tensor dropped as it lands, so a mapped
/// file's pages go as they are read (move the list in when it is no longer
/// needed; a copy keeps the caller's views, and the pages, alive).
void load_vit_weights(VitImpl& vit, wick::NamedTensorList tensors, const std::string& prefix,
                      const std::string& source);
/// The same for a deferred encoder (built with a deferral and init false):
/// the names and shapes checked now, and a step of `deferral` recorded that
/// hands each of the file's tensors to the encoder's when the host wants them.
void defer_vit_weights(VitImpl& vit, wick::NamedTensorList tensors, const std::string& prefix,
                       const std::string& source, wick::Deferral& deferral);
/// A folder's vision encoder in one call: config.json (ViT, CLIPVision, CLIP
/// or a config with a vision_config such as LLaVA's) and its weights. `pool`
/// overrides the config's pooling when not empty. With `deferral` the
/// encoder is built deferred and its weights are read when the host makes them.
Vit vit_from_folder(const std::string& dir, const std::string& who, const std::string& pool = "",
                    at::ScalarType dtype = at::kFloat, wick::Deferral* deferral = nullptr);

/// Converts a module made in fp32 (random initialisation) to `dtype` in place;
/// the vision plugins call it on each part as it is made, so no model exists
/// whole in fp32 before it is converted.
void convert_module(torch::nn::Module& m, at::ScalarType dtype);

/// uint8 images [..., 3, H, W] (as image_folder / video_folder give them, on
/// any device) to floating pixels normalised by mean and std per channel, in
/// `dtype`; a floating input is taken as already normalised and only cast.
at::Tensor normalize_pixels(const at::Tensor& images, const std::vector<double>& mean, const std::vector<double>& std,
                            at::ScalarType dtype);

}  // namespace wick::vision
