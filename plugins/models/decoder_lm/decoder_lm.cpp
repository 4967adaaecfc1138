// model `decoder_lm`: the LLaMA / Mistral / Qwen2 / Qwen3 / Phi-3 / Gemma 2 / Gemma 3 decoder
// (decoder.hpp: token embedding, RMSNorm, rotary position embeddings, partial
// with Phi-3, grouped-query attention through LibTorch's scaled-dot-product
// attention with a causal or sliding-window mask, SwiGLU MLP, optional q/k/v
// bias, Qwen3's q/k norms, Phi-3's fused projections, Gemma's (1 + weight)
// norms, scaled embedding, GeGLU, sandwich norms and soft-capping, tied or
// separate output head), with Hugging Face's
// parameter names, so a folder saved by `transformers` loads unchanged and
// wick's weights load back into `transformers`.
//
// Batches: input_ids [B, T] (int64), labels [B, T] (-100 = ignored; shifted
// inside, as Hugging Face does), optional position_ids [B, T] (documents
// packed into rows: rotary positions restarting at each, and attention
// within each document only). Items are the target tokens.

#include <wick/kit/early_host.hpp>
#include <wick/kit/linear.hpp>
#include <wick/kit/dtype_names.hpp>
#include <wick/model.hpp>
#include <wick/kit/weights.hpp>

#include "lib/decoder/decoder.hpp"

#include <filesystem>
#include <map>
#include <memory>

namespace fs = std::filesystem;
namespace dec = wick::decoder;

