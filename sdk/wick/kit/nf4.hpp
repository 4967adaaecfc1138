#pragma once
/// \file nf4.hpp
/// 4-bit NormalFloat (NF4) weights with double quantization (Dettmers et al.,
/// QLoRA, 2023), in bitsandbytes' layout. A weight is cut into blocks of 64
/// values; each block keeps its largest magnitude (absmax) and, per value, the
/// index of the nearest of the 16 NF4 levels to value / absmax, two indices to
/// a byte (the first in the high nibble). Double quantization stores the
/// absmax constants in 8 bits: their mean (the offset) is subtracted, and each
/// block of 256 constants keeps its largest magnitude in fp32 and, per
/// constant, the index of the nearest of 256 values of bitsandbytes' signed
/// dynamic map (create_dynamic_map: 7 exponent bits) to constant / that
/// magnitude. Storage per weight: 4 bits + 8 / 64 + 32 / (64 * 256) bits =
/// 4.127 bits. quantize_4bit(w, blocksize=64, quant_type="nf4",
/// compress_statistics=True) gives the same bytes.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>
#include <stdexcept>
#include <string>

namespace wick {

/// The 16 NF4 levels: quantiles of N(0, 1) scaled to [-1, 1], with an exact 0
/// (the QLoRA paper's table, as bitsandbytes ships it).
inline const float* nf4_levels() {
  static const float levels[16] = {-1.0f,
                                   -0.6961928009986877f,
                                   -0.5250730514526367f,
                                   -0.39491748809814453f,
                                   -0.28444138169288635f,
                                   -0.18477343022823334f,
                                   -0.09105003625154495f,
                                   0.0f,
                                   0.07958029955625534f,
                                   0.16093020141124725f,
                                   0.24611230194568634f,
                                   0.33791524171829224f,
                                   0.44070982933044434f,
                                   0.5626170039176941f,
                                   0.7229568362236023f,
                                   1.0f};
  return levels;
}

/// bitsandbytes' signed dynamic 8-bit map (create_dynamic_map(signed=True,
/// max_exponent_bits=7, total_bits=8)): 256 sorted values in [-1, 1], the same
/// float32 arithmetic.
inline at::Tensor dynamic_map() {
  std::vector<at::Tensor> parts;
  for (int i = 0; i < 7; ++i) {
    const std::int64_t items = (std::int64_t{1} << i) + 1;
    at::Tensor b = at::linspace(0.1, 1.0, items, at::TensorOptions().dtype(at::kFloat));
    at::Tensor means = (b.slice(0, 0, items - 1) + b.slice(0, 1)) / 2.0;
    const double scale = std::pow(10.0, -6 + i);
    parts.push_back(means * scale);
    parts.push_back(means * -scale);
  }
  parts.push_back(at::zeros({1}, at::kFloat));
  parts.push_back(at::ones({1}, at::kFloat));
  return std::get<0>(at::cat(parts).sort());
}

/// The NF4 levels (kind 0) or the dynamic map (kind 1) on `device`, made once
/// per device.
inline const at::Tensor& nf4_table(int kind, const at::Device& device) {
  static std::mutex mu;
  // never destroyed: tensors on a GPU must not outlive its context at exit
  static auto* tables = new std::map<std::pair<int, std::string>, at::Tensor>();
  std::lock_guard<std::mutex> lock(mu);
  auto& t = (*tables)[{kind, device.str()}];
  if (!t.defined()) {
    at::Tensor cpu = kind == 0 ? at::from_blob(const_cast<float*>(nf4_levels()), {16}, at::kFloat).clone() : dynamic_map();
    t = cpu.to(device);
  }
  return t;
}

/// The index of the nearest entry of sorted `levels` to each value of `x`.
inline at::Tensor nearest(const at::Tensor& x, const at::Tensor& levels) {
  const auto n = levels.numel();
  at::Tensor mids = (levels.slice(0, 1) + levels.slice(0, 0, n - 1)) / 2;
  return at::bucketize(x, mids);
}

struct Nf4Weight {
  at::Tensor packed;        ///< uint8 [numel / 2]: two level indices per byte
  at::Tensor absmax_q;      ///< uint8 [blocks]: index into dynamic_map() of (absmax - offset) / scale
  at::Tensor absmax_scale;  ///< float [ceil(blocks / 256)]: largest |absmax - offset| per 256 constants
  at::Tensor absmax_offset; ///< float []: the mean of the absmax constants
  std::vector<std::int64_t> shape;
  std::int64_t block = 64, scale_block = 256;

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : shape) n *= s;
    return n;
  }
  std::int64_t bytes() const {
    return static_cast<std::int64_t>(packed.nbytes() + absmax_q.nbytes() + absmax_scale.nbytes() + absmax_offset.nbytes());
  }
};

