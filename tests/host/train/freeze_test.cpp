// Freezing by name: which parameters a pattern names, requires_grad set on
// exactly those, a pattern that names nothing refused by name, and frozen
// parameters hold no gradient and no optimizer state in training (the
// trainer's tensors counted).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include "../../test_util.hpp"
#include "train/freeze.hpp"
#include "train/trainer.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

TEST(Freeze, PatternsNameParametersModulesAndGlobs) {
  EXPECT_TRUE(names_parameter("model.layers.0", "model.layers.0.mlp.up_proj.weight"));
  EXPECT_FALSE(names_parameter("model.layers.1", "model.layers.10.mlp.up_proj.weight"));  // a module, not a prefix
  EXPECT_TRUE(names_parameter("lm_head.weight", "lm_head.weight"));
  EXPECT_FALSE(names_parameter("lm_head.weigh", "lm_head.weight"));
  EXPECT_TRUE(names_parameter("*.bias", "model.layers.3.self_attn.q_proj.bias"));
  EXPECT_FALSE(names_parameter("*.bias", "model.layers.3.self_attn.q_proj.weight"));
  EXPECT_TRUE(names_parameter("*norm*", "model.layers.2.input_layernorm.weight"));
  EXPECT_TRUE(names_parameter("model.layers.1?.*", "model.layers.12.mlp.down_proj.weight"));
  EXPECT_FALSE(names_parameter("model.layers.1?.*", "model.layers.1.mlp.down_proj.weight"));
  // LoRA's target_modules forms: a module or the parameter's own name at any depth, whole components only
  EXPECT_TRUE(names_parameter("q_proj", "model.layers.3.self_attn.q_proj.weight"));
  EXPECT_FALSE(names_parameter("proj", "model.layers.3.self_attn.q_proj.weight"));
  EXPECT_TRUE(names_parameter("bias", "model.layers.3.self_attn.q_proj.bias"));
  EXPECT_FALSE(names_parameter("bias", "model.layers.3.self_attn.q_proj.bias_scale"));
  EXPECT_TRUE(names_parameter("self_attn.q_proj", "model.layers.3.self_attn.q_proj.weight"));
  EXPECT_FALSE(names_parameter("layers.3", "model.layers.31.mlp.up_proj.weight"));
  EXPECT_FALSE(names_parameter("", "model.layers.3.mlp.up_proj.weight"));
  // "re:" and a regular expression over the whole name
  EXPECT_TRUE(names_parameter("re:.*\\.(q|v)_proj\\.weight", "model.layers.3.self_attn.v_proj.weight"));
  EXPECT_FALSE(names_parameter("re:.*\\.(q|v)_proj\\.weight", "model.layers.3.self_attn.k_proj.weight"));
  EXPECT_FALSE(names_parameter("re:q_proj", "model.layers.3.self_attn.q_proj.weight"));  // whole name
  EXPECT_THROW(check_pattern("re:(q", "fn"), Error);
  EXPECT_THROW(check_pattern("", "fn"), Error);
  EXPECT_NO_THROW(check_pattern("re:q|v", "fn"));
}

std::shared_ptr<Model> mlp() {
  at::manual_seed(0);
  return test::make<Model>("mlp", PluginKind::Model,
                           {{"inputs", Value(std::int64_t{16})},
                            {"hidden", Value(List{Value(std::int64_t{64}), Value(std::int64_t{64})})},
                            {"outputs", Value(std::int64_t{4})}});
}

TEST(Freeze, SetsRequiresGradOnWhatThePatternsName) {
  auto m = mlp();  // 0.weight 64x16, 0.bias, 2.weight 64x64, 2.bias, 4.weight 4x64, 4.bias
  auto c = set_trainable(*m, {"0", "*.bias"}, false, "freeze");
  EXPECT_EQ(c.matched, 4);  // 0.weight, 0.bias, 2.bias, 4.bias
  EXPECT_EQ(c.total, 64 * 16 + 64 + 64 * 64 + 64 + 4 * 64 + 4);
  EXPECT_EQ(c.trainable, 64 * 64 + 4 * 64);
  for (const auto& p : m->named_parameters())
    EXPECT_EQ(p.value().requires_grad(), p.key() == "2.weight" || p.key() == "4.weight") << p.key();
  c = set_trainable(*m, {"4.bias"}, true, "unfreeze");
  EXPECT_EQ(c.trainable, 64 * 64 + 4 * 64 + 4);
}

TEST(Freeze, APatternThatNamesNothingIsRefusedByName) {
  auto m = mlp();
  EXPECT_THAT(test::error_of([&] { set_trainable(*m, {"2", "vision_tower"}, false, "freeze"); }),
              HasSubstr("freeze: 'vision_tower' names no parameter of the model (expected a parameter's or a "
                        "module's name, or a glob such as '*.bias'; its top-level modules: 0, 2, 4)"));
  EXPECT_THAT(test::error_of([&] { set_trainable(*m, {}, false, "freeze"); }), HasSubstr("freeze: expected a pattern"));
  for (const auto& p : m->parameters()) EXPECT_TRUE(p.requires_grad());  // nothing changed by the failed call
}

TEST(Freeze, FrozenParametersHoldNoGradientAndNoOptimizerState) {
  auto m = mlp();
  set_trainable(*m, {"0", "2"}, false, "freeze");
  std::int64_t trainable_bytes = 0;
  for (const auto& p : m->parameters())
    if (p.requires_grad()) trainable_bytes += static_cast<std::int64_t>(p.nbytes());
  auto opt = test::make<Optimizer>("adamw", PluginKind::Optim, {{"lr", Value(0.01)}});
  Trainer t(m, opt, nullptr, {});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const Batch b = {{"x", at::randn({8, 16}, gen)}, {"y", at::randint(0, 4, {8}, gen)}};
  t.step({b});
  t.step({b});
  const auto bd = t.memory_breakdown();
  EXPECT_EQ(bd.at("gradients"), trainable_bytes);
  EXPECT_EQ(bd.at("trainable"), trainable_bytes);
  EXPECT_LE(bd.at("optimizer"), 2 * trainable_bytes + 64);  // two moments (and step counters)
  EXPECT_GE(bd.at("optimizer"), 2 * trainable_bytes);
  for (const auto& p : m->named_parameters())
    if (!p.value().requires_grad()) EXPECT_FALSE(p.value().grad().defined()) << p.key();
}

}  // namespace
}  // namespace wick
