// NF4 products (wick/kit/nf4.hpp): the weight is decoded a slice at a time.
// The reference is the whole weight decoded at once, the way the first
// version did (written out here). Every product must equal, bit for bit, the
// products of that reference's slices, and the one product with the whole
// reference: bit for bit in bf16, within GEMM rounding in fp32 (see below),
// for aligned and odd shapes and odd block sizes; the temporaries of a
// product stay under 2 bytes per weight.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <stdexcept>
#include <tuple>

#include "kernels/nf4_decode.hpp"
#include "util/memory.hpp"
#include "wick/kit/nf4.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

// The whole-weight decode: one int64 index per weight, levels x absmax.
at::Tensor reference_dequantize(const Nf4Weight& q, at::ScalarType dtype) {
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

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && at::equal(a, b);
}

struct Shape {
  std::int64_t out, in, block;
};

// aligned; rows ending inside a block; an odd block size (with in a multiple
// of it, and not); fewer rows than slices; more than one group of 256
// absmax constants; a wide layer with few rows; rows of an odd length
const Shape kShapes[] = {{64, 128, 64}, {48, 100, 64}, {30, 10, 3}, {7, 18, 9}, {5, 6, 2},
                         {300, 256, 64}, {3, 1024, 32}, {9, 14, 6}, {6, 9, 3}};

class Nf4Products : public ::testing::TestWithParam<std::tuple<Shape, at::ScalarType>> {};

TEST_P(Nf4Products, DequantizeEqualsTheWholeDecode) {
  const auto [s, dtype] = GetParam();
  at::manual_seed(1);
  const Nf4Weight q = nf4_quantize(at::randn({s.out, s.in}), s.block);
  EXPECT_TRUE(same_bits(nf4_dequantize(q, dtype), reference_dequantize(q, dtype)));
}

// x W^T and g W with the whole decoded weight w, as products of the same
// slices the kit decodes (nf4_row_slices, nf4_column_slices), each slice in a
// buffer of its own as the kit's are (MKL's fp32 GEMM rounds by alignment).
at::Tensor sliced_forward(const at::Tensor& x, const at::Tensor& w, const Nf4Weight& q) {
  std::vector<at::Tensor> parts;
  for (const auto& [r0, r1] : detail::nf4_row_slices(q)) parts.push_back(at::mm(x.reshape({-1, w.size(1)}), w.slice(0, r0, r1).clone().t()));
  std::vector<std::int64_t> sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  return at::cat(parts, 1).view(sizes);
}

at::Tensor sliced_input_gradient(const at::Tensor& g, const at::Tensor& w, const Nf4Weight& q) {
  std::vector<at::Tensor> parts;
  for (const auto& [c0, c1] : detail::nf4_column_slices(q))
    parts.push_back(at::mm(g.reshape({-1, w.size(0)}), w.slice(1, c0, c1).clone()));
  std::vector<std::int64_t> sizes = g.sizes().vec();
  sizes.back() = w.size(1);
  return at::cat(parts, 1).view(sizes);
}

