#pragma once
/// \file adamw8bit_step.hpp
/// The launcher of optim `adamw8bit`'s fused CUDA step (adamw8bit_step.cu),
/// in plain types; the operator around it is adamw8bit_op.cpp.
#include <cstdint>

#include "kernels/adamw8bit_math.hpp"
#include "kernels/nf4_decode.hpp"  // Nf4OutType: the weight's and gradient's type

namespace wick::kernels {

struct Adam8Args {
  void* w;                  ///< the weight, flat, in `type`
  const void* g;            ///< its gradient, flat, in `type`
  std::uint8_t* m_codes;    ///< one code a value
  float* m_absmax;          ///< one a block
  std::uint8_t* v_codes;
  float* v_absmax;
  const float* m_map;       ///< the signed dynamic map (256 sorted values)
  const float* v_map;       ///< the unsigned one
  std::int64_t n, block;
  Adam8Hyper h;
};

/// One step over every block of the tensor, in one launch on `stream`;
/// returns the cudaError_t of the launch.
int adam8_step_launch(const Adam8Args& args, Nf4OutType type, void* stream);

}  // namespace wick::kernels
