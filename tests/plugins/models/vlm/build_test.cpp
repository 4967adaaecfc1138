// Vision models built in their dtype: vit, clip, video_classifier and vlm
// given dtype = "bf16" hold exactly what an fp32 build at the same seed
// converted to bf16 holds (each part is initialised in fp32 and converted
// before the next is made), no floating tensor stays fp32, and building
// never holds the whole model in fp32 (the counting allocator's peak). A
// random decoder or vlm with quantize = "nf4" holds the NF4 bytes that
// quantizing the bf16 build afterwards gives, without the bf16 model ever
// existing whole. vlm's frame options and quantize_vision refuse bad values
// by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/autocast_mode.h>

#include "../../../test_util.hpp"
#include "util/memory.hpp"
#include "wick/kit/linear.hpp"
#include "wick/kit/weights.hpp"
#include "wick/model.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

using Opts = std::map<std::string, Value>;
Value I(std::int64_t v) { return Value(v); }
Value S(const char* s) { return Value(std::string(s)); }

Opts vlm_sizes() {
  return {{"image_size", I(32)},         {"patch_size", I(8)},  {"vision_hidden_size", I(32)},
          {"vision_intermediate_size", I(64)}, {"vision_layers", I(3)}, {"vision_heads", I(4)},
          {"vocab_size", I(300)},        {"hidden_size", I(48)}, {"intermediate_size", I(96)},
          {"layers", I(3)},              {"heads", I(4)},        {"kv_heads", I(2)}};
}

struct Case {
  const char* plugin;
  Opts opts;
};

std::vector<Case> cases() {
  return {{"vit", {{"classes", I(5)}, {"image_size", I(32)}, {"patch_size", I(8)}, {"hidden_size", I(32)},
                   {"intermediate_size", I(64)}, {"layers", I(3)}, {"heads", I(4)}}},
          {"clip", {{"image_size", I(32)}, {"patch_size", I(8)}, {"hidden_size", I(32)}, {"intermediate_size", I(64)},
                    {"layers", I(2)}, {"heads", I(4)}, {"text_hidden_size", I(32)}, {"text_intermediate_size", I(64)},
                    {"text_layers", I(2)}, {"text_heads", I(4)}}},
          {"video_classifier", {{"classes", I(3)}, {"image_size", I(32)}, {"patch_size", I(8)}, {"hidden_size", I(32)},
                                {"intermediate_size", I(64)}, {"layers", I(2)}, {"heads", I(4)}}},
          {"vlm", vlm_sizes()}};
}

std::shared_ptr<Model> build(const Case& c, const char* dtype, std::uint64_t seed, Opts extra = {}) {
  Opts o = c.opts;
  o["dtype"] = S(dtype);
  for (auto& [k, v] : extra) o[k] = v;
  at::manual_seed(seed);
  return test::make<Model>(c.plugin, PluginKind::Model, o);
}

TEST(VisionBuild, Bf16BuildHoldsTheFp32BuildConverted) {
  for (const auto& c : cases()) {
    auto half = build(c, "bf16", 11), full = build(c, "fp32", 11);
    auto a = module_state(*half), b = module_state(*full);
    ASSERT_EQ(a.size(), b.size()) << c.plugin;
    for (std::size_t i = 0; i < a.size(); ++i) {
      ASSERT_EQ(a[i].first, b[i].first) << c.plugin;
      if (!a[i].second.is_floating_point()) continue;
      EXPECT_EQ(a[i].second.scalar_type(), at::kBFloat16) << c.plugin << " " << a[i].first;
      EXPECT_TRUE(at::equal(a[i].second, b[i].second.to(at::kBFloat16))) << c.plugin << " " << a[i].first;
    }
  }
}