/// Quantizes `w` (any float dtype; numel a multiple of `block`, and even).
inline Nf4Weight nf4_quantize(const at::Tensor& w, std::int64_t block = 64, std::int64_t scale_block = 256) {
  if (w.numel() % block != 0)
    throw std::invalid_argument("nf4: a weight of " + std::to_string(w.numel()) + " values is not a multiple of the block size " +
                                std::to_string(block));
  at::NoGradGuard no_grad;
  Nf4Weight q;
  q.shape = w.sizes().vec();
  q.block = block;
  q.scale_block = scale_block;
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(w.device());
  at::Tensor blocks = w.detach().to(at::kFloat).reshape({-1, block});
  at::Tensor absmax = blocks.abs().amax(1);
  at::Tensor normed = blocks / absmax.clamp_min(1e-12).unsqueeze(1);
  at::Tensor idx = nearest(normed.reshape({-1}), nf4_table(0, w.device())).to(at::kByte);
  idx = idx.reshape({-1, 2});
  q.packed = (idx.select(1, 0).bitwise_left_shift(4)).bitwise_or(idx.select(1, 1)).contiguous();
  // double quantization of the constants
  q.absmax_offset = absmax.mean();
  at::Tensor centred = absmax - q.absmax_offset;
  const std::int64_t nb = absmax.numel();
  const std::int64_t groups = (nb + scale_block - 1) / scale_block;
  at::Tensor padded = at::zeros({groups * scale_block}, opts);
  padded.slice(0, 0, nb).copy_(centred);
  at::Tensor scale = padded.reshape({groups, scale_block}).abs().amax(1);
  q.absmax_scale = scale;
  at::Tensor per = scale.clamp_min(1e-12).repeat_interleave(scale_block).slice(0, 0, nb);
  q.absmax_q = nearest(centred / per, nf4_table(1, w.device())).to(at::kByte);
  return q;
}

