// QLoRA's temporaries: the bytes a product with an NF4 weight holds besides
// its inputs and its result, per weight of the layer, and its time. Baseline:
// the whole-weight decode the kit used before (an int64 level index per
// weight, then the float weight), against the decode a slice at a time
// (wick/kit/nf4.hpp), on LLaMA-2-7B's layer shapes (the seed 003 QLoRA model).
// Bytes come from the counting CPU allocator (what CUDA's allocated bytes
// would show); both decodes give the same bits. Then quantizing on the host:
// the codes by ATen (bucketize) against the kit's pass, the same bytes.
//   build/bin/wick-bench-nf4 [tokens=64] [bf16|fp32] [reps=3] [cpu|cuda]
// cuda: on the GPU, the engine's one-kernel decode (host/kernels/) against the
// ATen decode it replaced, for the products and the whole dequantization:
// time (median, synchronised) and whether the kernel gives the bits of the
// ATen decode over the same slices (alone, the ATen route cuts float slices,
// whose GEMMs have other shapes and may round apart).
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "util/memory.hpp"
#include "wick/kit/nf4.hpp"

namespace {

// The kit's decode before slicing: the whole weight at once.
at::Tensor whole_decode(const wick::Nf4Weight& q, at::ScalarType dtype) {
  const std::int64_t nb = q.absmax_q.numel();
  at::Tensor absmax = wick::nf4_table(1, q.packed.device()).index_select(0, q.absmax_q.to(at::kLong)) *
                          q.absmax_scale.repeat_interleave(q.scale_block).slice(0, 0, nb) +
                      q.absmax_offset;
  at::Tensor hi = q.packed.bitwise_right_shift(4), lo = q.packed.bitwise_and(15);
  at::Tensor idx = at::stack({hi, lo}, 1).reshape({-1}).to(at::kLong);
  at::Tensor w = wick::nf4_table(0, q.packed.device()).index_select(0, idx).reshape({-1, q.block}) * absmax.unsqueeze(1);
  return w.reshape(q.shape).to(dtype);
}

struct Measure {
  double bytes_per_weight = 0, seconds = 0;
  at::Tensor result;
};

template <class F>
Measure measure(F&& f, std::int64_t weights, int reps) {
  Measure m;
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    m.result = at::Tensor();
    const std::int64_t base = wick::cpu_tensor_memory().allocated;
    wick::reset_cpu_tensor_peak();
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor y = f();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    const std::int64_t temp = wick::cpu_tensor_memory().peak - base - static_cast<std::int64_t>(y.nbytes());
    m.bytes_per_weight = static_cast<double>(temp) / static_cast<double>(weights);
    m.result = y;
  }
  std::sort(times.begin(), times.end());
  m.seconds = times[times.size() / 2];
  return m;
}

// The product `work` (0: x W^T, 1: g W, 2: the whole dequantization) with the ATen decode, over the slices the
// kernel route takes (their rows or columns sized for the product's dtype, not for float): the same GEMMs over
// what should be the same decoded values, so the kernel's result must have the same bits.
at::Tensor aten_over_kernel_slices(const wick::Nf4Weight& q, int work, const at::Tensor& x, const at::Tensor& g,
                                   at::ScalarType dtype) {
  namespace d = wick::detail;
  const bool was = d::nf4_use_kernel();
  d::nf4_use_kernel() = true;
  const std::int64_t vb = d::nf4_value_bytes(q, dtype);  // the kernel route's
  d::nf4_use_kernel() = false;
  const std::int64_t out = q.shape[0], in = q.shape[1];
  at::Tensor y;
  if (work == 0) {
    y = d::nf4_sliced_product(d::nf4_row_slices(q, vb), x, out, [&](std::int64_t r0, std::int64_t r1) {
      return d::nf4_decode_range(q, r0 * in, r1 * in, dtype).view({r1 - r0, in}).t();
    });
  } else if (work == 1) {
    const at::Tensor absmax = d::nf4_column_views(q) ? d::nf4_absmax_all(q) : at::Tensor();
    y = d::nf4_sliced_product(d::nf4_column_slices(q, vb), g, in, [&](std::int64_t c0, std::int64_t c1) {
      return d::nf4_decode_columns(q, c0, c1, absmax, dtype);
    });
  } else {
    y = wick::nf4_dequantize(q, dtype);
  }
  d::nf4_use_kernel() = was;
  return y;
}

