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
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>
#include <stdexcept>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "wick/kit/deferral.hpp"
#include "wick/kit/dynamic_map.hpp"

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

/// A quantized weight's tensors as hollow ones (wick/kit/deferral.hpp): the
/// shapes nf4_quantize gives a weight of `shape`, no bytes (a deferred build).
inline Nf4Weight nf4_hollow(const std::vector<std::int64_t>& shape, std::int64_t block = 64,
                            std::int64_t scale_block = 256) {
  Nf4Weight q;
  q.shape = shape;
  q.block = block;
  q.scale_block = scale_block;
  const std::int64_t n = q.numel(), blocks = n / block, groups = (blocks + scale_block - 1) / scale_block;
  const auto bytes = at::TensorOptions().dtype(at::kByte), floats = at::TensorOptions().dtype(at::kFloat);
  q.packed = hollow({n / 2}, bytes);
  q.absmax_q = hollow({blocks}, bytes);
  q.absmax_scale = hollow({groups}, floats);
  q.absmax_offset = hollow({}, floats);
  return q;
}

/// Double quantization: the absmax constants (float [blocks]) into q's
/// absmax_offset (their mean), absmax_scale (the largest |absmax - offset|
/// of each q.scale_block constants) and absmax_q (dynamic-map indices).
inline void nf4_quantize_constants(Nf4Weight& q, const at::Tensor& absmax) {
  q.absmax_offset = absmax.mean();
  at::Tensor centred = absmax - q.absmax_offset;
  const std::int64_t nb = absmax.numel(), scale_block = q.scale_block;
  const std::int64_t groups = (nb + scale_block - 1) / scale_block;
  at::Tensor padded = at::zeros({groups * scale_block}, absmax.options());
  padded.slice(0, 0, nb).copy_(centred);
  at::Tensor scale = padded.reshape({groups, scale_block}).abs().amax(1);
  q.absmax_scale = scale;
  at::Tensor per = scale.clamp_min(1e-12).repeat_interleave(scale_block).slice(0, 0, nb);
  q.absmax_q = nearest(centred / per, nf4_table(1, absmax.device())).to(at::kByte);
}