/// nf4_quantize(w, block, scale_block), computed `chunk_blocks` blocks at a
/// time: the same bytes, with float temporaries of chunk_blocks * block
/// values rather than of the whole weight's (quantizing while loading).
inline Nf4Weight nf4_quantize_chunked(const at::Tensor& w, std::int64_t block = 64, std::int64_t scale_block = 256,
                                      std::int64_t chunk_blocks = 16384) {
  if (w.numel() % block != 0)
    throw std::invalid_argument("nf4: a weight of " + std::to_string(w.numel()) + " values is not a multiple of the block size " +
                                std::to_string(block));
  if (w.numel() % 2 != 0)
    throw std::invalid_argument("nf4: a weight of " + std::to_string(w.numel()) + " values is odd, expected an even count");
  chunk_blocks += chunk_blocks % 2;  // every chunk but the last packs an even number of values
  at::NoGradGuard no_grad;
  Nf4Weight q;
  q.shape = w.sizes().vec();
  q.block = block;
  q.scale_block = scale_block;
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(w.device());
  const at::Tensor rows = w.detach().reshape({-1, block});
  const std::int64_t nb = rows.size(0);
  at::Tensor absmax = at::empty({nb}, opts);
  q.packed = at::empty({w.numel() / 2}, opts.dtype(at::kByte));
  for (std::int64_t s = 0; s < nb; s += chunk_blocks) {
    const std::int64_t n = std::min(chunk_blocks, nb - s);
    at::Tensor blocks = rows.narrow(0, s, n).to(at::kFloat);
    at::Tensor am = blocks.abs().amax(1);
    absmax.narrow(0, s, n).copy_(am);
    at::Tensor normed = blocks / am.clamp_min(1e-12).unsqueeze(1);
    blocks = at::Tensor();
    at::Tensor idx = nearest(normed.reshape({-1}), nf4_table(0, w.device())).to(at::kByte).reshape({-1, 2});
    q.packed.narrow(0, s * block / 2, n * block / 2).copy_(idx.select(1, 0).bitwise_left_shift(4).bitwise_or(idx.select(1, 1)));
  }
  // double quantization of the constants, as nf4_quantize does it
  q.absmax_offset = absmax.mean();
  at::Tensor centred = absmax - q.absmax_offset;
  const std::int64_t groups = (nb + scale_block - 1) / scale_block;
  at::Tensor padded = at::zeros({groups * scale_block}, opts);
  padded.slice(0, 0, nb).copy_(centred);
  at::Tensor scale = padded.reshape({groups, scale_block}).abs().amax(1);
  q.absmax_scale = scale;
  at::Tensor per = scale.clamp_min(1e-12).repeat_interleave(scale_block).slice(0, 0, nb);
  q.absmax_q = nearest(centred / per, nf4_table(1, w.device())).to(at::kByte);
  return q;
}

/// The weight back, in `dtype`.
inline at::Tensor nf4_dequantize(const Nf4Weight& q, at::ScalarType dtype = at::kFloat) {
  at::NoGradGuard no_grad;
  const std::int64_t nb = q.absmax_q.numel();
  at::Tensor absmax = nf4_table(1, q.packed.device()).index_select(0, q.absmax_q.to(at::kLong)) *
                           q.absmax_scale.repeat_interleave(q.scale_block).slice(0, 0, nb) +
                       q.absmax_offset;
  at::Tensor hi = q.packed.bitwise_right_shift(4), lo = q.packed.bitwise_and(15);
  at::Tensor idx = at::stack({hi, lo}, 1).reshape({-1}).to(at::kLong);
  at::Tensor w = nf4_table(0, q.packed.device()).index_select(0, idx).reshape({-1, q.block}) * absmax.unsqueeze(1);
  return w.reshape(q.shape).to(dtype);
}

namespace detail {

/// y = x W^T with W dequantized from NF4 in the forward and again in the
/// backward: only the 4-bit weight stays alive between them.
struct Nf4LinearFunction : torch::autograd::Function<Nf4LinearFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                at::TensorList q, std::vector<std::int64_t> shape, std::int64_t block,
                                                std::int64_t scale_block) {
    Nf4Weight w{q[0], q[1], q[2], q[3], shape, block, scale_block};
    ctx->save_for_backward({q[0], q[1], q[2], q[3]});
    ctx->saved_data["shape"] = c10::IValue(shape);
    ctx->saved_data["block"] = block;
    ctx->saved_data["scale_block"] = scale_block;
    return {at::matmul(x, nf4_dequantize(w, x.scalar_type()).t())};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    Nf4Weight w{saved[0], saved[1], saved[2], saved[3], ctx->saved_data["shape"].toIntVector(),
                ctx->saved_data["block"].toInt(), ctx->saved_data["scale_block"].toInt()};
    at::Tensor gx = at::matmul(grads[0], nf4_dequantize(w, grads[0].scalar_type()));
    return {gx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace detail

/// x W^T for an NF4 weight, computed in x's dtype, differentiable in x.
inline at::Tensor nf4_linear(const at::Tensor& x, const Nf4Weight& w) {
  return detail::Nf4LinearFunction::apply(x, at::TensorList({w.packed, w.absmax_q, w.absmax_scale, w.absmax_offset}),
                                          w.shape, w.block, w.scale_block)[0];
}

}  // namespace wick
