// optim `adamw8bit`'s step in one kernel: a thread block per block of the
// 8-bit moments. Pass one decodes each element's moments, applies AdamW's
// rule to them (adamw8bit_math.hpp) and reduces the largest magnitude of each
// new moment over the block; pass two computes the same new moments again,
// writes the weight and the codes of the moments over the new absmax values.
// Where the ATen step makes some forty launches and float copies of every
// 2^20 values, this reads and writes each value's bytes once or twice.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/adamw8bit_step.hpp"
#include "kernels/convert.cuh"

namespace wick::kernels {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float block_max(float x, float* scratch) {
  scratch[threadIdx.x] = x;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) scratch[threadIdx.x] = fmaxf(scratch[threadIdx.x], scratch[threadIdx.x + s]);
    __syncthreads();
  }
  const float r = scratch[0];
  __syncthreads();
  return r;
}

template <class T>
__global__ void adam8_kernel(Adam8Args a) {
  __shared__ float m_map[256], v_map[256], m_mid[255], v_mid[255], scratch[kThreads];
  for (int i = threadIdx.x; i < 256; i += kThreads) {
    m_map[i] = a.m_map[i];
    v_map[i] = a.v_map[i];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 255; i += kThreads) {  // as wick::nearest: (a + b) / 2 in float
    m_mid[i] = (m_map[i + 1] + m_map[i]) / 2.0f;
    v_mid[i] = (v_map[i + 1] + v_map[i]) / 2.0f;
  }
  __syncthreads();
  T* w = static_cast<T*>(a.w);
  const T* g = static_cast<const T*>(a.g);
  const std::int64_t nb = (a.n + a.block - 1) / a.block;
  for (std::int64_t b = blockIdx.x; b < nb; b += gridDim.x) {
    const std::int64_t begin = b * a.block, end = begin + a.block < a.n ? begin + a.block : a.n;
    const float ma = a.m_absmax[b], va = a.v_absmax[b];
    // pass one: the new moments' largest magnitudes
    float m_top = 0, v_top = 0;
    for (std::int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      float m, v;
      adam8_moments(m_map[a.m_codes[i]] * ma, v_map[a.v_codes[i]] * va, to_float(g[i]), a.h, m, v);
      m_top = fmaxf(m_top, fabsf(m));
      v_top = fmaxf(v_top, fabsf(v));
    }
    m_top = block_max(m_top, scratch);
    v_top = block_max(v_top, scratch);
    // pass two: the same moments again, the weight, the codes
    const float m_div = m_top > 0 ? m_top : 1.0f, v_div = v_top > 0 ? v_top : 1.0f;
    for (std::int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      float m, v;
      adam8_moments(m_map[a.m_codes[i]] * ma, v_map[a.v_codes[i]] * va, to_float(g[i]), a.h, m, v);
      w[i] = from_float<T>(adam8_weight(to_float(w[i]), m, v, a.h));
      a.m_codes[i] = adam8_code(m / m_div, m_mid);
      a.v_codes[i] = adam8_code(v / v_div, v_mid);
    }
    __syncthreads();  // every thread has read this block's absmax values
    if (threadIdx.x == 0) {
      a.m_absmax[b] = m_top;
      a.v_absmax[b] = v_top;
    }
  }
}

template <class T>
int launch(const Adam8Args& a, cudaStream_t stream) {
  if (a.n == 0) return 0;
  const std::int64_t nb = (a.n + a.block - 1) / a.block;
  const int blocks = static_cast<int>(nb < (1 << 30) ? nb : (1 << 30));  // grid-stride beyond
  adam8_kernel<T><<<blocks, kThreads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int adam8_step_launch(const Adam8Args& args, Nf4OutType type, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case Nf4OutType::Float: return launch<float>(args, s);
    case Nf4OutType::BFloat16: return launch<__nv_bfloat16>(args, s);
    case Nf4OutType::Half: return launch<__half>(args, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace wick::kernels