namespace detail {

/// The 15 midpoints between neighbouring NF4 levels, in float, as nearest()
/// (wick/kit/dynamic_map.hpp) computes them.
inline const float* nf4_mids() {
  static const std::array<float, 15> mids = [] {
    std::array<float, 15> m{};
    const float* l = nf4_levels();
    for (int k = 0; k < 15; ++k) m[k] = (l[k + 1] + l[k]) / 2.0f;
    return m;
  }();
  return mids.data();
}

/// The packed codes of values [first, last) of `v` (both even) on the CPU:
/// each value divided by its block's constant (`scale`, absmax clamped, one
/// per block of the whole weight) and given the index of the nearest level
/// in one pass, the bytes nf4_pack's ATen route gives (at::bucketize over the
/// midpoints: the count of midpoints not >= the value, so a value on a
/// midpoint takes the lower level and NaN the highest). A binary search per
/// value (bucketize) took over half of building LLaMA-2-7B's quantized
/// layers on the host; 15 comparisons over a run of values vectorize.
template <class T>
void nf4_pack_cpu(const T* v, const float* scale, std::int64_t block, std::int64_t first, std::int64_t last,
                  std::uint8_t* out) {
  const float* mids = nf4_mids();
  constexpr std::int64_t kRun = 512;  // values a pass (even)
  at::parallel_for(first / 2, last / 2, 16384, [&](std::int64_t p0, std::int64_t p1) {
    alignas(64) float x[kRun], d[kRun];
    alignas(64) std::int32_t code[kRun];
    for (std::int64_t s = 2 * p0; s < 2 * p1; s += kRun) {
      const std::int64_t n = std::min(kRun, 2 * p1 - s);
      for (std::int64_t i = s; i < s + n;) {  // a run of one block's values at a time
        const std::int64_t b = i / block, e = std::min(s + n, (b + 1) * block);
        for (std::int64_t j = i; j < e; ++j) {
          x[j - s] = static_cast<float>(v[j]);
          d[j - s] = scale[b];
        }
        i = e;
      }
      std::int64_t j = 0;
#if defined(__SSE2__)
      // four values at a time: the same float division and comparisons
      // (!(m >= x): NaN counts past every midpoint, as in bucketize)
      for (; j + 4 <= n; j += 4) {
        const __m128 xv = _mm_div_ps(_mm_load_ps(x + j), _mm_load_ps(d + j));
        __m128i c = _mm_setzero_si128();
        for (int k = 0; k < 15; ++k) c = _mm_sub_epi32(c, _mm_castps_si128(_mm_cmpnge_ps(_mm_set1_ps(mids[k]), xv)));
        _mm_store_si128(reinterpret_cast<__m128i*>(code + j), c);
      }
#endif
      for (; j < n; ++j) {
        const float xv = x[j] / d[j];
        std::int32_t c = 0;
        for (int k = 0; k < 15; ++k) c += !(mids[k] >= xv);
        code[j] = c;
      }
      std::uint8_t* o = out + (s - first) / 2;
      for (std::int64_t q = 0; q < n / 2; ++q) o[q] = static_cast<std::uint8_t>((code[2 * q] << 4) | code[2 * q + 1]);
    }
  });
}

/// nf4_pack_cpu over a CPU tensor (contiguous, float, bf16 or half): whether it applied.
inline bool nf4_pack_cpu_applies(const at::Tensor& flat) {
  const auto t = flat.scalar_type();
  return flat.device().is_cpu() && flat.is_contiguous() &&
         (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf);
}
inline void nf4_pack_cpu(const at::Tensor& flat, const at::Tensor& scale, std::int64_t block, std::int64_t first,
                         std::int64_t last, at::Tensor& out) {
  const at::Tensor sc = scale.to(at::kFloat).contiguous();
  auto* o = out.data_ptr<std::uint8_t>();
  switch (flat.scalar_type()) {
    case at::kFloat:
      return nf4_pack_cpu(flat.const_data_ptr<float>(), sc.const_data_ptr<float>(), block, first, last, o);
    case at::kBFloat16:
      return nf4_pack_cpu(flat.const_data_ptr<at::BFloat16>(), sc.const_data_ptr<float>(), block, first, last, o);
    default:
      return nf4_pack_cpu(flat.const_data_ptr<at::Half>(), sc.const_data_ptr<float>(), block, first, last, o);
  }
}

}  // namespace detail

/// Quantizes `w` (any float dtype; numel a multiple of `block`, and even).
inline Nf4Weight nf4_quantize(const at::Tensor& w, std::int64_t block = 64, std::int64_t scale_block = 256) {
  if (w.numel() % 2 != 0)
    throw std::invalid_argument("nf4: a weight of " + std::to_string(w.numel()) +
                                " values is odd, expected an even count (two 4-bit values share a byte; an even block "
                                "size makes every weight even)");
  if (w.numel() % block != 0)
    throw std::invalid_argument("nf4: a weight of " + std::to_string(w.numel()) + " values is not a multiple of the block size " +
                                std::to_string(block));
  at::NoGradGuard no_grad;
  Nf4Weight q;
  q.shape = w.sizes().vec();
  q.block = block;
  q.scale_block = scale_block;
  at::Tensor blocks = w.detach().to(at::kFloat).reshape({-1, block});
  at::Tensor absmax = blocks.abs().amax(1);
  if (const at::Tensor flat = w.detach().reshape({-1}); detail::nf4_pack_cpu_applies(flat)) {
    q.packed = at::empty({flat.numel() / 2}, at::TensorOptions().dtype(at::kByte));
    detail::nf4_pack_cpu(flat, absmax.clamp_min(1e-12), block, 0, flat.numel(), q.packed);
    nf4_quantize_constants(q, absmax);
    return q;
  }
  at::Tensor normed = blocks / absmax.clamp_min(1e-12).unsqueeze(1);
  at::Tensor idx = nearest(normed.reshape({-1}), nf4_table(0, w.device())).to(at::kByte);
  idx = idx.reshape({-1, 2});
  q.packed = (idx.select(1, 0).bitwise_left_shift(4)).bitwise_or(idx.select(1, 1)).contiguous();
  nf4_quantize_constants(q, absmax);
  return q;
}

