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

/// Decodes into `out` (rows x cols, contiguous) on `stream` (a cudaStream_t);
/// returns the cudaError_t of the launch (0: launched).
int nf4_decode_launch(const Nf4DecodeArgs& args, Nf4OutType type, void* out, void* stream);

/// cudaGetErrorString, for the operator's message.
const char* cuda_error_string(int code);

}  // namespace wick::kernels
