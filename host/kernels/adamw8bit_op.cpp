// The operator wick::adamw8bit_step_, registered for CUDA tensors when the
// engine is built with CUDA: optim `adamw8bit` finds it by name and steps a
// whole parameter in one kernel (adamw8bit_step.cu); without it, or on the
// CPU, the optimizer steps with ATen, a chunk of 2^20 values at a time.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <string>

#include "kernels/adamw8bit_step.hpp"

namespace {

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("wick::adamw8bit_step_: " + what);
}

void adamw8bit_step_cuda(const at::Tensor& w, const at::Tensor& g, const at::Tensor& m_codes,
                         const at::Tensor& m_absmax, const at::Tensor& v_codes, const at::Tensor& v_absmax,
                         const at::Tensor& m_map, const at::Tensor& v_map, std::int64_t block, double beta1,
                         double beta2, double eps, double lr, double weight_decay, double c1, double c2) {
  const at::Device device = w.device();
  for (const at::Tensor* t : {&w, &g, &m_codes, &m_absmax, &v_codes, &v_absmax, &m_map, &v_map}) {
    need(t->device() == device, "every tensor must be on " + device.str() + ", one is on " + t->device().str());
    need(t->is_contiguous(), "every tensor must be contiguous");
  }
  const std::int64_t n = w.numel();
  need(block > 0, "block " + std::to_string(block) + ", expected at least 1");
  const std::int64_t blocks = (n + block - 1) / block;
  need(g.numel() == n && m_codes.numel() == n && v_codes.numel() == n,
       "the gradient and the codes must hold the weight's " + std::to_string(n) + " values");
  need(m_absmax.numel() == blocks && v_absmax.numel() == blocks,
       "expected " + std::to_string(blocks) + " absmax values a moment");
  need(g.scalar_type() == w.scalar_type(), "the gradient must have the weight's dtype");
  need(m_codes.scalar_type() == at::kByte && v_codes.scalar_type() == at::kByte, "the codes must be uint8");
  need(m_absmax.scalar_type() == at::kFloat && v_absmax.scalar_type() == at::kFloat && m_map.scalar_type() == at::kFloat &&
           v_map.scalar_type() == at::kFloat && m_map.numel() == 256 && v_map.numel() == 256,
       "the absmax values and the two 256-value maps must be float32");
  wick::kernels::Nf4OutType type;
  switch (w.scalar_type()) {
    case at::kFloat: type = wick::kernels::Nf4OutType::Float; break;
    case at::kBFloat16: type = wick::kernels::Nf4OutType::BFloat16; break;
    case at::kHalf: type = wick::kernels::Nf4OutType::Half; break;
    default: throw std::invalid_argument(std::string("wick::adamw8bit_step_: dtype ") + c10::toString(w.scalar_type()) +
                                         ", expected float32, bfloat16 or float16");
  }
  const wick::kernels::Adam8Hyper h{static_cast<float>(beta1),
                                    static_cast<float>(1 - beta1),
                                    static_cast<float>(beta2),
                                    static_cast<float>(1 - beta2),
                                    static_cast<float>(eps),
                                    static_cast<float>(c2),
                                    weight_decay > 0 ? static_cast<float>(1 - lr * weight_decay) : 1.0f,
                                    static_cast<float>(-lr / c1)};
  const wick::kernels::Adam8Args args{w.data_ptr(),
                                      g.data_ptr(),
                                      m_codes.data_ptr<std::uint8_t>(),
                                      m_absmax.data_ptr<float>(),
                                      v_codes.data_ptr<std::uint8_t>(),
                                      v_absmax.data_ptr<float>(),
                                      m_map.data_ptr<float>(),
                                      v_map.data_ptr<float>(),
                                      n,
                                      block,
                                      h};
  const c10::cuda::CUDAGuard guard(device);
  const int err = wick::kernels::adam8_step_launch(args, type, c10::cuda::getCurrentCUDAStream(device.index()).stream());
  if (err != 0)
    throw std::runtime_error(std::string("wick::adamw8bit_step_: the kernel did not launch on ") + device.str() + ": " +
                             wick::kernels::cuda_error_string(err));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(wick, m) {
  m.def(
      "adamw8bit_step_(Tensor(a!) w, Tensor g, Tensor(b!) m_codes, Tensor(c!) m_absmax, Tensor(d!) v_codes, "
      "Tensor(e!) v_absmax, Tensor m_map, Tensor v_map, int block, float beta1, float beta2, float eps, float lr, "
      "float weight_decay, float c1, float c2) -> ()");
}

TORCH_LIBRARY_IMPL(wick, CUDA, m) { m.impl("adamw8bit_step_", &adamw8bit_step_cuda); }