// The GPU: kernel against ATen decode, per layer and product.
int cuda_main(std::int64_t tokens, at::ScalarType dtype, int reps) {
  if (!torch::cuda::is_available() || !wick::detail::nf4_kernel_op()) {
    std::fprintf(stderr, "wick-bench-nf4: cuda needs a CUDA device and an engine built with CUDA\n");
    return 2;
  }
  struct Layer {
    const char* name;
    std::int64_t out, in;
  };
  const Layer layers[] = {{"q_proj 4096x4096", 4096, 4096}, {"up_proj 11008x4096", 11008, 4096},
                          {"down_proj 4096x11008", 4096, 11008}, {"tiny 512x512", 512, 512}};
  std::printf("NF4 on the GPU, %lld tokens, %s, median of %d: the kernel (one launch a slice) against the ATen decode\n",
              static_cast<long long>(tokens), at::toString(dtype), reps);
  std::printf("%-22s %-11s %10s %10s %8s %s\n", "layer", "work", "ATen ms", "kernel ms", "speedup", "same bits");
  at::manual_seed(0);
  int failures = 0;
  const auto opts = at::TensorOptions().device(at::kCUDA);
  auto time = [&](auto&& f) {
    std::vector<double> t;
    at::Tensor y;
    for (int r = 0; r < reps + 1; ++r) {  // the first run warms up
      torch::cuda::synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      y = f();
      torch::cuda::synchronize();
      if (r > 0) t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    return std::make_pair(t[t.size() / 2], y);
  };
  for (const auto& l : layers) {
    const wick::Nf4Weight q = wick::nf4_quantize(at::randn({l.out, l.in}, opts) * 0.02);
    const at::Tensor x = at::randn({tokens, l.in}, opts).to(dtype), g = at::randn({tokens, l.out}, opts).to(dtype);
    for (int work = 0; work < 3; ++work) {
      auto run = [&] {
        return work == 0 ? wick::detail::nf4_matmul_t(x, q)
                         : work == 1 ? wick::detail::nf4_matmul(g, q) : wick::nf4_dequantize(q, dtype);
      };
      wick::detail::nf4_use_kernel() = false;
      const double aten_s = time(run).first;
      // the ATen route decodes float slices (half the rows of a bf16 one): its GEMMs have other shapes and may
      // round apart, so the bits are compared with the ATen decode over the kernel's own slices
      const at::Tensor aten_same = aten_over_kernel_slices(q, work, x, g, dtype);
      wick::detail::nf4_use_kernel() = true;
      const auto [kernel_s, kernel_y] = time(run);
      const bool same = at::equal(aten_same, kernel_y);
      failures += !same;
      std::printf("%-22s %-11s %10.3f %10.3f %7.2fx %s\n", l.name, work == 0 ? "x W^T" : work == 1 ? "g W" : "dequantize",
                  aten_s * 1e3, kernel_s * 1e3, aten_s / kernel_s, same ? "yes" : "NO");
    }
  }
  std::printf("speedup: ATen's time over the kernel's; same bits: against the ATen decode over the kernel's slices\n");
  // The slices' products (each written into its columns of the result) against one product over the whole decoded
  // weight, and under bf16 autocast with a float32 input (the slices' GEMMs cast as autocast casts at::mm's): the
  // same dtype, and the difference of GEMMs that sum in another order
  std::printf("the sliced products against one GEMM over the whole decoded weight (%s)\n", at::toString(dtype));
  std::printf("%-22s %-16s %7s %12s %s\n", "layer", "work", "slices", "max |diff|", "within");
  for (const auto& l : layers) {
    const wick::Nf4Weight q = wick::nf4_quantize(at::randn({l.out, l.in}, opts) * 0.02);
    const at::Tensor x = at::randn({tokens, l.in}, opts).to(dtype), g = at::randn({tokens, l.out}, opts).to(dtype);
    const at::Tensor w = wick::nf4_dequantize(q, dtype);
    for (int work = 0; work < 3; ++work) {
      at::Tensor got, want;
      std::size_t slices;
      if (work == 2) {  // float32 x under bf16 autocast
        const at::Tensor xf = x.to(at::kFloat);
        at::autocast::set_autocast_enabled(at::kCUDA, true);
        at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
        got = wick::detail::nf4_matmul_t(xf, q);
        want = at::mm(xf, wick::nf4_dequantize(q, at::kFloat).t());
        at::autocast::set_autocast_enabled(at::kCUDA, false);
        at::autocast::clear_cache();
        slices = wick::detail::nf4_row_slices(q, wick::detail::nf4_value_bytes(q, at::kBFloat16)).size();
      } else {
        got = work == 0 ? wick::detail::nf4_matmul_t(x, q) : wick::detail::nf4_matmul(g, q);
        want = work == 0 ? at::mm(x, w.t()) : at::mm(g, w);
        const std::int64_t vb = wick::detail::nf4_value_bytes(q, dtype);
        slices = work == 0 ? wick::detail::nf4_row_slices(q, vb).size() : wick::detail::nf4_column_slices(q, vb).size();
      }
      const double d = (got.to(at::kFloat) - want.to(at::kFloat)).abs().max().item<double>();
      const double scale = want.to(at::kFloat).abs().max().item<double>();
      const double tol = (want.scalar_type() == at::kFloat ? 1e-4 : 1e-2) * scale;
      const bool ok = got.scalar_type() == want.scalar_type() && got.sizes() == want.sizes() && d <= tol;
      failures += !ok;
      std::printf("%-22s %-16s %7zu %12.3g %s\n", l.name,
                  work == 0 ? "x W^T" : work == 1 ? "g W" : "x W^T autocast", slices, d,
                  ok ? "yes" : ("NO (" + std::string(at::toString(got.scalar_type())) + ")").c_str());
    }
  }
  std::printf("within: the same dtype and max |diff| <= 1e-4 (float32) or 1e-2 (16-bit) of the largest value\n");
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  wick::install_memory_tracking();
  at::NoGradGuard no_grad;
  const std::int64_t tokens = argc > 1 ? std::atoll(argv[1]) : 64;
  const std::string dt = argc > 2 ? argv[2] : "bf16";
  const int reps = argc > 3 ? std::atoi(argv[3]) : 3;
  const std::string device = argc > 4 ? argv[4] : "cpu";
  if (tokens < 1 || reps < 1 || (dt != "bf16" && dt != "fp32") || (device != "cpu" && device != "cuda")) {
    std::fprintf(stderr, "usage: wick-bench-nf4 [tokens >= 1] [bf16|fp32] [reps >= 1] [cpu|cuda]\n");
    return 2;
  }
  const at::ScalarType dtype = dt == "bf16" ? at::kBFloat16 : at::kFloat;
  if (device == "cuda") return cuda_main(tokens, dtype, reps);
  struct Layer {
    const char* name;
    std::int64_t out, in;
  };
  const Layer layers[] = {{"q_proj 4096x4096", 4096, 4096}, {"up_proj 11008x4096", 11008, 4096},
                          {"down_proj 4096x11008", 4096, 11008}};
  std::printf("NF4 products, %lld tokens, compute %s, median of %d; temporaries = peak tensor bytes besides inputs and "
              "result, per weight\n",
              static_cast<long long>(tokens), dt.c_str(), reps);
  std::printf("%-22s %-9s %12s %12s %7s %10s %10s %7s %s\n", "layer", "product", "whole B/w", "sliced B/w", "ratio",
              "whole ms", "sliced ms", "ratio", "same bits");
  at::manual_seed(0);
  int failures = 0;
  for (const auto& l : layers) {
    const std::int64_t n = l.out * l.in;
    const wick::Nf4Weight q = wick::nf4_quantize(at::randn({l.out, l.in}) * 0.02);
    const at::Tensor x = at::randn({tokens, l.in}).to(dtype), g = at::randn({tokens, l.out}).to(dtype);
    for (const bool forward : {true, false}) {
      const Measure whole = measure(
          [&] { return forward ? at::matmul(x, whole_decode(q, dtype).t()) : at::matmul(g, whole_decode(q, dtype)); }, n,
          reps);
      const Measure sliced = measure(
          [&] { return forward ? wick::detail::nf4_matmul_t(x, q) : wick::detail::nf4_matmul(g, q); }, n, reps);
      const bool same = at::equal(whole.result, sliced.result);
      // fp32: MKL may round a slice's product apart from the whole one's (tests/sdk/nf4_test.cpp)
      failures += (!same && dtype != at::kFloat) || sliced.bytes_per_weight > 2.0;
      std::printf("%-22s %-9s %12.3f %12.3f %6.1fx %10.1f %10.1f %6.2fx %s\n", l.name, forward ? "x W^T" : "g W",
                  whole.bytes_per_weight, sliced.bytes_per_weight, whole.bytes_per_weight / sliced.bytes_per_weight,
                  whole.seconds * 1e3, sliced.seconds * 1e3, sliced.seconds / whole.seconds, same ? "yes" : "NO");
    }
  }
  std::printf("ratio: whole / sliced for bytes, sliced / whole for time (2 bytes per weight is the goal)\n");
  // Quantizing on the host (a model built or loaded with quantize = "nf4"):
  // the codes by ATen (each value over its constant, bucketize over the
  // midpoints, two codes to a byte) against the kit's pass, from bf16 weights
  std::printf("\nquantizing a bf16 weight on the host, median of %d, %d thread(s): the codes by ATen against the kit's "
              "pass\n", reps, at::get_num_threads());
  std::printf("%-22s %10s %10s %7s %s\n", "layer", "ATen ms", "kit ms", "speedup", "same bytes");
  for (const auto& l : layers) {
    const at::Tensor w = (at::randn({l.out, l.in}) * 0.02).to(at::kBFloat16);
    const Measure aten = measure(
        [&] {
          const at::Tensor blocks = w.to(at::kFloat).reshape({-1, 64});
          const at::Tensor normed = blocks / blocks.abs().amax(1).clamp_min(1e-12).unsqueeze(1);
          const at::Tensor idx =
              wick::nearest(normed.reshape({-1}), wick::nf4_table(0, w.device())).to(at::kByte).reshape({-1, 2});
          return idx.select(1, 0).bitwise_left_shift(4).bitwise_or(idx.select(1, 1));
        },
        w.numel(), reps);
    const Measure kit = measure([&] { return wick::nf4_quantize_chunked(w).packed; }, w.numel(), reps);
    const bool same = at::equal(aten.result, kit.result);
    failures += !same;
    std::printf("%-22s %10.1f %10.1f %6.2fx %s\n", l.name, aten.seconds * 1e3, kit.seconds * 1e3,
                aten.seconds / kit.seconds, same ? "yes" : "NO");
  }
  std::printf("kit: nf4_quantize_chunked (the constants too); speedup: ATen's time over the kit's\n");
  return failures ? 1 : 0;
}
