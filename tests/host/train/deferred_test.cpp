// A deferred model's layer quantized after the build (qlora over a model
// built deferred without its own 4-bit option): the host routes the float
// weight the build makes for the layer's former tensor to the layer's
// emit_nf4_from, so made whole it holds the bits of a whole build quantized,
// and a host with a 4-bit sink (a divided run's rank) gets the float weight.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/normalization.h>

#include "train/deferred.hpp"
#include "wick/kit/deferred_build.hpp"
#include "wick/kit/linear.hpp"
#include "wick/model.hpp"

namespace wick {
namespace {

// a block of module code: a layer norm and a linear layer of 64 x 16 (its
// torch initialisation drawn), made in `dtype`
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(at::ScalarType dtype) {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({64})));
    proj = register_module("proj", Linear(64, 16));
    at::NoGradGuard g;
    for (auto& t : parameters()) t.set_data(t.to(dtype));
  }
  torch::nn::LayerNorm norm{nullptr};
  Linear proj{nullptr};
};
TORCH_MODULE(Block);

struct Net : Model, Deferred {
  Net(bool defer, at::ScalarType dtype, bool replay = true) {
    block = register_module("block", deferred_part(defer ? &steps : nullptr, [dtype] { return Block(dtype); }, replay));
  }
  ForwardResult forward(const Batch&) override { return {}; }
  bool deferred() const override { return waits_for_values(*this, steps); }
  void materialize(const Emit& emit) override { steps.run(emit); }
  Deferral steps;
  Block block{nullptr};
};

class QuantizedAfterADeferredBuild : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(QuantizedAfterADeferredBuild, IsMadeWithTheBitsOfAWholeBuildQuantized) {
  const at::ScalarType dtype = GetParam();
  at::manual_seed(41);
  Net whole(false, dtype);
  const at::Tensor float_weight = whole.block->proj->weight.clone();
  whole.block->proj->quantize_nf4(at::kFloat, 64);
  at::manual_seed(41);
  Net deferred(true, dtype);
  ASSERT_TRUE(is_hollow(deferred.block->proj->weight));
  deferred.block->proj->quantize_nf4(at::kFloat, 64);
  ASSERT_TRUE(deferred.block->proj->quantized());
  ASSERT_TRUE(deferred.block->proj->deferred_float_weight().defined());
  EXPECT_TRUE(deferred.deferred());

  // a host with a 4-bit sink gets the float weight itself, in the weight's dtype
  int handed = 0;
  run_deferred(deferred, Emit([](const at::Tensor&, const at::Tensor&) {},
                              [&](const Nf4Weight& hollow, const at::Tensor& w) {
                                EXPECT_EQ(hollow.block, 64);
                                EXPECT_EQ(w.scalar_type(), dtype);
                                EXPECT_TRUE(at::equal(w, float_weight));
                                ++handed;
                              }));
  EXPECT_EQ(handed, 1);

  materialize_whole(deferred, "test", /*say=*/false);
  EXPECT_FALSE(deferred.deferred());
  const auto want = module_state(whole), got = module_state(deferred);
  ASSERT_EQ(want.size(), got.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(want[i].first, got[i].first);
    EXPECT_TRUE(at::equal(want[i].second, got[i].second)) << want[i].first;
  }
}

// a folder's fp32 weight for a bf16 model: rounded to bf16 before it is
// quantized, as the whole build's weight holds it
TEST(QuantizedAfterADeferredBuild, FromAWiderFileIsRoundedToTheWeightsDtypeFirst) {
  at::manual_seed(42);
  NamedTensorList file = {{"block.norm.weight", at::rand({64})},
                          {"block.norm.bias", at::rand({64})},
                          {"block.proj.weight", at::randn({16, 64})},
                          {"block.proj.bias", at::randn({16})}};
  Net whole(false, at::kBFloat16);
  load_state(whole, file, "f.safetensors");
  whole.block->proj->quantize_nf4(at::kFloat, 64);
  Net deferred(true, at::kBFloat16, /*replay=*/false);
  defer_load_state(deferred, NamedTensorList(file), "f.safetensors", {}, deferred.steps);
  deferred.block->proj->quantize_nf4(at::kFloat, 64);
  materialize_whole(deferred, "test", /*say=*/false);
  const auto want = module_state(whole), got = module_state(deferred);
  ASSERT_EQ(want.size(), got.size());
  for (std::size_t i = 0; i < want.size(); ++i)
    EXPECT_TRUE(at::equal(want[i].second, got[i].second)) << want[i].first;
  // (quantized from the fp32 values, the codes differ: the rounding is what the test sees)
  EXPECT_FALSE(at::equal(nf4_quantize(file[2].second, 64).packed, whole.block->proj->named_buffers()["nf4.packed"]));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, QuantizedAfterADeferredBuild, ::testing::Values(at::kFloat, at::kBFloat16));

}  // namespace
}  // namespace wick
