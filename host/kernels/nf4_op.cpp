// The operator wick::nf4_decode, registered with LibTorch's dispatcher for
// CUDA tensors when the engine is built with CUDA: sdk/wick/kit/nf4.hpp (a
// header plugins compile) finds it by name and decodes a slice of a weight in
// one kernel (nf4_decode.cu) straight into the product's dtype, where the
// ATen decode takes about ten kernels and a float copy of the slice. Without
// the operator (a CPU-only build) or on the CPU, the header decodes with ATen.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>

#include "kernels/nf4_decode.hpp"

namespace {

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("wick::nf4_decode: " + what);
}

at::Tensor nf4_decode_cuda(const at::Tensor& packed, const at::Tensor& absmax_q, const at::Tensor& absmax_scale,
                           const at::Tensor& absmax_offset, const at::Tensor& map, const at::Tensor& levels,
                           std::int64_t width, std::int64_t row0, std::int64_t rows, std::int64_t col0,
                           std::int64_t cols, std::int64_t block, std::int64_t scale_block, at::ScalarType dtype) {
  const at::Device device = packed.device();
  for (const at::Tensor* t : {&packed, &absmax_q, &absmax_scale, &absmax_offset, &map, &levels}) {
    need(t->device() == device, "every tensor must be on " + device.str() + ", one is on " + t->device().str());
    need(t->is_contiguous(), "every tensor must be contiguous");
  }
  need(packed.scalar_type() == at::kByte && absmax_q.scalar_type() == at::kByte, "packed and absmax_q must be uint8");
  need(absmax_scale.scalar_type() == at::kFloat && absmax_offset.scalar_type() == at::kFloat &&
           map.scalar_type() == at::kFloat && levels.scalar_type() == at::kFloat,
       "absmax_scale, absmax_offset, map and levels must be float32");
  need(map.numel() == 256 && levels.numel() == 16 && absmax_offset.numel() == 1,
       "expected a 256-value map, 16 levels and one offset");
  need(width > 0 && block > 0 && scale_block > 0 && row0 >= 0 && rows >= 0 && col0 >= 0 && cols >= 0 &&
           col0 + cols <= width,
       "the rectangle [" + std::to_string(row0) + ", +" + std::to_string(rows) + ") x [" + std::to_string(col0) + ", +" +
           std::to_string(cols) + ") does not fit rows of " + std::to_string(width));
  if (rows > 0 && cols > 0) {
    const std::int64_t last = (row0 + rows - 1) * width + col0 + cols - 1;
    need(last / 2 < packed.numel(), "value " + std::to_string(last) + " is past the " +
                                        std::to_string(packed.numel() * 2) + " values the weight holds");
    need(last / block < absmax_q.numel() && last / block / scale_block < absmax_scale.numel(),
         "the weight's absmax constants are fewer than its blocks");
  }
  wick::kernels::Nf4OutType type;
  switch (dtype) {
    case at::kFloat: type = wick::kernels::Nf4OutType::Float; break;
    case at::kBFloat16: type = wick::kernels::Nf4OutType::BFloat16; break;
    case at::kHalf: type = wick::kernels::Nf4OutType::Half; break;
    default: throw std::invalid_argument(std::string("wick::nf4_decode: dtype ") + c10::toString(dtype) +
                                         ", expected float32, bfloat16 or float16");
  }
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::empty({rows, cols}, packed.options().dtype(dtype));
  const wick::kernels::Nf4DecodeArgs args{packed.data_ptr<std::uint8_t>(), absmax_q.data_ptr<std::uint8_t>(),
                                          absmax_scale.data_ptr<float>(),   absmax_offset.data_ptr<float>(),
                                          map.data_ptr<float>(),            levels.data_ptr<float>(),
                                          width, row0, rows, col0, cols, block, scale_block};
  const int err = wick::kernels::nf4_decode_launch(args, type, out.data_ptr(),
                                                   c10::cuda::getCurrentCUDAStream(device.index()).stream());
  if (err != 0)
    throw std::runtime_error(std::string("wick::nf4_decode: the kernel did not launch on ") + device.str() + ": " +
                             wick::kernels::cuda_error_string(err));
  return out;
}

}  // namespace

TORCH_LIBRARY(wick, m) {
  m.def(
      "nf4_decode(Tensor packed, Tensor absmax_q, Tensor absmax_scale, Tensor absmax_offset, Tensor map, "
      "Tensor levels, int width, int row0, int rows, int col0, int cols, int block, int scale_block, "
      "ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(wick, CUDA, m) { m.impl("nf4_decode", &nf4_decode_cuda); }