TEST(VisionBuild, NeverHoldsTheWholeModelInFp32) {
  // a tower of 6 wide blocks: whole in fp32 it would be twice its bf16 size
  Case c{"vlm", vlm_sizes()};
  c.opts["vision_layers"] = I(6);
  c.opts["vision_hidden_size"] = I(256);
  c.opts["vision_intermediate_size"] = I(1024);
  c.opts["hidden_size"] = I(256);
  c.opts["intermediate_size"] = I(512);
  c.opts["layers"] = I(6);
  c.opts["vision_heads"] = I(4);
  const auto before = cpu_tensor_memory().allocated;
  reset_cpu_tensor_peak();
  auto m = build(c, "bf16", 3);
  std::int64_t held = 0, largest_block = 0;
  for (auto& [n, t] : module_state(*m)) held += static_cast<std::int64_t>(t.nbytes());
  // one vision block in fp32: 4 D x D and 2 D x F weights (biases and norms aside)
  largest_block = (4 * 256 * 256 + 2 * 256 * 1024) * 4;
  const auto peak = cpu_tensor_memory().peak - before;
  EXPECT_LE(peak, held + largest_block + largest_block / 4) << "built bf16 model " << held << " bytes";
  EXPECT_GT(2 * held, held + largest_block + largest_block / 4);  // the bound excludes a whole fp32 model
}

std::map<std::string, at::Tensor> nf4_state(Model& m) {
  std::map<std::string, at::Tensor> out;
  for (auto& [n, t] : module_state(m)) out[n] = t;
  return out;
}

void expect_quantized_equals_post(const Case& c, const std::string& prefix) {
  auto q = build(c, "bf16", 5, {{"quantize", S("nf4")}});
  auto p = build(c, "bf16", 5);
  auto* targets = capability<AdapterTargets>(*p);
  ASSERT_NE(targets, nullptr);
  for (auto& [n, l] : targets->linear_layers()) l->quantize_nf4(at::kBFloat16, 64);
  auto a = nf4_state(*q), b = nf4_state(*p);
  ASSERT_EQ(a.size(), b.size());
  int packed = 0;
  for (auto& [n, t] : a) {
    ASSERT_TRUE(b.count(n)) << n;
    EXPECT_TRUE(at::equal(t, b.at(n))) << c.plugin << " " << n;
    packed += n.find(".nf4.packed") != std::string::npos && n.rfind(prefix, 0) == 0;
  }
  EXPECT_EQ(packed, 3 * 7) << c.plugin;  // every layer's 7 linear weights
}

TEST(QuantizedBuild, RandomNf4EqualsQuantizingTheBf16BuildAfterwards) {
  expect_quantized_equals_post({"vlm", vlm_sizes()}, "model.language_model.layers.");
  expect_quantized_equals_post({"decoder_lm", {{"vocab_size", I(300)}, {"hidden_size", I(48)},
                                               {"intermediate_size", I(96)}, {"layers", I(3)}, {"heads", I(4)},
                                               {"kv_heads", I(2)}}},
                               "model.layers.");
}

TEST(QuantizedBuild, VlmQuantizesAFrozenTowerOnRequest) {
  Case c{"vlm", vlm_sizes()};
  auto m = build(c, "bf16", 2, {{"quantize", S("nf4")}, {"quantize_vision", Value(true)}});
  int tower = 0;
  for (auto& [n, t] : module_state(*m)) tower += n.rfind("model.vision_tower.", 0) == 0 && n.find(".nf4.packed") != n.npos;
  EXPECT_EQ(tower, 3 * 6);
  // and it still runs: pictures through the 4-bit tower (a forward to look
  // at: one to train would be refused, the 4-bit decoder having no adapters)
  at::NoGradGuard no_grad;
  Batch b;
  b["input_ids"] = at::randint(0, 256, {2, 6}, at::kLong);
  b["input_ids"].index_put_({at::indexing::Slice(), 1}, 257);
  b["image"] = at::randint(0, 255, {2, 3, 32, 32}, at::kByte);
  auto r = m->forward(b);
  EXPECT_TRUE(std::isfinite(r.loss_sum.item<double>()));
}

std::string build_error(const Case& c, Opts extra) {
  try {
    build(c, "fp32", 1, std::move(extra));
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(VlmOptions, BadFrameAndQuantizeOptionsAreRefusedByName) {
  Case c{"vlm", vlm_sizes()};
  EXPECT_THAT(build_error(c, {{"frame_tokens", I(5)}}), HasSubstr("frame_tokens 5 is not a square grid of at most the tower's 4x4"));
  EXPECT_THAT(build_error(c, {{"frame_tokens", I(25)}}), HasSubstr("frame_tokens 25"));
  EXPECT_THAT(build_error(c, {{"quantize_vision", Value(true)}}), HasSubstr("quantize_vision needs quantize = \"nf4\""));
  EXPECT_THAT(build_error(c, {{"quantize_vision", Value(true)}, {"quantize", S("nf4")}, {"freeze_vision", Value(false)}}),
              HasSubstr("quantize_vision needs freeze_vision = true"));
  EXPECT_THAT(build_error(c, {{"quantize", S("nf4")}, {"quantize_block", I(7)}}),
              HasSubstr("quantize_block 7 does not divide layer model.language_model.layers.0.self_attn.q_proj"));
}

}  // namespace
}  // namespace wick