namespace {

dec::Config config_of(const wick::Options& o, const nlohmann::json* hf, const fs::path& dir) {
  if (hf) return dec::config_from_hf(*hf, "decoder_lm: " + (dir / "config.json").string());
  dec::Config c = dec::config_from_options(o);
  if (o.has("dtype")) c.dtype = o.get_string("dtype");  // built in it: the size check counts it
  dec::finish_config(c, "decoder_lm", /*hf=*/false, o.get_string("quantize") == "nf4");
  return c;
}

class DecoderLM : public wick::Model,
                  public wick::Predictor,
                  public wick::Generator,
                  public wick::AdapterTargets,
                  public wick::Deferred,
                  public wick::HostLookups {
 public:
  explicit DecoderLM(const wick::Options& o) {
    std::unique_ptr<nlohmann::json> hf;
    fs::path dir;
    wick::NamedTensorList weights;
    if (o.has("path")) {
      dir = o.get_string("path");
      hf = std::make_unique<nlohmann::json>(dec::read_json(dir / "config.json"));
    }
    dec::Config c = config_of(o, hf.get(), dir);
    if (hf) {
      weights = dec::read_folder(dir, "decoder_lm");  // views of the mapped files: nothing copied yet
      dec::untie_if_distinct(c, weights, "model.embed_tokens.weight", "lm_head.weight", "decoder_lm: " + dir.string());
    }
    // the dtype: the option when given, else the folder's, else fp32
    if (o.has("dtype")) c.dtype = o.get_string("dtype");
    if (c.dtype.empty()) c.dtype = "fp32";
    const bool nf4 = o.get_string("quantize") == "nf4";
    const std::int64_t block = o.get_int("quantize_block");
    if (nf4) dec::check_nf4_block(c, block, "model", "decoder_lm");
    dec::Build b;
    b.dtype = wick::parse_enum(wick::kDtypeNames, c.dtype, "dtype");
    b.init = !hf;
    b.defer_linear = hf && nf4;          // a folder's weights arrive quantized, tensor by tensor
    b.quantize_block = nf4 ? block : 0;  // random ones are quantized layer by layer as they are made
    if (o.get_bool("deferred")) b.deferral = &deferral_;
    dec_ = std::make_unique<dec::Decoder>(c, "model", b);
    dec_->register_with(*this, "model", *this);
    if (hf && b.deferral)
      dec::defer_loading(*this, std::move(weights), dir.string(), dec_->ignored_on_load(), dec_->linear_layers(),
                         nf4 ? block : 0, deferral_);
    else if (hf)
      dec::load_quantizing(*this, std::move(weights), dir.string(), dec_->ignored_on_load(), dec_->linear_layers(),
                           nf4 ? block : 0);
    dec_->set_loss_chunk(o.has("loss_chunk") ? o.get_int("loss_chunk") : dec::kDefaultLossChunk);
    source_ = dir.string();
  }

  static at::Tensor labels_of(const wick::Batch& b) {
    auto it = b.find("labels");
    return it != b.end() ? it->second : b.at("input_ids");
  }

  std::int64_t count_items(const wick::Batch& b) const override {
    const at::Tensor labels = labels_of(b);
    return labels.narrow(1, 1, labels.size(1) - 1).ne(dec::kIgnore).sum().item<std::int64_t>();
  }

  wick::ForwardResult forward(const wick::Batch& b) override {
    dec_->check_nf4_training("decoder_lm", "model:freeze");
    const at::Tensor labels = labels_of(b);
    wick::EarlyHost host_labels(labels);  // for the loss's checks, copied before the forward's kernels are queued
    const at::Tensor h = dec_->hidden(dec_->embed(b.at("input_ids")), this, nullptr, 0, positions_of(b));
    return dec_->loss_from_hidden(h, labels, host_labels.get());
  }

  at::Tensor predict(const wick::Batch& b) override {
    return dec_->head(dec_->hidden(dec_->embed(b.at("input_ids")), this, nullptr, 0, positions_of(b)));
  }

  // packed documents' positions (data 'text' with pack_attention = "document"), or undefined
  static at::Tensor positions_of(const wick::Batch& b) {
    auto it = b.find("position_ids");
    return it != b.end() ? it->second : at::Tensor();
  }

  // Greedy or sampled continuation with a key/value cache: the prompt once,
  // then one position per new token.
  std::vector<std::int64_t> generate(const std::vector<std::int64_t>& prompt, const wick::GenerateOptions& g) override {
    const bool was_training = is_training();
    train(false);
    auto out = dec_->generate(prompt, g, "decoder_lm");
    train(was_training);
    return out;
  }

  std::string item_name() const override { return "tokens"; }
  std::vector<std::string> blocks() const override { return dec_->blocks(); }
  std::vector<std::pair<std::string, wick::Linear>> linear_layers() override { return dec_->linear_layers(); }

  bool deferred() const override { return wick::waits_for_values(*this, deferral_); }
  // offload_embeddings: the language model's input embedding, when untied
  std::vector<at::Tensor> host_lookup_tables() override { return dec_->host_lookup_tables(); }
  std::string host_lookup_refusal() const override { return dec_->host_lookup_refusal(); }
  void materialize(const wick::Emit& emit) override { deferral_.run(emit); }

  std::map<std::string, wick::Value> attributes() const override {
    const auto& c = dec_->config();
    return {{"vocab_size", c.vocab}, {"hidden_size", c.hidden}, {"layers", c.layers}, {"family", c.family},
            {"tie_embeddings", c.tie}, {"hf_config", dec::hf_config(c).dump(2)},
            {"nf4_layers", dec_->nf4_layers()},  // 4-bit layers (save_pretrained writes them dequantized)
            // the folder it was read from ("" when made from options): save_pretrained copies its
            // tokenizer files, chat template and generation_config.json
            {"source_path", source_}};
  }

 private:
  wick::Deferral deferral_;  // deferred = true: the steps that make the weights
  std::unique_ptr<dec::Decoder> dec_;
  std::string source_;
};

wick::OptionSchema schema() {
  wick::OptionSchema s = {wick::opt_string("path", wick::Value(),
                                           "Hugging Face model folder (config.json + safetensors); overrides the sizes below")
                              .optional()};
  for (auto& o : dec::size_options()) s.push_back(o);
  s.push_back(wick::opt_string("dtype", wick::Value(),
                               "weight dtype; default: the folder's (config.json's torch_dtype) with `path`, else fp32")
                  .one_of(wick::enum_names(wick::kDtypeNames))
                  .optional());
  for (auto& o : dec::quantize_options()) s.push_back(o);
  for (auto& o : dec::loss_options()) s.push_back(o);
  s.push_back(wick::deferred_option("the model"));
  return s;
}

}  // namespace

WICK_PLUGIN(wick::plugin<DecoderLM>("decoder_lm",
                                          "LLaMA/Mistral/Qwen2/Qwen3/Phi-3/Gemma 2/Gemma 3 decoder language model (Hugging Face names and folders)", schema()))
