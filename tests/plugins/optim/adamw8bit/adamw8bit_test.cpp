// optim `adamw8bit` through the plugin registry, on hand-made gradients: the
// state it keeps (bytes, dtypes), that chunking and resuming change nothing,
// half-precision weights, and a state of another block size refused. Its
// update against bitsandbytes and a written-out reference, and its training
// quality, are in tests/reference/test_adamw8bit.py.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "../../../test_util.hpp"
#include "kernels/adamw8bit_math.hpp"
#include "wick/kit/dynamic_map.hpp"
#include "wick/optim.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

std::shared_ptr<Optimizer> adamw8bit(std::map<std::string, Value> o = {}) {
  o.emplace("lr", Value(0.01));
  return test::make<Optimizer>("adamw8bit", PluginKind::Optim, o);
}

// a [300, 70] weight (21,000 elements: 82 blocks of 256 and a short one, 8-bit
// moments) and a [300] bias (fp32 moments), fresh from seed 0
NamedTensors params(at::ScalarType dtype = at::kFloat) {
  at::manual_seed(0);
  return {{"w", at::randn({300, 70}).to(dtype)}, {"b", at::randn({300}).to(dtype)}};
}

// gradients for step k, the same for every run
void set_grads(NamedTensors& ps, int k) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + k);
  for (auto& [name, p] : ps) {
    at::Tensor g = at::randn(p.sizes(), gen) * at::rand(p.sizes(), gen).pow(3);  // a wide range of magnitudes
    p.mutable_grad() = g.to(p.scalar_type());
  }
}

void steps(Optimizer& o, NamedTensors& ps, int from, int to) {
  for (int k = from; k < to; ++k) {
    set_grads(ps, k);
    o.step(0.01);
  }
}

void expect_same_state(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, v] : a) {
    ASSERT_TRUE(b.count(k)) << k;
    EXPECT_TRUE(at::equal(v, b.at(k))) << k;
  }
}

TEST(AdamW8bit, KeepsTwoBytesOfStatePerParameterOfLargeTensors) {
  auto o = adamw8bit();
  auto ps = params();
  o->attach(ps);
  steps(*o, ps, 0, 1);
  const auto s = o->state();
  EXPECT_EQ(s.at("w.exp_avg.codes").scalar_type(), at::kByte);
  EXPECT_EQ(s.at("w.exp_avg_sq.codes").numel(), 21000);
  EXPECT_EQ(s.at("w.exp_avg.absmax").numel(), 83);  // ceil(21000 / 256)
  EXPECT_EQ(s.at("b.exp_avg").scalar_type(), at::kFloat);  // 300 < min_8bit_size
  EXPECT_FALSE(s.count("w.exp_avg"));
  std::int64_t held = 0, held_w = 0;
  for (const auto& [k, v] : s) {
    held += v.numel() * v.element_size();
    if (k.starts_with("w.") && k != "w.step") held_w += v.numel() * v.element_size();
  }
  EXPECT_EQ(held - 2 * 4, o->state_bytes(ps));  // state_bytes counts no step scalars
  EXPECT_EQ(held_w, 2 * 21000 + 2 * 4 * 83);
  EXPECT_LT(static_cast<double>(held_w) / 21000, 2.04);
}

TEST(AdamW8bit, CodesAreTheNearestOfTheDynamicMaps) {
  // after one step from zero moments, m = (1 - beta1) g and v = (1 - beta2) g^2
  // (the optimizer's own ops): each block's codes are the kit's nearest
  // (bucketize over the midpoints) to value / absmax, in the signed map for m
  // and the unsigned one for v; gradients over many magnitudes, exact zeros and
  // a short last block
  auto o = adamw8bit({{"weight_decay", Value(0.0)}});
  at::manual_seed(1);
  at::Tensor w = at::zeros({100000});
  at::Tensor g = at::randn({100000}) * at::pow(10.0, at::rand({100000}) * -8);
  g.slice(0, 0, 1000).zero_();
  w.mutable_grad() = g;
  NamedTensors ps = {{"w", w}};
  o->attach(ps);
  o->step(0.01);
  const auto s = o->state();
  const at::Tensor m = at::zeros_like(g).mul_(0.9).add_(g, 1 - 0.9);
  const at::Tensor v = at::zeros_like(g).mul_(0.999).addcmul_(g, g, 1 - 0.999);
  for (const auto& [key, x, map] : {std::tuple{"w.exp_avg", m, dynamic_map(true)},
                                    std::tuple{"w.exp_avg_sq", v, dynamic_map(false)}}) {
    const at::Tensor padded = at::cat({x, at::zeros({256 * 391 - 100000})}).view({-1, 256});
    const at::Tensor absmax = padded.abs().amax(1);
    const at::Tensor normed = (padded / at::where(absmax > 0, absmax, at::ones_like(absmax)).unsqueeze(1)).view({-1});
    const at::Tensor want = nearest(normed.slice(0, 0, 100000), map).to(at::kByte);
    EXPECT_TRUE(at::equal(s.at(std::string(key) + ".absmax"), absmax)) << key;
    EXPECT_TRUE(at::equal(s.at(std::string(key) + ".codes"), want)) << key;
  }
}

