// A deferred build's steps (wick/kit/deferral.hpp): a random step replays
// the very values a whole build draws and leaves the generator where the
// whole build leaves it; a 4-bit layer's step, recorded, quantizes nothing
// (its values are dropped), and run with a plain sink emits the bytes
// nf4_quantize gives the drawn weight. A part made by ordinary module code
// (wick/kit/deferred_build.hpp) is hollow after the build, and its step makes
// the whole build's values again; a folder's step hands each tensor over.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <map>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>

#include "wick/kit/deferral.hpp"
#include "wick/kit/deferred_build.hpp"
#include "wick/kit/linear.hpp"
#include "wick/kit/nf4.hpp"

namespace wick {
namespace {

TEST(Deferral, ReplaysARandomStepsValuesAndLeavesTheGeneratorAsAWholeBuildDoes) {
  at::manual_seed(21);
  const at::Tensor whole = at::randn({8, 64});
  const at::Tensor after = at::randn({3});  // what the recipe draws after a whole build
  at::manual_seed(21);
  Linear l(64, 8, false, at::kFloat, LinearImpl::Hollow{});
  Deferral d;
  d.add_random([l](const Deferral::Emit& emit) { emit(l->weight, at::randn({8, 64})); });
  std::map<const c10::TensorImpl*, at::Tensor> got;
  d.run([&](const at::Tensor& t, const at::Tensor& v) { got[t.unsafeGetTensorImpl()] = v.clone(); });
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(at::equal(got.at(l->weight.unsafeGetTensorImpl()), whole));
  // recording moved the generator as the whole build does, and run() left it there
  EXPECT_TRUE(at::equal(at::randn({3}), after));
}

TEST(Deferral, AFourBitLayersRecordedStepQuantizesNothingAndItsRunEmitsNf4Bytes) {
  at::manual_seed(22);
  const at::Tensor drawn = at::randn({16, 128});
  at::manual_seed(22);
  Linear l(128, 16, false, at::kFloat, LinearImpl::Hollow{});
  l->hollow_nf4(at::kBFloat16, 64);
  int recorded_with_nf4_sink = 0, steps = 0;
  Deferral d;
  d.add_random([&, l](const Deferral::Emit& emit) {
    ++steps;
    if (emit.nf4()) ++recorded_with_nf4_sink;
    l->emit_nf4_from(at::randn({16, 128}), emit);
  });
  EXPECT_EQ(steps, 1);
  EXPECT_EQ(recorded_with_nf4_sink, 1);  // recording hands the weight to a sink that makes nothing of it
  std::vector<at::Tensor> values;
  d.run([&](const at::Tensor&, const at::Tensor& v) { values.push_back(v.clone()); });
  const Nf4Weight want = nf4_quantize(drawn, 64);
  ASSERT_EQ(values.size(), 4u);  // packed codes, constants' codes, their scales, the offset
  EXPECT_TRUE(at::equal(values[0], want.packed));
  EXPECT_TRUE(at::equal(values[1], want.absmax_q));
  EXPECT_TRUE(at::equal(values[2], want.absmax_scale));
  EXPECT_TRUE(at::equal(values[3], want.absmax_offset));
  // a host's 4-bit sink gets the float weight itself
  at::Tensor handed;
  d.run(Emit([](const at::Tensor&, const at::Tensor&) { FAIL() << "a 4-bit layer's tensors go to the nf4 sink"; },
             [&](const Nf4Weight& hollow, const at::Tensor& w) {
               EXPECT_EQ(hollow.block, 64);
               handed = w.clone();
             }));
  EXPECT_TRUE(at::equal(handed, drawn));
}

// A part of module code whose constructors draw (a convolution, a linear
// layer) with a value drawn over one of them, as the vision encoders make theirs.
std::shared_ptr<torch::nn::Module> make_part() {
  auto m = std::make_shared<torch::nn::Module>();
  auto conv = m->register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 4)));
  m->register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
  m->register_module("proj", torch::nn::Linear(8, 5));
  at::NoGradGuard g;
  conv->weight.normal_(0, 0.02);
  return m;
}

std::map<std::string, at::Tensor> values_of(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [n, t] : module_state(m)) out[n] = t.clone();
  return out;
}

TEST(DeferredBuild, APartIsHollowAfterTheBuildAndItsStepMakesTheWholeBuildsValuesByName) {
  at::manual_seed(31);
  auto whole1 = make_part(), whole2 = make_part();
  const at::Tensor after = at::randn({4});
  const auto want1 = values_of(*whole1), want2 = values_of(*whole2);
  at::manual_seed(31);
  Deferral d;
  auto p1 = deferred_part(&d, [] { return make_part(); });
  auto p2 = deferred_part(&d, [] { return make_part(); });
  EXPECT_TRUE(at::equal(at::randn({4}), after));  // the build moved the generator as the whole one did
  for (auto* p : {&p1, &p2})
    for (const auto& [n, t] : module_state(**p)) EXPECT_TRUE(is_hollow(t)) << n;
  EXPECT_TRUE(waits_for_values(*p1, d));
  std::map<const c10::TensorImpl*, at::Tensor> got;
  d.run([&](const at::Tensor& t, const at::Tensor& v) {
    EXPECT_TRUE(got.emplace(t.unsafeGetTensorImpl(), v.clone()).second) << "a tensor's value comes once";
  });
  for (const auto& [p, want] : {std::pair{p1, want1}, std::pair{p2, want2}})
    for (const auto& [n, t] : module_state(*p)) {
      ASSERT_TRUE(got.count(t.unsafeGetTensorImpl())) << n;
      EXPECT_TRUE(at::equal(got.at(t.unsafeGetTensorImpl()), want.at(n))) << n;
    }
  EXPECT_EQ(got.size(), want1.size() + want2.size());
  // without a deferral the part is made whole, as make() makes it
  at::manual_seed(31);
  auto made = deferred_part(nullptr, [] { return make_part(); });
  EXPECT_TRUE(at::equal(made->named_parameters()["conv.weight"], want1.at("conv.weight")));
}

TEST(DeferredBuild, AFolderPartRecordsNoStepAndTheFolderStepHandsEachTensorOverOrRefusesAMisfit) {
  at::manual_seed(32);
  Deferral d;
  auto part = deferred_part(&d, [] { return make_part(); }, /*replay=*/false);
  EXPECT_TRUE(d.empty());
  for (const auto& [n, t] : module_state(*part)) EXPECT_TRUE(is_hollow(t)) << n;
  NamedTensorList file;
  for (const auto& [n, t] : module_state(*part)) file.emplace_back(n, at::full(t.sizes(), 0.5, at::kBFloat16));
  file.emplace_back("extra.position_ids", at::zeros({3}));
  NamedTensorList bad = file;
  bad[0].second = at::zeros({2, 2});
  EXPECT_THROW(
      {
        try {
          defer_load_state(*part, std::move(bad), "f.safetensors", {"extra.position_ids"}, d);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("weights in f.safetensors do not fit the model: shape mismatch"),
                    std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
  EXPECT_TRUE(d.empty());  // nothing recorded for a misfit
  defer_load_state(*part, std::move(file), "f.safetensors", {"extra.position_ids"}, d);
  std::size_t n = 0;
  d.run([&](const at::Tensor& t, const at::Tensor& v) {
    EXPECT_EQ(v.scalar_type(), at::kBFloat16);  // in the file's dtype: the host converts what it keeps
    EXPECT_EQ(v.sizes(), t.sizes());
    ++n;
  });
  EXPECT_EQ(n, module_state(*part).size());
}

}  // namespace
}  // namespace wick