/// The absmax constants of blocks [first, last) of `w` (any float dtype,
/// numel a multiple of `block`): float [last - first]. Only those blocks'
/// values are read (of a mapped file, only their bytes), `chunk_blocks` at a
/// time.
inline at::Tensor nf4_absmax(const at::Tensor& w, std::int64_t block, std::int64_t first, std::int64_t last,
                             std::int64_t chunk_blocks = 16384) {
  at::NoGradGuard no_grad;
  const at::Tensor rows = w.detach().reshape({-1, block});
  at::Tensor absmax = at::empty({last - first}, at::TensorOptions().dtype(at::kFloat).device(w.device()));
  for (std::int64_t s = first; s < last; s += chunk_blocks) {
    const std::int64_t n = std::min(chunk_blocks, last - s);
    absmax.narrow(0, s - first, n).copy_(rows.narrow(0, s, n).to(at::kFloat).abs().amax(1));
  }
  return absmax;
}

/// The 4-bit codes of values [first, last) of `w` (both even), as packed
/// bytes (uint8 [(last - first) / 2]), given `absmax`, the constants of
/// every block (nf4_absmax over the whole weight). Only those values are
/// read (on a GPU `chunk_blocks` blocks' worth at a time; on the CPU in one
/// pass, detail::nf4_pack_cpu); each value's code is the one nf4_quantize
/// gives it.
inline at::Tensor nf4_pack(const at::Tensor& w, const at::Tensor& absmax, std::int64_t block, std::int64_t first,
                           std::int64_t last, std::int64_t chunk_blocks = 16384) {
  if (first % 2 != 0 || last % 2 != 0)
    throw std::invalid_argument("nf4_pack: the values [" + std::to_string(first) + ", " + std::to_string(last) +
                                ") cut a byte (two values share one), expected even ends");
  if (block < 1 || first < 0 || first > last || last > w.numel())
    throw std::invalid_argument("nf4_pack: the values [" + std::to_string(first) + ", " + std::to_string(last) +
                                ") in blocks of " + std::to_string(block) + " of a weight of " +
                                std::to_string(w.numel()) + " values, expected a range inside it and a block >= 1");
  if (absmax.numel() < (last + block - 1) / block)
    throw std::invalid_argument("nf4_pack: " + std::to_string(absmax.numel()) + " block constants for values up to " +
                                std::to_string(last) + " in blocks of " + std::to_string(block) +
                                ", expected the constants of every block of the weight (nf4_absmax over all of it)");
  at::NoGradGuard no_grad;
  const at::Tensor flat = w.detach().reshape({-1});
  const at::Tensor scale = absmax.to(w.device()).clamp_min(1e-12);
  at::Tensor packed = at::empty({(last - first) / 2}, at::TensorOptions().dtype(at::kByte).device(w.device()));
  if (detail::nf4_pack_cpu_applies(flat)) {
    detail::nf4_pack_cpu(flat, scale, block, first, last, packed);
    return packed;
  }
  std::int64_t step = chunk_blocks * block;
  step += step % 2;  // every piece but the last packs an even number of values
  for (std::int64_t s = first; s < last;) {
    // up to the end of the chunk of blocks s falls in (an even count of values)
    const std::int64_t e = std::min(last, (s / step + 1) * step);
    const std::int64_t b0 = s / block, b1 = (e + block - 1) / block;
    const at::Tensor per = scale.narrow(0, b0, b1 - b0).repeat_interleave(block).narrow(0, s - b0 * block, e - s);
    at::Tensor normed = flat.narrow(0, s, e - s).to(at::kFloat) / per;
    at::Tensor idx = nearest(normed, nf4_table(0, w.device())).to(at::kByte).reshape({-1, 2});
    packed.narrow(0, (s - first) / 2, (e - s) / 2)
        .copy_(idx.select(1, 0).bitwise_left_shift(4).bitwise_or(idx.select(1, 1)));
    s = e;
  }
  return packed;
}