TEST(AdamW8bit, ChunkingChangesNothing) {
  auto whole = adamw8bit();
  auto chunked = adamw8bit({{"chunk_size", Value(std::int64_t{1000})}});  // 768: whole blocks
  auto a = params(), b = params();
  whole->attach(a);
  chunked->attach(b);
  steps(*whole, a, 0, 4);
  steps(*chunked, b, 0, 4);
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
  expect_same_state(whole->state(), chunked->state());
}

TEST(AdamW8bit, ResumedStateEndsWhereAnUnbrokenRunEnds) {
  auto unbroken = adamw8bit();
  auto a = params();
  unbroken->attach(a);
  steps(*unbroken, a, 0, 6);

  auto first = adamw8bit();
  auto b = params();
  first->attach(b);
  steps(*first, b, 0, 3);
  std::map<std::string, at::Tensor> saved;
  for (const auto& [k, v] : first->state()) saved[k] = v.clone();
  auto resumed = adamw8bit();
  resumed->attach(b);
  resumed->load_state(saved);
  steps(*resumed, b, 3, 6);

  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
  expect_same_state(unbroken->state(), resumed->state());
  EXPECT_FALSE(at::equal(a[0].second, params()[0].second));  // it trained
}

TEST(AdamW8bit, HalfPrecisionWeightsStepInFp32AndRound) {
  // the same bf16-representable weights and gradients: the bf16 weight after
  // a step is the fp32 weight's step rounded to bf16
  auto o16 = adamw8bit();
  auto o32 = adamw8bit();
  auto h = params(at::kBFloat16);
  NamedTensors f;
  for (auto& [n, p] : h) f.emplace_back(n, p.to(at::kFloat));
  o16->attach(h);
  o32->attach(f);
  set_grads(h, 0);
  for (std::size_t i = 0; i < h.size(); ++i) f[i].second.mutable_grad() = h[i].second.grad().to(at::kFloat);
  o16->step(0.01);
  o32->step(0.01);
  for (std::size_t i = 0; i < h.size(); ++i) {
    EXPECT_EQ(h[i].second.scalar_type(), at::kBFloat16);
    EXPECT_TRUE(at::equal(h[i].second, f[i].second.to(at::kBFloat16))) << h[i].first;
  }
  expect_same_state(o16->state(), o32->state());
}

TEST(AdamW8bit, AllZeroBlockKeepsZeroMoments) {
  auto o = adamw8bit({{"weight_decay", Value(0.0)}});
  at::Tensor w = at::ones({4096});
  w.mutable_grad() = at::randn({4096});
  w.mutable_grad().slice(0, 256, 512).zero_();  // block 1
  NamedTensors ps = {{"w", w}};
  o->attach(ps);
  o->step(0.01);
  const auto s = o->state();
  EXPECT_EQ(s.at("w.exp_avg.absmax")[1].item<float>(), 0);
  EXPECT_TRUE(at::equal(w.slice(0, 256, 512), at::ones({256})));  // no gradient, no decay: unmoved
  EXPECT_FALSE(at::equal(w.slice(0, 0, 256), at::ones({256})));
}

TEST(AdamW8bit, StateOfAnotherBlockSizeIsRefused) {
  auto o = adamw8bit();
  auto ps = params();
  o->attach(ps);
  steps(*o, ps, 0, 1);
  auto other = adamw8bit({{"block_size", Value(std::int64_t{128})}});
  other->attach(ps);
  try {
    other->load_state(o->state());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("optim 'adamw8bit': state 'w.exp_avg.absmax': expected 165 elements"));
    EXPECT_THAT(e.what(), HasSubstr("another block_size"));
  }
}

