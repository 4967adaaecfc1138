#pragma once
/// \file nf4_decode.hpp
/// The NF4 decode kernel's launcher (nf4_decode.cu), in plain types: the
/// operator that calls it with tensors is nf4_op.cpp.
#include <cstdint>

namespace wick::kernels {

/// A rectangle [row0, row0 + rows) x [col0, col0 + cols) of an NF4 weight seen
/// as `width` values a row (a flat range is one row of the flattened weight).
struct Nf4DecodeArgs {
  const std::uint8_t* packed;    ///< two level indices a byte, the first in the high nibble
  const std::uint8_t* absmax_q;  ///< one 8-bit index into `map` per block
  const float* scale;            ///< one per `scale_block` blocks
  const float* offset;           ///< one value
  const float* map;              ///< bitsandbytes' 256-value dynamic map
  const float* levels;           ///< the 16 NF4 levels
  std::int64_t width, row0, rows, col0, cols, block, scale_block;
};

enum class Nf4OutType { Float, BFloat16, Half };

#ifdef __CUDACC__
#define WICK_HOST_DEVICE __host__ __device__
#else
#define WICK_HOST_DEVICE
#endif

/// The eight-at-a-time decode (one thread: four packed bytes, one absmax
/// constant, one 16- or 32-byte store) applies when every run of eight
/// output values starts at a multiple of 8 in the flattened weight (so its
/// bytes are a 4-byte word and, with block a multiple of 8, one block's),
/// block and scale_block are powers of two (shifts for the divisions), and
/// the packed bytes and the output are aligned for the wide loads and
/// stores (16 bytes). `out_bytes`: the output's element size (2 or 4).
/// Else one value a thread.
WICK_HOST_DEVICE inline int nf4_log2_exact(std::int64_t v) {
  if (v <= 0 || (v & (v - 1)) != 0) return -1;
  int s = 0;
  while ((std::int64_t{1} << s) < v) ++s;
  return s;
}
inline bool nf4_decode8_applies(const Nf4DecodeArgs& a, const void* out, int out_bytes) {
  const auto addr = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  return a.block % 8 == 0 && nf4_log2_exact(a.block) >= 0 && nf4_log2_exact(a.scale_block) >= 0 && a.cols % 8 == 0 &&
         (a.rows <= 1 || a.width % 8 == 0) && (a.row0 * a.width + a.col0) % 8 == 0 && addr(a.packed) % 4 == 0 &&
         out_bytes >= 2 && addr(out) % 16 == 0;
}
/// Group g (eight values) of the rectangle: its first value's position in
/// the flattened weight (p) and in the output (o).
WICK_HOST_DEVICE inline void nf4_group_place(std::uint64_t g, const Nf4DecodeArgs& a, std::int64_t& p,
                                             std::int64_t& o) {
  const std::uint64_t per_row = static_cast<std::uint64_t>(a.cols) / 8;
  const std::uint64_t r = a.rows <= 1 ? 0 : g / per_row, c = (g - r * per_row) * 8;
  p = (a.row0 + static_cast<std::int64_t>(r)) * a.width + a.col0 + static_cast<std::int64_t>(c);
  o = static_cast<std::int64_t>(r) * a.cols + static_cast<std::int64_t>(c);
}

/// Decodes into `out` (rows x cols, contiguous) on `stream` (a cudaStream_t);
/// returns the cudaError_t of the launch (0: launched).
int nf4_decode_launch(const Nf4DecodeArgs& args, Nf4OutType type, void* out, void* stream);

/// cudaGetErrorString, for the operator's message.
const char* cuda_error_string(int code);

}  // namespace wick::kernels