TEST_P(Nf4Products, ForwardAndInputGradientEqualTheWholeDecodeBitForBit) {
  const auto [s, dtype] = GetParam();
  at::manual_seed(2);
  const Nf4Weight q = nf4_quantize(at::randn({s.out, s.in}), s.block);
  const at::Tensor w = reference_dequantize(q, dtype);
  for (const auto& lead : std::vector<std::vector<std::int64_t>>{{5}, {2, 3}, {1}}) {
    std::vector<std::int64_t> xs = lead, gs = lead;
    xs.push_back(s.in);
    gs.push_back(s.out);
    const at::Tensor x = at::randn(xs).to(dtype).requires_grad_(true);
    const at::Tensor g = at::randn(gs).to(dtype);
    const at::Tensor y = nf4_linear(x, q);
    y.backward(g);
    const std::string where = std::to_string(s.out) + "x" + std::to_string(s.in) + " block " + std::to_string(s.block);
    // the decoded slices are the whole decode's, in place
    EXPECT_TRUE(same_bits(y.detach(), sliced_forward(x.detach(), w, q))) << where;
    EXPECT_TRUE(same_bits(x.grad(), sliced_input_gradient(g, w, q))) << where;
    if (dtype == at::kFloat) {
      // MKL's fp32 GEMM groups its sums by the width of the matrix, so a slice
      // of the product may differ from the whole product in the last bits
      EXPECT_TRUE(at::allclose(y.detach(), at::matmul(x.detach(), w.t()), 1e-5, 1e-5)) << where;
      EXPECT_TRUE(at::allclose(x.grad(), at::matmul(g, w), 1e-5, 1e-5)) << where;
    } else {
      // LibTorch's CPU bf16 GEMM sums each output alike whatever the width
      EXPECT_TRUE(same_bits(y.detach(), at::matmul(x.detach(), w.t()))) << where;
      EXPECT_TRUE(same_bits(x.grad(), at::matmul(g, w))) << where;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, Nf4Products,
                         ::testing::Combine(::testing::ValuesIn(kShapes), ::testing::Values(at::kFloat, at::kBFloat16)));

// The bytes tensors hold during `f` beyond what they held before and what it returns.
template <class F>
std::int64_t temporaries_of(F&& f) {
  const std::int64_t base = cpu_tensor_memory().allocated;
  reset_cpu_tensor_peak();
  at::Tensor result = f();
  return cpu_tensor_memory().peak - base - static_cast<std::int64_t>(result.nbytes());
}

TEST(Nf4Memory, ASliceHoldsAtMostSixteenMiBOfDecodedWeight) {
  // LLaMA-2-7B's products in 4 and 11 slices; a small model's in one (each
  // slice is a dozen kernel launches on a GPU)
  auto slices = [](std::int64_t out, std::int64_t in) {
    Nf4Weight q;
    q.shape = {out, in};
    return detail::nf4_slices(q);
  };
  EXPECT_EQ(slices(4096, 4096), 4);
  EXPECT_EQ(slices(11008, 4096), 11);
  EXPECT_EQ(slices(4096, 11008), 11);
  EXPECT_EQ(slices(1408, 512), 1);
  EXPECT_EQ(slices(2, 64), 1);
  // a small weight, decoded whole: its temporaries are bounded by the slice
  // limit (about 6 bytes a weight of it), not by 2 bytes a weight of the layer
  at::manual_seed(4);
  const Nf4Weight q = nf4_quantize(at::randn({768, 512}));
  const at::Tensor x = at::randn({16, 512});
  const std::int64_t fwd = temporaries_of([&] { return detail::nf4_matmul_t(x, q); });
  EXPECT_GT(fwd, 2 * 768 * 512);
  EXPECT_LE(fwd, 8 * 768 * 512);
}

// A forward product's row slices are the product's columns: multiples of 64
// (tensor-core GEMMs want 8), each under the limit, covering every row once.
TEST(Nf4Memory, RowSlicesAreWholeMultiplesOf64RowsUnderTheLimit) {
  auto rows = [](std::int64_t out, std::int64_t in) {
    Nf4Weight q;
    q.shape = {out, in};
    return detail::nf4_row_slices(q);
  };
  for (const auto& [out, in] : std::vector<std::pair<std::int64_t, std::int64_t>>{
           {4096, 4096}, {11008, 4096}, {4096, 11008}, {14336, 4096}, {1408, 512}, {3, 5}}) {
    const auto s = rows(out, in);
    std::int64_t next = 0;
    for (const auto& [r0, r1] : s) {
      EXPECT_EQ(r0, next) << out << " x " << in;
      EXPECT_EQ(r0 % 64, 0) << out << " x " << in;
      EXPECT_LE((r1 - r0) * in * 4, detail::kNf4SliceBytes) << out << " x " << in;
      if (s.size() > 1 && r1 < out) EXPECT_EQ((r1 - r0) % 64, 0) << out << " x " << in;
      next = r1;
    }
    EXPECT_EQ(next, out) << out << " x " << in;
  }
  EXPECT_EQ(rows(11008, 4096).size(), 11u);  // 10 x 1,024 rows and 768
  EXPECT_EQ(rows(4096, 11008).size(), 13u);  // 12 x 320 and 256
  EXPECT_EQ(rows(1408, 512).size(), 1u);
  // the GPU kernel decodes bf16 straight into the slice: twice the rows in the same bytes
  Nf4Weight q;
  q.shape = {11008, 4096};
  const auto bf16 = detail::nf4_row_slices(q, 2);
  ASSERT_EQ(bf16.size(), 6u);  // 5 x 2,048 rows and 768
  EXPECT_EQ(bf16[0].second, 2048);
  EXPECT_LE(2048 * 4096 * 2, detail::kNf4SliceBytes);
  EXPECT_EQ(detail::nf4_slices(q, 2), 6);
  // a CPU weight (no kernel) decodes through float whatever the product's dtype
  EXPECT_EQ(detail::nf4_value_bytes(nf4_quantize(at::randn({8, 64})), at::kBFloat16), 4);
}

TEST(Nf4Memory, AProductHoldsUnderTwoBytesPerWeight) {
  at::manual_seed(3);
  // the slicing seen on small weights: a limit of 192 KiB cuts 768 x 512 in 8
  struct Limit {
    std::int64_t was = detail::nf4_slice_bytes();
    Limit() { detail::nf4_slice_bytes() = 192 << 10; }
    ~Limit() { detail::nf4_slice_bytes() = was; }
  } limit;
  // rows that are whole blocks, and rows that end inside one (decoded row by row)
  for (const std::int64_t in : {512, 500}) {
    const std::int64_t out = 768, n = out * in;
    const Nf4Weight q = nf4_quantize(at::randn({out, in}));
    for (auto dtype : {at::kBFloat16, at::kFloat}) {
      const at::Tensor x = at::randn({16, in}).to(dtype), g = at::randn({16, out}).to(dtype);
      const std::int64_t fwd = temporaries_of([&] { return detail::nf4_matmul_t(x, q); });
      const std::int64_t bwd = temporaries_of([&] { return detail::nf4_matmul(g, q); });
      const std::int64_t whole = temporaries_of([&] { return at::matmul(x, reference_dequantize(q, dtype).t()); });
      EXPECT_LE(fwd, 2 * n) << in << " " << at::toString(dtype);
      EXPECT_LE(bwd, 2 * n) << in << " " << at::toString(dtype);
      EXPECT_GT(fwd, 0);
      EXPECT_GE(whole, 8 * n);  // the whole decode holds an 8-byte index per weight
    }
  }
}

// The engine's CUDA decoder (host/kernels/): registered when built with CUDA,
// never used for a CPU weight; on a machine with a GPU, the same bits as the
// ATen decode for every shape and dtype above, whole and in rectangles.
TEST(Nf4Kernel, TheEngineRegistersItsCudaDecoderWhenBuiltWithCuda) {
#ifdef WICK_WITH_CUDA
  ASSERT_TRUE(detail::nf4_kernel_op().has_value());
  EXPECT_EQ(detail::nf4_kernel_op()->schema().name(), "wick::nf4_decode");
#else
  EXPECT_FALSE(detail::nf4_kernel_op().has_value());
#endif
  const Nf4Weight q = nf4_quantize(at::randn({8, 64}), 64);
  EXPECT_FALSE(detail::nf4_kernel_applies(q, at::kBFloat16));  // a CPU weight decodes with ATen
}

// The kernel's eight-at-a-time path (host/kernels/nf4_decode.cu) walked on
// the CPU: its applicability test, its placement of each group of eight
// (nf4_group_place), its word read, shifts and nibble order, with the
// kernel's float operations, against the ATen decode of the same rectangle.
// A GPU checks the kernel itself (bench/nf4.cpp, scripts/gpu-check).
at::Tensor walk_decode8(const Nf4Weight& q, const kernels::Nf4DecodeArgs& a) {
  at::Tensor out = at::empty({a.rows, a.cols}, at::kFloat);
  EXPECT_TRUE(kernels::nf4_decode8_applies(a, out.data_ptr(), 4));
  const int bs = kernels::nf4_log2_exact(a.block), ss = kernels::nf4_log2_exact(a.scale_block);
  float* o_ptr = out.data_ptr<float>();
  for (std::uint64_t g = 0; g < static_cast<std::uint64_t>(a.rows * a.cols / 8); ++g) {
    std::int64_t p, o;
    kernels::nf4_group_place(g, a, p, o);
    std::uint32_t word;
    std::memcpy(&word, a.packed + (p >> 1), 4);
    const std::int64_t k = p >> bs;
    volatile float m = a.map[a.absmax_q[k]] * a.scale[k >> ss];  // no fused multiply-add, as the kernel
    const float absmax = m + *a.offset;
    for (int j = 0; j < 4; ++j) {
      const unsigned byte = (word >> (8 * j)) & 0xffu;
      o_ptr[o + 2 * j] = a.levels[byte >> 4] * absmax;
      o_ptr[o + 2 * j + 1] = a.levels[byte & 15u] * absmax;
    }
  }
  return out;
}

TEST(Nf4Kernel, ItsEightAtATimeWalkGivesTheATenDecodeOnTheCpu) {
  at::manual_seed(6);
  const at::Tensor map = nf4_table(1, at::kCPU).contiguous(), levels = nf4_table(0, at::kCPU).contiguous();
  for (const auto& [out, in, block] : std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t>>{
           {300, 256, 64}, {64, 1024, 32}, {520, 136, 8}}) {
    const Nf4Weight q = nf4_quantize(at::randn({out, in}), block);
    auto args = [&](std::int64_t width, std::int64_t row0, std::int64_t rows, std::int64_t col0, std::int64_t cols) {
      return kernels::Nf4DecodeArgs{q.packed.data_ptr<std::uint8_t>(), q.absmax_q.data_ptr<std::uint8_t>(),
                                    q.absmax_scale.data_ptr<float>(),   q.absmax_offset.data_ptr<float>(),
                                    map.data_ptr<float>(),              levels.data_ptr<float>(),
                                    width, row0, rows, col0, cols, q.block, q.scale_block};
    };
    const std::string where = std::to_string(out) + " x " + std::to_string(in) + ", block " + std::to_string(block);
    // the whole weight, and a forward product's slice of rows, as flat ranges
    for (const auto& [p0, p1] : std::vector<std::pair<std::int64_t, std::int64_t>>{{0, out * in}, {out / 4 * in, out / 2 * in}}) {
      const at::Tensor walked = walk_decode8(q, args(q.numel(), 0, 1, p0, p1 - p0));
      EXPECT_TRUE(same_bits(walked.view({-1}), detail::nf4_decode_range(q, p0, p1))) << where << ", range " << p0;
    }
    // an input gradient's slices of columns: block-aligned, and only 8-aligned
    for (const auto& [c0, c1] : std::vector<std::pair<std::int64_t, std::int64_t>>{{0, in}, {block, 2 * block}, {8, 24}}) {
      const at::Tensor walked = walk_decode8(q, args(in, 0, out, c0, c1 - c0));
      EXPECT_TRUE(same_bits(walked, detail::nf4_decode_columns(q, c0, c1, at::Tensor()))) << where << ", columns " << c0;
    }
  }
  // what falls back to one value a thread: runs of eight that start off a multiple of 8, a block that is not
  // a power of two or not a multiple of 8, a misaligned output
  const Nf4Weight q = nf4_quantize(at::randn({16, 64}), 64);
  kernels::Nf4DecodeArgs a{q.packed.data_ptr<std::uint8_t>(), q.absmax_q.data_ptr<std::uint8_t>(), nullptr, nullptr,
                           nullptr, nullptr, 64, 0, 16, 0, 64, 64, 256};
  alignas(16) static float buf[8];
  EXPECT_TRUE(kernels::nf4_decode8_applies(a, buf, 4));
  auto with = [&](auto change) {
    kernels::Nf4DecodeArgs b = a;
    change(b);
    return kernels::nf4_decode8_applies(b, buf, 4);
  };
  EXPECT_FALSE(with([](auto& b) { b.col0 = 4; }));
  EXPECT_FALSE(with([](auto& b) { b.cols = 12; }));
  EXPECT_FALSE(with([](auto& b) { b.width = 60; }));
  EXPECT_FALSE(with([](auto& b) { b.block = 48; }));
  EXPECT_FALSE(with([](auto& b) { b.block = 4; }));
  EXPECT_FALSE(with([](auto& b) { b.scale_block = 100; }));
  EXPECT_FALSE(kernels::nf4_decode8_applies(a, reinterpret_cast<char*>(buf) + 4, 4));
}

TEST(Nf4Kernel, OnAGpuItGivesTheBitsOfTheATenDecode) {
  if (!detail::nf4_kernel_op() || !at::hasCUDA() || at::getNumGPUs() == 0) GTEST_SKIP() << "no CUDA device here";
  at::manual_seed(3);
  for (const Shape& s : kShapes) {
    const Nf4Weight q = nf4_quantize(at::randn({s.out, s.in}).cuda(), s.block);
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      detail::nf4_use_kernel() = false;
      const at::Tensor whole = nf4_dequantize(q, dtype);
      const at::Tensor cols = detail::nf4_decode_columns(q, 1, s.in - 1, at::Tensor(), dtype);
      const at::Tensor range = detail::nf4_decode_range(q, 3, q.numel() - 5, dtype);
      detail::nf4_use_kernel() = true;
      EXPECT_TRUE(same_bits(nf4_dequantize(q, dtype), whole)) << s.out << "x" << s.in << " " << at::toString(dtype);
      EXPECT_TRUE(same_bits(detail::nf4_decode_columns(q, 1, s.in - 1, at::Tensor(), dtype), cols));
      EXPECT_TRUE(same_bits(detail::nf4_decode_range(q, 3, q.numel() - 5, dtype), range));
    }
  }
}

TEST(Nf4Errors, AWeightNotAMultipleOfTheBlockIsRefused) {
  try {
    nf4_quantize(at::randn({10, 10}), 64);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("nf4: a weight of 100 values is not a multiple of the block size 64"));
  }
}

TEST(Nf4Errors, AnOddCountIsRefusedClearly) {
  // a multiple of the odd block size 3, but two values share a byte
  try {
    nf4_quantize(at::randn({3, 3}), 3);
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("nf4: a weight of 9 values is odd"));
  }
}

TEST(Nf4Errors, AProductNeedsAMatrix) {
  const Nf4Weight q = nf4_quantize(at::randn({4, 4, 4}), 64);
  EXPECT_THROW(nf4_linear(at::randn({2, 16}), q), std::invalid_argument);
}

}  // namespace
}  // namespace wick