// The engine's fused CUDA step (host/kernels/adamw8bit_step.cu) computes each
// element with adamw8bit_math.hpp, a block at a time: the largest new moment
// of the block first, then the weight and the codes. That algorithm, run here
// on the CPU with the same header, gives the plugin's ATen step: absmax
// values and weights to float rounding (the two may fuse a multiply-add
// differently), the codes equal but where a moment lies within rounding of a
// midpoint, and there one code apart.
TEST(AdamW8bit, TheFusedKernelsAlgorithmGivesTheATenStep) {
  const double lr = 0.01, wd = 0.05, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  auto o = adamw8bit({{"weight_decay", Value(wd)}});
  auto ps = params();
  o->attach(ps);
  steps(*o, ps, 0, 2);  // moments with codes all over the maps
  std::map<std::string, at::Tensor> before;
  for (const auto& [k, v] : o->state()) before[k] = v.clone();  // state() gives views of the live state
  const at::Tensor w0 = ps[0].second.clone().view({-1});
  set_grads(ps, 2);
  const at::Tensor g = ps[0].second.grad().contiguous().view({-1});
  o->step(lr);
  const auto after = o->state();

  const std::int64_t n = w0.numel(), block = 256, nb = (n + block - 1) / block;
  const at::Tensor smap = dynamic_map(true), umap = dynamic_map(false);
  std::vector<float> smid(255), umid(255);
  for (int i = 0; i < 255; ++i) {
    smid[i] = (smap[i + 1].item<float>() + smap[i].item<float>()) / 2.0f;
    umid[i] = (umap[i + 1].item<float>() + umap[i].item<float>()) / 2.0f;
  }
  const int step = 3;
  const double c1 = 1 - std::pow(b1, step), c2 = std::sqrt(1 - std::pow(b2, step));
  const kernels::Adam8Hyper h{float(b1), float(1 - b1), float(b2), float(1 - b2), float(eps), float(c2),
                              float(1 - lr * wd), float(-lr / c1)};
  const at::Tensor mc = before.at("w.exp_avg.codes").contiguous().view({-1}), vc = before.at("w.exp_avg_sq.codes").contiguous().view({-1});
  const at::Tensor ma = before.at("w.exp_avg.absmax"), va = before.at("w.exp_avg_sq.absmax");
  const float* sm = smap.data_ptr<float>();
  const float* um = umap.data_ptr<float>();
  std::vector<float> w(n), m_top(nb), v_top(nb);
  std::vector<std::uint8_t> m_code(n), v_code(n);
  for (std::int64_t b = 0; b < nb; ++b) {
    const std::int64_t begin = b * block, end = std::min(n, begin + block);
    float mt = 0, vt = 0;
    auto moments = [&](std::int64_t i, float& m, float& v) {
      kernels::adam8_moments(sm[mc[i].item<std::uint8_t>()] * ma[b].item<float>(),
                             um[vc[i].item<std::uint8_t>()] * va[b].item<float>(), g[i].item<float>(), h, m, v);
    };
    for (std::int64_t i = begin; i < end; ++i) {
      float m, v;
      moments(i, m, v);
      mt = std::max(mt, std::fabs(m));
      vt = std::max(vt, std::fabs(v));
    }
    for (std::int64_t i = begin; i < end; ++i) {
      float m, v;
      moments(i, m, v);
      w[i] = kernels::adam8_weight(w0[i].item<float>(), m, v, h);
      m_code[i] = kernels::adam8_code(m / (mt > 0 ? mt : 1.0f), smid.data());
      v_code[i] = kernels::adam8_code(v / (vt > 0 ? vt : 1.0f), umid.data());
    }
    m_top[b] = mt;
    v_top[b] = vt;
  }
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  EXPECT_TRUE(at::allclose(at::from_blob(m_top.data(), {nb}, f32), after.at("w.exp_avg.absmax"), 1e-6, 0));
  EXPECT_TRUE(at::allclose(at::from_blob(v_top.data(), {nb}, f32), after.at("w.exp_avg_sq.absmax"), 1e-6, 0));
  const at::Tensor wk = at::from_blob(w.data(), {n}, f32);
  // relative: where a second moment decodes to 0 the step divides by eps,
  // and a weight moves by tens (element 626 here), a few float roundings apart
  EXPECT_TRUE(at::allclose(wk, ps[0].second.view({-1}), 1e-6, 1e-6));
  EXPECT_GT((wk - w0).abs().max().item<float>(), 1e-4);  // a step was taken
  const auto u8 = at::TensorOptions().dtype(at::kByte);
  for (const auto& [mine, key] : {std::pair{&m_code, "w.exp_avg.codes"}, std::pair{&v_code, "w.exp_avg_sq.codes"}}) {
    const at::Tensor d = at::from_blob(mine->data(), {n}, u8).to(at::kInt) - after.at(key).reshape({-1}).to(at::kInt);
    EXPECT_LE(d.abs().max().item<int>(), 1) << key;
    EXPECT_LE(d.ne(0).sum().item<std::int64_t>(), n / 1000) << key;  // near-ties only
    EXPECT_GT(std::get<0>(at::_unique(at::from_blob(mine->data(), {n}, u8))).numel(), 50) << key;  // codes vary
  }
}

}  // namespace
}  // namespace wick
