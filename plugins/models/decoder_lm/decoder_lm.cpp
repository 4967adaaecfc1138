// model `decoder_lm`: the LLaMA / Qwen2 decoder (decoder.hpp: token embedding,
// RMSNorm, rotary position embeddings, grouped-query attention through
// LibTorch's scaled-dot-product attention with a causal mask, SwiGLU MLP,
// optional q/k/v bias, tied or separate output head), with Hugging Face's
// parameter names, so a folder saved by `transformers` loads unchanged and
// wick's weights load back into `transformers`.
//
// Batches: input_ids [B, T] (int64), labels [B, T] (-100 = ignored; shifted
// inside, as Hugging Face does). Items are the target tokens.

#include <wick/kit/linear.hpp>
#include <wick/model.hpp>
#include <wick/kit/weights.hpp>

#include "lib/decoder/decoder.hpp"

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <filesystem>
#include <map>
#include <memory>

namespace fs = std::filesystem;
namespace dec = wick::decoder;

namespace {

dec::Config config_of(const wick::Options& o, const nlohmann::json* hf, const fs::path& dir) {
  if (hf) return dec::config_from_hf(*hf, "decoder_lm: " + (dir / "config.json").string());
  dec::Config c = dec::config_from_options(o);
  dec::finish_config(c, "decoder_lm");
  return c;
}

// Quantizing's float temporaries, freed between the small NF4 tensors that
// stay, would otherwise leave the heap fragmented and resident (glibc keeps
// freed chunks below its growing mmap threshold): handed back after each.
void release_free_heap() {
#ifdef __GLIBC__
  ::malloc_trim(0);
#endif
}

class DecoderLM : public wick::Model, public wick::Predictor, public wick::Generator, public wick::AdapterTargets {
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
    dec::Build b;
    b.dtype = c.dtype == "bf16" ? at::kBFloat16 : c.dtype == "fp16" ? at::kHalf : at::kFloat;
    b.init = !hf;
    b.defer_linear = hf && nf4;
    dec_ = std::make_unique<dec::Decoder>(c, "model", b);
    dec_->register_with(*this, "model", *this);
    std::map<std::string, wick::Linear> quantized;  // "<layer>.weight" -> the layer
    if (nf4) {
      for (auto& [name, lin] : dec_->linear_layers()) {
        const std::int64_t n = lin->in_features * lin->out_features;
        if (n % block != 0 || n % 2 != 0)
          throw wick::Error("decoder_lm: quantize_block " + std::to_string(block) + " does not divide layer " + name +
                            "'s " + std::to_string(n) + " weights, expected a block size that divides every linear "
                            "layer's weight count (an even count)");
        quantized.emplace(name + ".weight", lin);
      }
    }
    if (hf) {
      // each tensor lands (or is quantized) and its pages are released before the next
      wick::load_state(*this, std::move(weights), dir.string(), dec_->ignored_on_load(),
                       [&](const std::string& name, const at::Tensor& t) {
                         auto it = quantized.find(name);
                         if (it == quantized.end()) return false;
                         it->second->quantize_nf4_from(t, at::kBFloat16, block);
                         release_free_heap();
                         return true;
                       });
    } else {
      for (auto& [name, lin] : quantized) lin->quantize_nf4(at::kBFloat16, block);
    }
    dec_->set_loss_chunk(o.get_int("loss_chunk"));
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
    return dec_->loss_from_hidden(dec_->hidden(dec_->embed(b.at("input_ids")), this), labels_of(b));
  }

  at::Tensor predict(const wick::Batch& b) override { return dec_->logits(b.at("input_ids"), this); }

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

  std::map<std::string, wick::Value> attributes() const override {
    const auto& c = dec_->config();
    return {{"vocab_size", c.vocab}, {"hidden_size", c.hidden}, {"layers", c.layers}, {"family", c.family},
            {"tie_embeddings", c.tie}, {"hf_config", dec::hf_config(c).dump(2)}};
  }

 private:
  std::unique_ptr<dec::Decoder> dec_;
};

wick::OptionSchema schema() {
  wick::OptionSchema s = {wick::opt_string("path", wick::Value(),
                                           "Hugging Face model folder (config.json + safetensors); overrides the sizes below")
                              .optional()};
  for (auto& o : dec::size_options()) s.push_back(o);
  s.push_back(wick::opt_string("dtype", wick::Value(),
                               "weight dtype; default: the folder's (config.json's torch_dtype) with `path`, else fp32")
                  .one_of({"fp32", "bf16", "fp16"})
                  .optional());
  s.push_back(wick::opt_string("quantize", "none",
                               "nf4: every linear layer but the head is stored as 4-bit NF4 (double-quantized constants, "
                               "as optim 'qlora' stores it), each weight quantized as its tensor is read, so the "
                               "full-precision model never exists; qlora over it keeps these weights")
                  .one_of({"none", "nf4"}));
  s.push_back(wick::opt_int("quantize_block", 64, "weights per NF4 block with quantize = \"nf4\"").at_least(2));
  for (auto& o : dec::loss_options()) s.push_back(o);
  return s;
}

}  // namespace

WICK_PLUGIN(wick::plugin<DecoderLM>("decoder_lm",
                                          "LLaMA/Qwen2 decoder language model (Hugging Face names and folders)", schema()))
