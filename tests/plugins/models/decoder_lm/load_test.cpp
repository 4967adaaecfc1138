// Loading a Hugging Face folder into decoder_lm: the model is built in the
// folder's dtype (config.json's torch_dtype) unless the dtype option says
// otherwise, and holds exactly the file's values; with quantize = "nf4" each
// linear weight becomes NF4 as its tensor is read, byte for byte what optim
// 'qlora' makes from the fully loaded model, and qlora over such a model
// keeps those weights (a different block_size is refused by name).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "../../../test_util.hpp"
#include "wick/kit/linear.hpp"
#include "wick/kit/safetensors.hpp"
#include "wick/kit/weights.hpp"
#include "wick/model.hpp"
#include "wick/optim.hpp"

using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace wick {
namespace {

std::map<std::string, Value> sizes() {
  return {{"vocab_size", Value(std::int64_t{96})}, {"hidden_size", Value(std::int64_t{64})},
          {"intermediate_size", Value(std::int64_t{128})}, {"layers", Value(std::int64_t{2})},
          {"heads", Value(std::int64_t{4})}, {"kv_heads", Value(std::int64_t{2})},
          {"family", Value(std::string("qwen2"))}};
}

// A bf16 folder (config.json saying so, model.safetensors) of a random
// decoder; returns its tensors as written.
NamedTensorList write_bf16_folder(const fs::path& dir) {
  at::manual_seed(7);
  auto o = sizes();
  o["dtype"] = Value(std::string("bf16"));
  auto m = test::make<Model>("decoder_lm", PluginKind::Model, o);
  NamedTensorList tensors;
  for (auto& [n, t] : module_state(*m)) tensors.emplace_back(n, t.detach().clone());
  fs::create_directories(dir);
  write_safetensors(dir / "model.safetensors", tensors, {{"format", "pt"}});
  auto cfg = nlohmann::json::parse(std::get<std::string>(m->attributes().at("hf_config").v));
  EXPECT_EQ(cfg["torch_dtype"], "bfloat16");
  std::ofstream(dir / "config.json") << cfg.dump();
  return tensors;
}

std::shared_ptr<Model> load(const fs::path& dir, std::map<std::string, Value> extra = {}) {
  extra["path"] = Value(dir.string());
  return test::make<Model>("decoder_lm", PluginKind::Model, extra);
}

std::map<std::string, at::Tensor> state_of(Model& m) {
  std::map<std::string, at::Tensor> out;
  for (auto& [n, t] : module_state(m)) out[n] = t;
  return out;
}

TEST(DecoderLoad, ABf16FolderLoadsAsBf16EqualToTheFile) {
  test::TempDir dir;
  auto file = write_bf16_folder(dir.path / "m");
  auto m = load(dir.path / "m");
  auto got = state_of(*m);
  ASSERT_EQ(got.size(), file.size());
  for (auto& [n, t] : file) {
    ASSERT_TRUE(got.count(n)) << n;
    EXPECT_EQ(got[n].scalar_type(), at::kBFloat16) << n;
    EXPECT_TRUE(at::equal(got[n], t)) << n;
  }
}

TEST(DecoderLoad, AnExplicitDtypeWinsOverTheFolders) {
  test::TempDir dir;
  auto file = write_bf16_folder(dir.path / "m");
  auto m = load(dir.path / "m", {{"dtype", Value(std::string("fp32"))}});
  auto got = state_of(*m);
  for (auto& [n, t] : file) {
    EXPECT_EQ(got[n].scalar_type(), at::kFloat) << n;
    EXPECT_TRUE(at::equal(got[n], t.to(at::kFloat))) << n;
  }
}

TEST(DecoderLoad, AFolderWithoutADtypeLoadsAsFp32) {
  test::TempDir dir;
  auto file = write_bf16_folder(dir.path / "m");
  auto cfg = nlohmann::json::parse(std::ifstream(dir.path / "m" / "config.json"));
  cfg.erase("torch_dtype");
  std::ofstream(dir.path / "m" / "config.json") << cfg.dump();
  auto got = state_of(*load(dir.path / "m"));
  for (auto& [n, t] : file) EXPECT_EQ(got[n].scalar_type(), at::kFloat) << n;
}

// The NF4 tensors of every quantized layer, by "<layer>.nf4.<part>".
std::map<std::string, at::Tensor> nf4_state(Model& m) {
  std::map<std::string, at::Tensor> out;
  for (auto& [n, t] : module_state(m))
    if (n.find(".nf4.") != std::string::npos) out[n] = t;
  return out;
}

TEST(DecoderLoad, QuantizingOnLoadEqualsQuantizingTheLoadedModel) {
  test::TempDir dir;
  write_bf16_folder(dir.path / "m");
  for (std::int64_t block : {64, 32}) {
    auto q_on_load = load(dir.path / "m", {{"quantize", Value(std::string("nf4"))}, {"quantize_block", Value(block)}});
    auto full = load(dir.path / "m");
    auto qlora = test::make<Transform>("qlora", PluginKind::Optim, {{"block_size", Value(block)}});
    qlora->apply(*full);
    auto a = nf4_state(*q_on_load), b = nf4_state(*full);
    ASSERT_EQ(a.size(), 2u * 7u * 4u);  // 2 layers, 7 linear layers each, 4 tensors each
    ASSERT_EQ(a.size(), b.size());
    for (auto& [n, t] : b) {
      ASSERT_TRUE(a.count(n)) << n;
      EXPECT_EQ(a[n].scalar_type(), t.scalar_type()) << n;
      EXPECT_TRUE(at::equal(a[n], t)) << n << " block " << block;
    }
    // no float weight of a quantized layer is left, and the rest is the file's
    for (auto& [n, t] : state_of(*q_on_load)) EXPECT_FALSE(n.ends_with("_proj.weight")) << n;
    auto* targets = dynamic_cast<AdapterTargets*>(q_on_load.get());
    ASSERT_NE(targets, nullptr);
    for (auto& [n, lin] : targets->linear_layers()) EXPECT_EQ(lin->nf4_block(), block) << n;
  }
}

TEST(DecoderLoad, QloraKeepsWeightsQuantizedOnLoad) {
  test::TempDir dir;
  write_bf16_folder(dir.path / "m");
  auto m = load(dir.path / "m", {{"quantize", Value(std::string("nf4"))}, {"quantize_block", Value(std::int64_t{32})}});
  auto before = nf4_state(*m);
  auto qlora = test::make<Transform>("qlora", PluginKind::Optim, {{"r", Value(std::int64_t{4})}});
  qlora->apply(*m);  // block_size left out: the model's 32
  auto after = nf4_state(*m);
  ASSERT_EQ(before.size(), after.size());
  for (auto& [n, t] : before) EXPECT_EQ(after[n].data_ptr(), t.data_ptr()) << n << " was quantized again";
  auto attrs = qlora->attributes();
  EXPECT_EQ(std::get<std::int64_t>(attrs.at("layers").v), 14);
  EXPECT_GT(std::get<std::int64_t>(attrs.at("base_bytes").v), 0);
  // and the adapted model runs
  at::Tensor ids = at::randint(0, 96, {2, 9});
  auto r = m->forward({{"input_ids", ids}});
  EXPECT_TRUE(std::isfinite(r.loss_sum.item<double>()));
}

TEST(DecoderLoad, QloraRefusesAnotherBlockSizeThanTheModelsByName) {
  test::TempDir dir;
  write_bf16_folder(dir.path / "m");
  auto m = load(dir.path / "m", {{"quantize", Value(std::string("nf4"))}, {"quantize_block", Value(std::int64_t{32})}});
  auto qlora = test::make<Transform>("qlora", PluginKind::Optim, {{"block_size", Value(std::int64_t{64})}});
  EXPECT_THAT(test::error_of([&] { qlora->apply(*m); }),
              HasSubstr("optim 'qlora': layer model.layers.0.self_attn.q_proj was quantized on load in blocks of 32 "
                        "(the model's quantize_block), block_size is 64"));
}

TEST(DecoderLoad, QuantizingARandomModelEqualsQloraOnIt) {
  auto o = sizes();
  at::manual_seed(3);
  auto plain = test::make<Model>("decoder_lm", PluginKind::Model, o);
  o["quantize"] = Value(std::string("nf4"));
  at::manual_seed(3);
  auto quantized = test::make<Model>("decoder_lm", PluginKind::Model, o);
  test::make<Transform>("qlora", PluginKind::Optim)->apply(*plain);
  auto a = nf4_state(*quantized), b = nf4_state(*plain);
  ASSERT_EQ(a.size(), b.size());
  for (auto& [n, t] : b) EXPECT_TRUE(at::equal(a.at(n), t)) << n;
}

TEST(DecoderLoad, AQuantizeBlockThatDoesNotDivideALayerIsRefused) {
  test::TempDir dir;
  write_bf16_folder(dir.path / "m");
  EXPECT_THAT(test::error_of([&] {
                load(dir.path / "m", {{"quantize", Value(std::string("nf4"))}, {"quantize_block", Value(std::int64_t{48})}});
              }),
              HasSubstr("decoder_lm: quantize_block 48 does not divide layer model.layers.0.self_attn.q_proj's 4096 weights"));
}

// Qwen2's sliding window loads, whichever layers slide (the window's mask
// is checked against transformers in tests/reference); a layer_types whose
// length is not the layer count is refused by name.
TEST(DecoderLoad, Qwen2SlidingWindowLoads) {
  test::TempDir dir;
  write_bf16_folder(dir.path / "m");
  auto cfg = nlohmann::json::parse(std::ifstream(dir.path / "m" / "config.json"));
  auto with = [&](nlohmann::json changes) {
    auto c = cfg;
    c.update(changes);
    std::ofstream(dir.path / "m" / "config.json") << c.dump();
    return test::error_of([&] { load(dir.path / "m"); });
  };
  EXPECT_EQ(with({{"use_sliding_window", false}, {"sliding_window", 4}, {"max_window_layers", 0}}), "");
  EXPECT_EQ(with({{"use_sliding_window", true}, {"sliding_window", nullptr}, {"max_window_layers", 0}}), "");
  EXPECT_EQ(with({{"use_sliding_window", true}, {"sliding_window", 4}, {"max_window_layers", 1}}), "");
  EXPECT_EQ(with({{"use_sliding_window", true}, {"sliding_window", 4},
                  {"layer_types", {"sliding_attention", "full_attention"}}}), "");
  EXPECT_THAT(with({{"use_sliding_window", true}, {"sliding_window", 4}, {"layer_types", {"sliding_attention"}}}),
              HasSubstr("config.json: layer_types is [\"sliding_attention\"], expected one entry per layer "
                        "(num_hidden_layers 2), not 1"));
}

// 4-bit linear layers do not train: a training forward of a 4-bit model
// without adapters is refused while every other weight would train, and goes
// on with adapters, with anything frozen on purpose, or without gradients.
TEST(DecoderLoad, A4BitModelWithoutAdaptersDoesNotTrainUnsaid) {
  auto o = sizes();
  o["quantize"] = Value(std::string("nf4"));
  const Batch b{{"input_ids", at::randint(0, 96, {2, 9})}};
  auto m = test::make<Model>("decoder_lm", PluginKind::Model, o);
  m->train(true);
  EXPECT_THAT(test::error_of([&] { m->forward(b); }),
              HasSubstr("decoder_lm: quantize = \"nf4\" keeps 14 linear layers in 4 bits, which do not train, and no "
                        "LoRA adapters are on them"));
  {
    at::NoGradGuard no_grad;  // evaluation
    EXPECT_EQ(test::error_of([&] { m->forward(b); }), "");
  }
  m->train(false);
  EXPECT_EQ(test::error_of([&] { m->forward(b); }), "");
  m->train(true);
  for (auto& p : m->named_parameters())
    if (p.key().rfind("model.embed_tokens.", 0) == 0) p.value().set_requires_grad(false);  // the head alone, say
  EXPECT_EQ(test::error_of([&] { m->forward(b); }), "");

  auto q = test::make<Model>("decoder_lm", PluginKind::Model, o);
  test::make<Transform>("qlora", PluginKind::Optim, {{"r", Value(std::int64_t{2})}})->apply(*q);
  EXPECT_EQ(test::error_of([&] { q->forward(b); }), "");
  EXPECT_EQ(std::get<std::int64_t>(q->attributes().at("nf4_layers").v), 14);
}

}  // namespace
}  // namespace wick
