#pragma once
/// \file adamw8bit_math.hpp
/// One element of optim `adamw8bit`'s step, as the engine's CUDA kernel
/// (adamw8bit_step.cu) computes it and as a test computes it on the CPU with
/// the same code: the moments decoded from their 8-bit codes (dynamic map x
/// the block's absmax), torch.optim.AdamW's rule in float, and the nearest
/// code of a moment over its block's new absmax (the first midpoint of the
/// map at or above it: bucketize's, ties to the lower code). Plain types only:
/// nvcc compiles it without LibTorch's headers.
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define WICK_HD __host__ __device__
#else
#define WICK_HD
#endif

namespace wick::kernels {

/// The step's numbers, each rounded to float from the double the optimizer
/// computes it in (as ATen turns a double scalar into a float tensor's).
struct Adam8Hyper {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float c2;     ///< sqrt(1 - beta2^step)
  float decay;  ///< 1 - lr * weight_decay (1: no decay)
  float step;   ///< -lr / (1 - beta1^step)
};

/// The new first and second moments of an element from its old ones.
WICK_HD inline void adam8_moments(float m_old, float v_old, float g, const Adam8Hyper& h, float& m, float& v) {
  m = m_old * h.beta1 + h.one_minus_beta1 * g;
  v = v_old * h.beta2 + h.one_minus_beta2 * g * g;
}

/// The weight after the step, from the new moments.
WICK_HD inline float adam8_weight(float w, float m, float v, const Adam8Hyper& h) {
  const float denom = sqrtf(v) / h.c2 + h.eps;
  if (h.decay != 1.0f) w = w * h.decay;
  return w + h.step * (m / denom);
}

/// The code of `x` (already divided by its block's absmax): how many of the
/// 255 midpoints between the map's sorted values lie below it.
WICK_HD inline std::uint8_t adam8_code(float x, const float* mids) {
  int lo = 0, hi = 255;  // the answer is in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (mids[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return static_cast<std::uint8_t>(lo);
}

}  // namespace wick::kernels
