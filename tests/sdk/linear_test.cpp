// wick::Linear's LoRA adapter (sdk/wick/kit/linear.hpp): its product keeps
// only x, dropout's mask as bytes and A(h) for backward, and must give what
// PEFT's plain composition gives: y + scale * B(A(dropout(x))), with at::dropout
// drawing the same mask from the same seed, in fp32 and under bf16 autocast.
#include <gtest/gtest.h>

#include <ATen/autocast_mode.h>

#include <tuple>

#include <wick/kit/linear.hpp>

namespace wick {
namespace {

struct Grads {
  at::Tensor y, gx, gA, gB;
};

// The layer's forward and backward, or the plain composition of the same ops.
Grads run(Linear& l, const at::Tensor& x0, const at::Tensor& gy, bool plain, bool autocast) {
  at::Tensor x = x0.detach().clone().requires_grad_(true);
  l->lora_A->weight.mutable_grad() = at::Tensor();
  l->lora_B->weight.mutable_grad() = at::Tensor();
  at::manual_seed(11);
  at::Tensor y;
  {
    if (autocast) {
      at::autocast::set_autocast_enabled(at::kCPU, true);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      at::autocast::increment_nesting();
    }
    if (plain) {
      at::Tensor h = at::dropout(x, l->dropout_, /*train=*/true);
      if (!autocast) h = h.to(l->lora_A->weight.scalar_type());
      y = at::linear(x, l->weight);
      y = y + l->lora_B->forward(l->lora_A->forward(h)).to(y.scalar_type()) * l->scale_;
    } else {
      y = l->forward(x);
    }
    if (autocast) {
      at::autocast::decrement_nesting();
      at::autocast::clear_cache();
      at::autocast::set_autocast_enabled(at::kCPU, false);
    }
  }
  y.backward(gy.to(y.scalar_type()));
  return {y.detach(), x.grad(), l->lora_A->weight.grad().clone(), l->lora_B->weight.grad().clone()};
}

void compare(bool autocast, at::ScalarType xdtype, double tol, std::int64_t in = 48, std::int64_t tokens = 5) {
  at::manual_seed(0);
  Linear l(in, 40, /*bias=*/false);
  l->add_adapter(8, 16, 0.25);
  {
    at::NoGradGuard no_grad;
    l->lora_B->weight.normal_(0, 0.1);  // B starts at zero; a trained one does not
  }
  l->weight.set_requires_grad(false);
  l->weight.set_data(l->weight.to(xdtype));
  l->train();
  const at::Tensor x = at::randn({3, tokens, in}).to(xdtype), gy = at::randn({3, tokens, 40});
  const Grads want = run(l, x, gy, /*plain=*/true, autocast), got = run(l, x, gy, /*plain=*/false, autocast);
  // relative to the whole gradient's size: a bf16 product rounds each entry
  // once, where the adapter's A gradient sums its slices in fp32
  const auto close = [tol](const at::Tensor& a, const at::Tensor& b) {
    const at::Tensor d = (a.to(at::kFloat) - b.to(at::kFloat)).norm(), n = b.to(at::kFloat).norm();
    return d.item<double>() <= tol * n.item<double>();
  };
  // one slice: the same bits; several: A(h) is a product per slice, which
  // MKL may round otherwise than the whole one
  if (3 * tokens * in * 4 <= (8 << 20)) EXPECT_TRUE(at::equal(want.y, got.y)) << "forward differs";
  EXPECT_TRUE(close(want.y, got.y)) << "forward differs";
  for (const auto& [name, w, g] : {std::tuple{"x", want.gx, got.gx}, {"A", want.gA, got.gA}, {"B", want.gB, got.gB}})
    EXPECT_TRUE(close(w, g)) << "the gradient of " << name << ": |difference| "
                             << (w.to(at::kFloat) - g.to(at::kFloat)).norm().item<double>() << " against |gradient| "
                             << w.to(at::kFloat).norm().item<double>();
  // dropout really dropped: without it the output differs
  l->eval();
  at::NoGradGuard no_grad;
  EXPECT_FALSE(at::allclose(l->forward(x).to(at::kFloat), got.y.to(at::kFloat))) << "nothing was dropped";
}

TEST(LoraProduct, EqualsThePlainCompositionInFp32) { compare(false, at::kFloat, 1e-6); }
TEST(LoraProduct, EqualsThePlainCompositionUnderBf16Autocast) { compare(true, at::kFloat, 1e-2); }
TEST(LoraProduct, EqualsThePlainCompositionOnBf16InputsUnderAutocast) { compare(true, at::kBFloat16, 1e-2); }
TEST(LoraProduct, EqualsThePlainCompositionOnBf16InputsWithFp32Adapters) { compare(false, at::kBFloat16, 1e-2); }

// 4,096 features: 512 rows a slice, so 1,200 rows take three (the last short)
TEST(LoraProduct, EqualsThePlainCompositionOverSeveralSlicesOfRows) { compare(false, at::kFloat, 1e-5, 4096, 400); }
TEST(LoraProduct, EqualsThePlainCompositionOverSeveralSlicesUnderAutocast) {
  compare(true, at::kBFloat16, 1e-2, 4096, 400);
}

TEST(LoraProduct, WithoutDropoutInEvaluationModeTheOutputIsTheSame) {
  at::manual_seed(0);
  Linear l(16, 12, false);
  l->add_adapter(4, 8, 0.5);
  {
    at::NoGradGuard no_grad;
    l->lora_B->weight.normal_(0, 0.1);
  }
  l->eval();
  const at::Tensor x = at::randn({6, 16});
  at::Tensor want = at::linear(x, l->weight) + at::linear(at::linear(x, l->lora_A->weight), l->lora_B->weight) * l->scale_;
  EXPECT_TRUE(at::allclose(l->forward(x), want, 1e-6, 1e-6));
}

}  // namespace
}  // namespace wick
