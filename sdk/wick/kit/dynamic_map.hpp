#pragma once
/// \file dynamic_map.hpp
/// bitsandbytes' dynamic 8-bit data type (Dettmers, "8-Bit Approximations for
/// Parallelism in Deep Learning"): 256 sorted values in [-1, 1] (signed) or
/// [0, 1] (unsigned), dense near 0, and the nearest-value lookup that
/// quantizes into it. Used by NF4's double quantization (kit/nf4.hpp) and the
/// 8-bit optimizer states (optim `adamw8bit`).

#include <ATen/ATen.h>

#include <cstdint>
#include <cmath>
#include <tuple>
#include <vector>

namespace wick {

/// create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), with the
/// same float32 arithmetic: for each decade 10^-6 .. 10^0, the midpoints of a
/// linear split of [0.1, 1] (2^i + 1 points for decade i, twice as many when
/// unsigned), mirrored when signed, plus 0 and 1, sorted.
inline at::Tensor dynamic_map(bool is_signed = true) {
  std::vector<at::Tensor> parts;
  for (int i = 0; i < 7; ++i) {
    const std::int64_t items = (std::int64_t{1} << (is_signed ? i : i + 1)) + 1;
    at::Tensor b = at::linspace(0.1, 1.0, items, at::TensorOptions().dtype(at::kFloat));
    at::Tensor means = (b.slice(0, 0, items - 1) + b.slice(0, 1)) / 2.0;
    const double scale = std::pow(10.0, -6 + i);
    parts.push_back(means * scale);
    if (is_signed) parts.push_back(means * -scale);
  }
  parts.push_back(at::zeros({1}, at::kFloat));
  parts.push_back(at::ones({1}, at::kFloat));
  return std::get<0>(at::cat(parts).sort());
}

/// The index of the nearest entry of sorted `levels` to each value of `x`
/// (a value halfway between two takes the lower).
inline at::Tensor nearest(const at::Tensor& x, const at::Tensor& levels) {
  const auto n = levels.numel();
  at::Tensor mids = (levels.slice(0, 1) + levels.slice(0, 0, n - 1)) / 2;
  return at::bucketize(x, mids);
}

}  // namespace wick
