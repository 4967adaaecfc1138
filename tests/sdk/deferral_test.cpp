// A deferred build's steps (wick/kit/deferral.hpp): a random step replays
// the very values a whole build draws and leaves the generator where the
// whole build leaves it; a 4-bit layer's step, recorded, quantizes nothing
// (its values are dropped), and run with a plain sink emits the bytes
// nf4_quantize gives the drawn weight.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <map>

#include "wick/kit/deferral.hpp"
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

}  // namespace
}  // namespace wick
