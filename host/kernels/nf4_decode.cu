// NF4 decoding on a CUDA device in one kernel (the launcher below; eight
// values a thread where the rectangle's runs of eight are aligned, which the
// products' slices are, else one value a thread): each
// value of a rectangle of the [height, width] weight is its level times its
// block's absmax constant, the constant decoded from its 8-bit index into the
// dynamic map, times its group's scale, plus the offset, and the result is
// rounded once to the output type. The float operations are the ones, in the
// order and rounding, of the ATen decode in sdk/wick/kit/nf4.hpp (no fused
// multiply-add), so both give the same bits. No LibTorch header here: the
// operator around it is host/kernels/nf4_op.cpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "kernels/convert.cuh"
#include "kernels/nf4_decode.hpp"

namespace wick::kernels {
namespace {

template <class T>
__global__ void nf4_decode_kernel(Nf4DecodeArgs a, T* __restrict__ out) {
  __shared__ float map[256], levels[16];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) map[i] = a.map[i];
  if (threadIdx.x < 16) levels[threadIdx.x] = a.levels[threadIdx.x];
  __syncthreads();
  const float offset = *a.offset;
  const std::int64_t n = a.rows * a.cols;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / a.cols, c = i - r * a.cols;
    const std::int64_t p = (a.row0 + r) * a.width + a.col0 + c;  // in the flattened weight
    const std::uint8_t byte = a.packed[p >> 1];
    const int level = (p & 1) ? (byte & 15) : (byte >> 4);  // the first of a pair in the high nibble
    const std::int64_t k = p / a.block;
    const float absmax = __fadd_rn(__fmul_rn(map[a.absmax_q[k]], a.scale[k / a.scale_block]), offset);
    out[i] = from_float<T>(__fmul_rn(levels[level], absmax));
  }
}

// Eight values a thread (nf4_decode8_applies): four packed bytes read as one
// word, one absmax constant for the eight (one block holds them), the same
// float operations per value as above, one wide store.
template <class T>
__global__ void nf4_decode8_kernel(Nf4DecodeArgs a, int block_shift, int scale_shift, T* __restrict__ out) {
  __shared__ float map[256], levels[16];
  for (int i = threadIdx.x; i < 256; i += blockDim.x) map[i] = a.map[i];
  if (threadIdx.x < 16) levels[threadIdx.x] = a.levels[threadIdx.x];
  __syncthreads();
  const float offset = *a.offset;
  const std::uint64_t groups = static_cast<std::uint64_t>(a.rows) * static_cast<std::uint64_t>(a.cols / 8);
  for (std::uint64_t g = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; g < groups;
       g += static_cast<std::uint64_t>(gridDim.x) * blockDim.x) {
    std::int64_t p, o;
    nf4_group_place(g, a, p, o);
    const std::uint32_t word = *reinterpret_cast<const std::uint32_t*>(a.packed + (p >> 1));
    const std::int64_t k = p >> block_shift;
    const float absmax = __fadd_rn(__fmul_rn(map[a.absmax_q[k]], a.scale[k >> scale_shift]), offset);
    T v[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned byte = (word >> (8 * j)) & 0xffu;  // the bytes in memory order, the high nibble first
      v[2 * j] = from_float<T>(__fmul_rn(levels[byte >> 4], absmax));
      v[2 * j + 1] = from_float<T>(__fmul_rn(levels[byte & 15u], absmax));
    }
    constexpr int kWide = static_cast<int>(sizeof(T) * 8 / sizeof(uint4));  // 16-byte stores: 1 (16-bit), 2 (float)
    uint4 w[kWide];
    memcpy(w, v, sizeof v);
    uint4* dst = reinterpret_cast<uint4*>(out + o);
#pragma unroll
    for (int j = 0; j < kWide; ++j) dst[j] = w[j];
  }
}

template <class T>
int launch(const Nf4DecodeArgs& a, void* out, cudaStream_t stream) {
  const std::int64_t n = a.rows * a.cols;
  if (n == 0) return 0;
  constexpr int threads = 256;
  if (nf4_decode8_applies(a, out, static_cast<int>(sizeof(T)))) {
    const std::int64_t want = (n / 8 + threads - 1) / threads;
    const int blocks = static_cast<int>(want < 4096 ? want : 4096);  // grid-stride beyond
    nf4_decode8_kernel<T><<<blocks, threads, 0, stream>>>(a, nf4_log2_exact(a.block), nf4_log2_exact(a.scale_block),
                                                          static_cast<T*>(out));
    return static_cast<int>(cudaGetLastError());
  }
  const std::int64_t want = (n + threads - 1) / threads;
  const int blocks = static_cast<int>(want < 65535 * 8 ? want : 65535 * 8);  // grid-stride beyond
  nf4_decode_kernel<T><<<blocks, threads, 0, stream>>>(a, static_cast<T*>(out));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int nf4_decode_launch(const Nf4DecodeArgs& args, Nf4OutType type, void* out, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (type) {
    case Nf4OutType::Float: return launch<float>(args, out, s);
    case Nf4OutType::BFloat16: return launch<__nv_bfloat16>(args, out, s);
    case Nf4OutType::Half: return launch<__half>(args, out, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

const char* cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace wick::kernels