/// nf4_quantize(w, block, scale_block), computed `chunk_blocks` blocks at a
/// time (nf4_absmax, then nf4_pack): the same bytes, with float temporaries
/// of chunk_blocks * block values rather than of the whole weight's
/// (quantizing while loading).
inline Nf4Weight nf4_quantize_chunked(const at::Tensor& w, std::int64_t block = 64, std::int64_t scale_block = 256,
                                      std::int64_t chunk_blocks = 16384) {
  if (w.numel() % block != 0)
    throw std::invalid_argument("nf4: a weight of " + std::to_string(w.numel()) + " values is not a multiple of the block size " +
                                std::to_string(block));
  if (w.numel() % 2 != 0)
    throw std::invalid_argument("nf4: a weight of " + std::to_string(w.numel()) + " values is odd, expected an even count");
  chunk_blocks += chunk_blocks % 2;  // every chunk but the last packs an even number of values
  Nf4Weight q;
  q.shape = w.sizes().vec();
  q.block = block;
  q.scale_block = scale_block;
  const at::Tensor absmax = nf4_absmax(w, block, 0, w.numel() / block, chunk_blocks);
  q.packed = nf4_pack(w, absmax, block, 0, w.numel(), chunk_blocks);
  nf4_quantize_constants(q, absmax);
  return q;
}