namespace wick {
namespace {

// A fresh decoder starts where transformers' does: linear and embedding
// weights normal(0, initializer_range), biases 0, norms 1; its first loss
// on random tokens is near ln(vocab), tied head or not.
TEST(DecoderInit, AFreshDecoderStartsNearLnVocab) {
  for (bool tie : {true, false}) {
    at::manual_seed(0);
    auto m = test::make<Model>("decoder_lm", PluginKind::Model,
                               {{"vocab_size", I(4096)}, {"hidden_size", I(256)}, {"intermediate_size", I(512)},
                                {"layers", I(2)}, {"heads", I(4)}, {"family", S("qwen2")}, {"tie_embeddings", Value(tie)}});
    for (auto& [n, t] : module_state(*m)) {
      if (n.find("norm") != std::string::npos) {
        EXPECT_TRUE(at::equal(t, at::ones_like(t))) << n;
      } else if (n.size() > 5 && n.compare(n.size() - 5, 5, ".bias") == 0) {
        EXPECT_TRUE(at::equal(t, at::zeros_like(t))) << n;
      } else {
        EXPECT_NEAR(t.std().item<double>(), 0.02, 0.002) << n;
        EXPECT_NEAR(t.mean().item<double>(), 0.0, 0.002) << n;
      }
    }
    Batch b;
    b["input_ids"] = at::randint(0, 4096, {4, 64}, at::kLong);
    auto r = m->forward(b);
    const double loss = r.loss_sum.item<double>() / static_cast<double>(r.items);
    EXPECT_NEAR(loss, std::log(4096.0), 0.5) << (tie ? "tied" : "untied");
  }
}

}  // namespace
}  // namespace wick

namespace wick {
namespace {

// CLIP's text tower under bf16 autocast with padded texts: the padding mask's
// bias is finite in bf16 (fp32's lowest overflowed it and the step failed),
// and the loss is the fp32 one within bf16's precision.
TEST(ClipAutocast, PaddedTextsTrainUnderBf16Autocast) {
  at::manual_seed(4);
  auto m = test::make<Model>("clip", PluginKind::Model,
                             {{"image_size", I(32)}, {"patch_size", I(8)}, {"hidden_size", I(32)},
                              {"intermediate_size", I(64)}, {"layers", I(2)}, {"heads", I(4)},
                              {"text_hidden_size", I(32)}, {"text_intermediate_size", I(64)}, {"text_layers", I(2)},
                              {"text_heads", I(4)}, {"max_length", I(16)}, {"vocab_size", I(300)},
                              {"eos_token_id", I(299)}});
  Batch b;
  b["image"] = at::randint(0, 255, {4, 3, 32, 32}, at::kByte);
  b["input_ids"] = at::randint(0, 299, {4, 16}, at::kLong);
  b["attention_mask"] = at::ones({4, 16}, at::kLong);
  b["attention_mask"].index_put_({at::indexing::Slice(0, 2), at::indexing::Slice(9, 16)}, 0);  // two padded texts
  b["input_ids"].index_put_({at::indexing::Slice(0, 2), 8}, 299);
  b["input_ids"].index_put_({at::indexing::Slice(2, 4), 15}, 299);
  const double fp32 = m->forward(b).loss_sum.item<double>();
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  double bf16 = 0;
  try {
    auto r = m->forward(b);
    bf16 = r.loss_sum.item<double>();
    r.loss_sum.backward();
  } catch (...) {
    at::autocast::set_autocast_enabled(at::kCPU, false);
    throw;
  }
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  EXPECT_TRUE(std::isfinite(bf16));
  EXPECT_NEAR(bf16, fp32, 0.05 * std::abs(fp32));
}

}  // namespace
}  // namespace wick