namespace detail {

/// A product decodes its weight a slice at a time: the decoded weight of one
/// slice is all of it that exists at a time. A slice holds at most this many
/// bytes of decoded weight (16 MiB: LLaMA-2-7B's 4096 x 4096 products in 4
/// slices of float, the ATen decode's, or 2 of bf16, the GPU kernel's; its
/// 11008 x 4096 ones in 11 or 6); a smaller weight is one slice.
/// Each slice cost a dozen kernel launches on a GPU, so a fixed count of 8
/// made a small model's QLoRA step launch-bound (an H200 ran a 6-layer,
/// 512-wide model at 0.27x the tokens per second of bitsandbytes' one fused
/// dequantization per product); on a GPU a slice is now one launch of the
/// engine's kernel (nf4_use_kernel) and its product.
inline constexpr std::int64_t kNf4SliceBytes = std::int64_t{16} << 20;

/// The slice limit in force (kNf4SliceBytes; a test lowers it to see the
/// slicing on small weights).
inline std::int64_t& nf4_slice_bytes() {
  static std::int64_t bytes = kNf4SliceBytes;
  return bytes;
}

/// How many slices the weight `q` is decoded in (at least 1), a decoded
/// value taking `value_bytes` (4: the ATen decode's float; the kernel's
/// product dtype where it decodes, nf4_value_bytes).
inline std::int64_t nf4_slices(const Nf4Weight& q, std::int64_t value_bytes = 4) {
  const std::int64_t limit = std::max<std::int64_t>(1, nf4_slice_bytes());
  return std::max<std::int64_t>(1, (q.numel() * value_bytes + limit - 1) / limit);
}

/// Whether a CUDA weight decodes with the engine's kernel (the operator
/// wick::nf4_decode, host/kernels/: one launch straight into the product's
/// dtype) where this process has it; bench/nf4.cpp turns it off to compare the
/// kernel with the ATen decode below, which gives the same bits.
inline bool& nf4_use_kernel() {
  static bool on = true;
  return on;
}

/// The operator, if the engine that loaded this code was built with CUDA.
inline const std::optional<c10::OperatorHandle>& nf4_kernel_op() {
  static const std::optional<c10::OperatorHandle> op = c10::Dispatcher::singleton().findSchema({"wick::nf4_decode", ""});
  return op;
}

/// Whether `q` decodes into `dtype` with the kernel.
inline bool nf4_kernel_applies(const Nf4Weight& q, at::ScalarType dtype) {
  return nf4_use_kernel() && q.packed.is_cuda() &&
         (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && nf4_kernel_op().has_value();
}

/// The two levels of each of the 256 packed bytes (high nibble first), [256, 2]
/// float on `device`: one int32 index per byte decodes two weights.
inline const at::Tensor& nf4_pair_table(const at::Device& device) {
  static std::mutex mu;
  static auto* tables = new std::map<std::string, at::Tensor>();  // never destroyed, as nf4_table's
  std::lock_guard<std::mutex> lock(mu);
  auto& t = (*tables)[device.str()];
  if (!t.defined()) {
    at::Tensor levels = at::from_blob(const_cast<float*>(nf4_levels()), {16}, at::kFloat);
    at::Tensor byte = at::arange(256, at::kLong);
    t = at::stack({levels.index_select(0, byte.floor_divide(16)), levels.index_select(0, byte.remainder(16))}, 1).to(device);
  }
  return t;
}

/// Values [row0, row0 + rows) x [col0, col0 + cols) of the weight seen as rows
/// of `width` values, [rows, cols] in `dtype`, by the kernel (nf4_kernel_applies).
inline at::Tensor nf4_kernel_decode(const Nf4Weight& q, std::int64_t width, std::int64_t row0, std::int64_t rows,
                                    std::int64_t col0, std::int64_t cols, at::ScalarType dtype) {
  static const auto op =
      nf4_kernel_op()
          ->typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                             std::int64_t, std::int64_t, at::ScalarType)>();
  const at::Device device = q.packed.device();
  return op.call(q.packed.contiguous(), q.absmax_q.contiguous(), q.absmax_scale.contiguous(),
                 q.absmax_offset.contiguous(), nf4_table(1, device), nf4_table(0, device), width, row0, rows, col0, cols,
                 q.block, q.scale_block, dtype);
}

/// The absmax constants of blocks [b0, b1), float: the same float arithmetic
/// as the whole weight's (map value x scale + offset).
inline at::Tensor nf4_absmax(const Nf4Weight& q, std::int64_t b0, std::int64_t b1) {
  const at::Device device = q.packed.device();
  const std::int64_t g0 = b0 / q.scale_block, g1 = (b1 - 1) / q.scale_block + 1;
  at::Tensor scale = q.absmax_scale.slice(0, g0, g1).unsqueeze(1).expand({g1 - g0, q.scale_block}).reshape({-1});
  scale = scale.slice(0, b0 - g0 * q.scale_block, b1 - g0 * q.scale_block);
  return nf4_table(1, device).index_select(0, q.absmax_q.slice(0, b0, b1).to(at::kInt)) * scale + q.absmax_offset;
}

/// Every block's absmax constant, decoded a slice at a time.
inline at::Tensor nf4_absmax_all(const Nf4Weight& q) {
  const std::int64_t slices = nf4_slices(q);
  const std::int64_t nb = q.absmax_q.numel(), step = std::max<std::int64_t>(1, (nb + slices - 1) / slices);
  at::Tensor out = at::empty({nb}, q.absmax_scale.options());
  for (std::int64_t b0 = 0; b0 < nb; b0 += step) out.slice(0, b0, std::min(nb, b0 + step)).copy_(nf4_absmax(q, b0, std::min(nb, b0 + step)));
  return out;
}

/// Values [p0, p1) of the flattened weight in `dtype`: level x absmax in
/// float, the same float arithmetic as the whole weight's, rounded once to
/// `dtype`. The ATen decode reads whole bytes around the range.
inline at::Tensor nf4_decode_range(const Nf4Weight& q, std::int64_t p0, std::int64_t p1,
                                   at::ScalarType dtype = at::kFloat) {
  if (nf4_kernel_applies(q, dtype)) return nf4_kernel_decode(q, q.numel(), 0, 1, p0, p1 - p0, dtype).view({-1});
  const std::int64_t B = q.block;
  const std::int64_t a = p0 / 2 * 2, b = (p1 + 1) / 2 * 2;  // on byte boundaries
  const std::int64_t k0 = a / B, k1 = (b - 1) / B + 1;       // the blocks they touch
  at::Tensor vals = nf4_pair_table(q.packed.device()).index_select(0, q.packed.slice(0, a / 2, b / 2).to(at::kInt)).view({-1});
  at::Tensor absmax = nf4_absmax(q, k0, k1);
  if (a == k0 * B && b == k1 * B) {
    vals.view({k1 - k0, B}).mul_(absmax.unsqueeze(1));
  } else {  // a range across blocks (an odd block size, or rows that end inside a block)
    vals.mul_(absmax.unsqueeze(1).expand({k1 - k0, B}).reshape({-1}).slice(0, a - k0 * B, b - k0 * B));
  }
  // a buffer of its own: BLAS may round a product differently at another alignment
  if (dtype != at::kFloat) return vals.slice(0, p0 - a, p1 - a).to(dtype);
  return p0 == a && p1 == b ? vals : vals.slice(0, p0 - a, p1 - a).clone();
}

/// Columns [c0, c1) of the [out, in] weight, [out, c1 - c0] in `dtype`. The
/// kernel decodes them where it applies; else, with `absmax` (every block's
/// constant) the columns are cut from 2-D views of the packed bytes, which
/// needs in % block == 0, an even block and c0, c1 on block boundaries;
/// without, each slice of rows is decoded whole and cut.
inline at::Tensor nf4_decode_columns(const Nf4Weight& q, std::int64_t c0, std::int64_t c1, const at::Tensor& absmax,
                                     at::ScalarType dtype = at::kFloat) {
  const std::int64_t out = q.shape[0], in = q.shape[1], B = q.block, w = c1 - c0;
  if (nf4_kernel_applies(q, dtype)) return nf4_kernel_decode(q, in, 0, out, c0, w, dtype);
  if (absmax.defined()) {
    at::Tensor bytes = q.packed.view({out, in / 2}).slice(1, c0 / 2, c1 / 2).to(at::kInt).contiguous();
    at::Tensor vals = nf4_pair_table(q.packed.device()).index_select(0, bytes.view({-1})).view({out, w / B, B});
    bytes.reset();
    vals.mul_(absmax.view({out, in / B}).slice(1, c0 / B, c1 / B).unsqueeze(2));
    return vals.view({out, w}).to(dtype);
  }
  at::Tensor cols = at::empty({out, w}, q.absmax_scale.options());
  const std::int64_t slices = nf4_slices(q);
  const std::int64_t rows = (out + slices - 1) / slices;
  for (std::int64_t r0 = 0; r0 < out; r0 += rows) {
    const std::int64_t r1 = std::min(out, r0 + rows);
    cols.slice(0, r0, r1).copy_(nf4_decode_range(q, r0 * in, r1 * in).view({r1 - r0, in}).slice(1, c0, c1));
  }
  return cols.to(dtype);
}

inline void nf4_check_matrix(const Nf4Weight& q) {
  if (q.shape.size() != 2)
    throw std::invalid_argument("nf4: a product needs a 2-D weight [out, in], this one has " + std::to_string(q.shape.size()) +
                                " dimensions");
}

/// The slices of output rows a forward product decodes, [begin, end) each:
/// as many rows as the slice limit holds, a multiple of 64 (else of 8) where
/// it holds that many. Each slice's rows are columns of the product, and a
/// GEMM whose column count or start is not a multiple of 8 misses the
/// tensor cores' fast kernels (LLaMA-2-7B's 11008 x 4096 in 11 even slices
/// of 1,001 rows ran 2.3x slower on an H200 than its input gradient did).
inline std::vector<std::pair<std::int64_t, std::int64_t>> nf4_row_slices(const Nf4Weight& q,
                                                                        std::int64_t value_bytes = 4) {
  nf4_check_matrix(q);
  const std::int64_t out = q.shape[0], in = q.shape[1];
  std::int64_t rows = out;
  if (nf4_slices(q, value_bytes) > 1) {
    rows = std::max<std::int64_t>(
        1, std::max<std::int64_t>(1, nf4_slice_bytes()) / (std::max<std::int64_t>(in, 1) * value_bytes));
    const std::int64_t unit = rows >= 64 ? 64 : rows >= 8 ? 8 : 1;
    rows = rows / unit * unit;
  }
  std::vector<std::pair<std::int64_t, std::int64_t>> s;
  for (std::int64_t r0 = 0; r0 < out; r0 += rows) s.emplace_back(r0, std::min(out, r0 + rows));
  return s;
}

/// Whether the input gradient can cut columns from 2-D views of the packed
/// bytes and the absmax constants (whole blocks in a row, two values a byte).
inline bool nf4_column_views(const Nf4Weight& q) { return q.shape[1] % q.block == 0 && q.block % 2 == 0; }

/// The slices of input columns an input gradient decodes, [begin, end) each
/// (whole blocks when nf4_column_views).
inline std::vector<std::pair<std::int64_t, std::int64_t>> nf4_column_slices(const Nf4Weight& q,
                                                                           std::int64_t value_bytes = 4) {
  nf4_check_matrix(q);
  const std::int64_t in = q.shape[1];
  const std::int64_t slices = nf4_slices(q, value_bytes);
  std::int64_t width = (in + slices - 1) / slices;
  if (nf4_column_views(q)) width = (width + q.block - 1) / q.block * q.block;
  std::vector<std::pair<std::int64_t, std::int64_t>> s;
  for (std::int64_t c0 = 0; c0 < in; c0 += width) s.emplace_back(c0, std::min(in, c0 + width));
  return s;
}

/// The dtype of a product with `lhs` on a GPU: autocast's for at::mm where it
/// is on (floating, not double), else lhs's. The weight is decoded straight
/// into it (the same bits as decoding into lhs's dtype and casting: one
/// rounding of the same float value). On the CPU, lhs's.
inline at::ScalarType nf4_product_dtype(const at::Tensor& lhs) {
  const bool cast = lhs.is_cuda() && at::autocast::is_autocast_enabled(at::kCUDA) &&
                    at::isFloatingType(lhs.scalar_type()) && lhs.scalar_type() != at::kDouble;
  return cast ? at::autocast::get_autocast_dtype(at::kCUDA) : lhs.scalar_type();
}

/// The bytes a decoded value of `q` takes in a product's slice, decoded for
/// a product in `dtype`: the kernel writes `dtype` itself (a bf16 slice holds
/// twice the rows of a float one in the same bytes: fewer, wider GEMMs), the
/// ATen decode a float first.
inline std::int64_t nf4_value_bytes(const Nf4Weight& q, at::ScalarType dtype) {
  return nf4_kernel_applies(q, dtype) ? static_cast<std::int64_t>(c10::elementSize(dtype)) : 4;
}

/// The product lhs x rhs(a, b), [rows of lhs, width], whose columns [a, b)
/// are lhs times rhs(a, b) for each of `slices`: a single slice's is the
/// product itself. On a GPU each slice's product is written into its columns
/// of the result (a GEMM with the result's row stride); on the CPU it has a
/// buffer of its own, copied in (MKL's fp32 GEMM rounds by alignment: the
/// same bits as the slices' products alone).
template <class Rhs>
at::Tensor nf4_sliced_product(const std::vector<std::pair<std::int64_t, std::int64_t>>& slices, const at::Tensor& lhs,
                              std::int64_t width, Rhs rhs) {
  if (slices.size() == 1) return at::mm(lhs, rhs(slices[0].first, slices[0].second));
  at::Tensor y;
  if (!lhs.is_cuda()) {
    for (const auto& [a, b] : slices) {
      const at::Tensor p = at::mm(lhs, rhs(a, b));
      if (!y.defined()) y = at::empty({lhs.size(0), width}, p.options());
      y.slice(1, a, b).copy_(p);
    }
    return y;
  }
  // mm_out is not autocast: its operands are cast as autocast casts at::mm's
  const at::ScalarType dt = nf4_product_dtype(lhs);
  const at::Tensor l = lhs.to(dt);
  y = at::empty({lhs.size(0), width}, lhs.options().dtype(dt));
  for (const auto& [a, b] : slices) {
    at::Tensor into = y.slice(1, a, b);
    at::mm_out(into, l, rhs(a, b).to(dt));
  }
  return y;
}

/// x W^T, the weight decoded a slice of output rows at a time (nf4_row_slices);
/// each slice's columns of the result are x times that slice, transposed.
inline at::Tensor nf4_matmul_t(const at::Tensor& x, const Nf4Weight& q) {
  nf4_check_matrix(q);
  const std::int64_t out = q.shape[0], in = q.shape[1];
  const at::Tensor x2 = x.reshape({-1, in});
  const at::ScalarType dt = nf4_product_dtype(x);
  const at::Tensor y = nf4_sliced_product(nf4_row_slices(q, nf4_value_bytes(q, dt)), x2, out,
                                          [&](std::int64_t r0, std::int64_t r1) {
                                            return nf4_decode_range(q, r0 * in, r1 * in, dt).view({r1 - r0, in}).t();
                                          });
  std::vector<std::int64_t> sizes = x.sizes().vec();
  sizes.back() = out;
  return y.view(sizes);
}

/// g W, the weight decoded a slice of input columns at a time
/// (nf4_column_slices; slicing the rows would split the sum over them).
inline at::Tensor nf4_matmul(const at::Tensor& g, const Nf4Weight& q) {
  nf4_check_matrix(q);
  const std::int64_t out = q.shape[0], in = q.shape[1];
  const at::Tensor g2 = g.reshape({-1, out});
  const at::ScalarType dt = nf4_product_dtype(g);
  const at::Tensor absmax = !nf4_kernel_applies(q, dt) && nf4_column_views(q) ? nf4_absmax_all(q) : at::Tensor();
  const at::Tensor y = nf4_sliced_product(nf4_column_slices(q, nf4_value_bytes(q, dt)), g2, in,
                                          [&](std::int64_t c0, std::int64_t c1) {
                                            return nf4_decode_columns(q, c0, c1, absmax, dt);
                                          });
  std::vector<std::int64_t> sizes = g.sizes().vec();
  sizes.back() = in;
  return y.view(sizes);
}

}  // namespace detail

/// The weight back, in `dtype`, decoded a slice at a time into the result
/// (besides it, temporaries of about 6 bytes per weight of one slice).
inline at::Tensor nf4_dequantize(const Nf4Weight& q, at::ScalarType dtype = at::kFloat) {
  at::NoGradGuard no_grad;
  if (detail::nf4_kernel_applies(q, dtype))  // one launch into the result: no temporaries
    return detail::nf4_kernel_decode(q, q.numel(), 0, 1, 0, q.numel(), dtype).view(q.shape);
  // slices of whole blocks and bytes
  const std::int64_t unit = q.block % 2 == 0 ? q.block : 2 * q.block, n = q.numel();
  const std::int64_t step = std::max<std::int64_t>(1, (n / detail::nf4_slices(q) + unit - 1) / unit) * unit;
  at::Tensor w = at::empty({n}, q.absmax_scale.options().dtype(dtype));
  for (std::int64_t p0 = 0; p0 < n; p0 += step)
    w.slice(0, p0, std::min(n, p0 + step)).copy_(detail::nf4_decode_range(q, p0, std::min(n, p0 + step), dtype));
  return w.view(q.shape);
}

namespace detail {

/// y = x W^T with W decoded from NF4 a slice at a time in the forward and
/// again in the backward: only the 4-bit weight stays alive between them, and
/// a product's temporaries stay under 2 bytes per weight (bench/nf4.cpp).
struct Nf4LinearFunction : torch::autograd::Function<Nf4LinearFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                at::TensorList q, std::vector<std::int64_t> shape, std::int64_t block,
                                                std::int64_t scale_block) {
    Nf4Weight w{q[0], q[1], q[2], q[3], shape, block, scale_block};
    ctx->save_for_backward({q[0], q[1], q[2], q[3]});
    ctx->saved_data["shape"] = c10::IValue(shape);
    ctx->saved_data["block"] = block;
    ctx->saved_data["scale_block"] = scale_block;
    return {nf4_matmul_t(x, w)};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    Nf4Weight w{saved[0], saved[1], saved[2], saved[3], ctx->saved_data["shape"].toIntVector(),
                ctx->saved_data["block"].toInt(), ctx->saved_data["scale_block"].toInt()};
    at::Tensor gx = nf4_matmul(grads[0], w);
    return {gx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace detail

/// x W^T for an NF4 weight, computed in x's dtype, differentiable in x. The
/// weight is decoded an eighth at a time (forward: rows, backward: columns);
/// the result is the product with the whole decoded weight.
inline at::Tensor nf4_linear(const at::Tensor& x, const Nf4Weight& w) {
  return detail::Nf4LinearFunction::apply(x, at::TensorList({w.packed, w.absmax_q, w.absmax_scale, w.absmax_offset}),
                                          w.shape, w.block, w.scale_block)[0];
}

}  // namespace wick
