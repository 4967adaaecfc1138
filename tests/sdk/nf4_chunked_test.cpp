// NF4 quantization a chunk at a time (nf4_quantize_chunked, used while
// loading) gives the very bytes of nf4_quantize on the whole weight: every
// chunk size, block size, dtype and a weight whose block count is not a
// multiple of the chunk or of the 256 constants of a double-quantization block.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "wick/kit/nf4.hpp"

namespace wick {
namespace {

void expect_same(const Nf4Weight& a, const Nf4Weight& b, const std::string& what) {
  EXPECT_EQ(a.shape, b.shape) << what;
  EXPECT_EQ(a.block, b.block) << what;
  EXPECT_TRUE(at::equal(a.packed, b.packed)) << what;
  EXPECT_TRUE(at::equal(a.absmax_q, b.absmax_q)) << what;
  EXPECT_TRUE(at::equal(a.absmax_scale, b.absmax_scale)) << what;
  EXPECT_TRUE(at::equal(a.absmax_offset, b.absmax_offset)) << what;
}

TEST(Nf4, ChunkedQuantizationEqualsTheWholeWeights) {
  at::manual_seed(5);
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (std::int64_t block : {64, 32, 2}) {
      const at::Tensor w = (at::randn({96, 200}) * at::rand({96, 1}) * 3).to(dtype);
      const Nf4Weight whole = nf4_quantize(w, block);
      for (std::int64_t chunk : {1, 3, 7, 300, 1 << 20}) {
        const std::string what = std::string(c10::toString(dtype)) + " block " + std::to_string(block) + " chunk " +
                                 std::to_string(chunk);
        expect_same(nf4_quantize_chunked(w, block, 256, chunk), whole, what);
      }
    }
  }
}

// A part of the codes (what a rank of a divided run keeps, cut anywhere on a
// byte) from the whole weight's block constants: the whole codes' bytes there.
TEST(Nf4, PackedCodesOfAnyRangeEqualTheWholeWeightsThere) {
  at::manual_seed(6);
  const at::Tensor w = (at::randn({96, 200}) * at::rand({96, 1}) * 3).to(at::kBFloat16);
  const Nf4Weight whole = nf4_quantize(w, 64);
  const at::Tensor absmax = nf4_absmax(w, 64, 0, w.numel() / 64);
  EXPECT_TRUE(at::equal(nf4_absmax(w, 64, 17, 40, 5), absmax.slice(0, 17, 40)));
  for (auto [first, last] : {std::pair<std::int64_t, std::int64_t>{0, 19200}, {2, 64}, {62, 66}, {130, 9000},
                             {19198, 19200}, {640, 640}})
    for (std::int64_t chunk : {1, 3, 1 << 20})
      EXPECT_TRUE(at::equal(nf4_pack(w, absmax, 64, first, last, chunk), whole.packed.slice(0, first / 2, last / 2)))
          << first << ".." << last << " chunk " << chunk;
  EXPECT_THROW(nf4_pack(w, absmax, 64, 1, 64), std::invalid_argument);  // cuts a byte
  // an odd block in odd chunks: the pieces still pack whole bytes
  const at::Tensor v = at::randn({2, 9});
  const Nf4Weight odd = nf4_quantize(v, 3);
  EXPECT_TRUE(at::equal(nf4_pack(v, nf4_absmax(v, 3, 0, 6), 3, 0, 18, 1), odd.packed));
}

// The codes as ATen computes them (what nf4_pack did before its CPU pass):
// each value over its block's constant, the nearest level by bucketize over
// the midpoints, two codes to a byte.
at::Tensor aten_codes(const at::Tensor& w, std::int64_t block) {
  const at::Tensor blocks = w.to(at::kFloat).reshape({-1, block});
  const at::Tensor normed = blocks / blocks.abs().amax(1).clamp_min(1e-12).unsqueeze(1);
  const at::Tensor idx = nearest(normed.reshape({-1}), nf4_table(0, w.device())).to(at::kByte).reshape({-1, 2});
  return idx.select(1, 0).bitwise_left_shift(4).bitwise_or(idx.select(1, 1));
}

// The CPU pass (15 comparisons a value, in runs) gives the bytes of the ATen
// route: random weights in every dtype and block size (odd ones, and counts
// that leave a run of 2 after the runs of 4), a transposed (non-contiguous)
// weight, one large enough to be cut between threads inside blocks, ranges
// cut anywhere on a byte; values exactly on a midpoint (the lower level, as
// bucketize), beside it and on a level, +-0, and (over a constant of 1, so
// the values meet the comparisons themselves) NaN and infinities; blocks
// whose constant is infinite, NaN or zero.
TEST(Nf4, CpuPackingGivesTheBytesOfTheAtenRoute) {
  at::manual_seed(9);
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf})
    for (std::int64_t block : {64, 32, 6, 3, 2}) {
      const at::Tensor w = (at::randn({64, 198}) * at::rand({64, 1}) * 3).to(dtype);  // 12,672 values: 2 mod 4 runs
      const std::string what = std::string(c10::toString(dtype)) + " block " + std::to_string(block);
      EXPECT_TRUE(at::equal(nf4_quantize(w, block).packed, aten_codes(w, block))) << what;
      EXPECT_TRUE(at::equal(nf4_quantize_chunked(w, block, 256, 5).packed, aten_codes(w, block))) << what;
      const at::Tensor absmax = nf4_absmax(w, block, 0, w.numel() / block);
      for (auto [first, last] : {std::pair<std::int64_t, std::int64_t>{2, 190}, {6, 12672}, {4094, 4100}})
        EXPECT_TRUE(at::equal(nf4_pack(w, absmax, block, first, last), aten_codes(w, block).slice(0, first / 2, last / 2)))
            << what << " " << first << ".." << last;
    }
  const at::Tensor wt = at::randn({96, 128}).t();  // not contiguous
  EXPECT_TRUE(at::equal(nf4_quantize(wt, 64).packed, aten_codes(wt.contiguous(), 64)));
  const int threads = at::get_num_threads();
  at::set_num_threads(4);
  const at::Tensor big = at::randn({401, 250}).to(at::kBFloat16);  // 100,250 values, blocks of 50 across the cuts
  EXPECT_TRUE(at::equal(nf4_quantize(big, 50).packed, aten_codes(big, 50)));
  at::set_num_threads(threads);

  // a block whose largest magnitude is 1: each value is its own normed value
  const float* mids = detail::nf4_mids();
  const float* levels = nf4_levels();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> v = {1.0f, 0.0f, -0.0f};
  for (int k = 0; k < 15; ++k) {
    v.push_back(mids[k]);
    v.push_back(std::nextafter(mids[k], 2.0f));
    v.push_back(std::nextafter(mids[k], -2.0f));
    v.push_back(levels[k]);
  }
  while (v.size() % 64 != 0) v.push_back(-1.0f);
  for (float special : {inf, std::nanf("")}) {  // a block holding one: its constant is infinite or NaN
    std::vector<float> b = {special, 0.5f, -0.3f, 0.0f};
    b.resize(64, 0.1f);
    v.insert(v.end(), b.begin(), b.end());
  }
  v.resize(v.size() + 64, 0.0f);  // a block of zeros
  const at::Tensor t = at::from_blob(v.data(), {static_cast<std::int64_t>(v.size())}, at::kFloat).clone();
  const at::Tensor codes = nf4_quantize(t, 64).packed;
  EXPECT_TRUE(at::equal(codes, aten_codes(t, 64)));
  // a midpoint takes the lower level: value 3 is mids[0] (byte 1's low nibble),
  // value 7 mids[1] (byte 3's low nibble)
  EXPECT_EQ(codes[1].item<std::uint8_t>() & 15, 0);
  EXPECT_EQ(codes[3].item<std::uint8_t>() & 15, 1);
  const at::Tensor absmax = nf4_absmax(t, 64, 0, t.numel() / 64);
  for (auto [first, last] : {std::pair<std::int64_t, std::int64_t>{0, t.numel()}, {2, 66}, {62, 130}, {128, 192}})
    EXPECT_TRUE(at::equal(nf4_pack(t, absmax, 64, first, last), aten_codes(t, 64).slice(0, first / 2, last / 2)))
        << first << ".." << last;
  // NaN and the infinities over a constant of 1: each as bucketize places it
  // (NaN and +inf the highest level, -inf the lowest)
  std::vector<float> u = {std::nanf(""), inf, -inf, -0.0f, 0.3f, std::nanf("")};
  u.resize(64, 0.2f);
  const at::Tensor ut = at::from_blob(u.data(), {64}, at::kFloat).clone(), one = at::ones({1});
  const at::Tensor want_idx = nearest(ut, nf4_table(0, ut.device())).to(at::kByte).reshape({-1, 2});
  const at::Tensor want = want_idx.select(1, 0).bitwise_left_shift(4).bitwise_or(want_idx.select(1, 1));
  const at::Tensor got = nf4_pack(ut, one, 64, 0, 64);
  EXPECT_TRUE(at::equal(got, want));
  EXPECT_EQ(got[0].item<std::uint8_t>(), 0xFF);  // NaN, +inf
  EXPECT_EQ(got[1].item<std::uint8_t>() >> 4, 0);  // -inf
  // what the pass would read past: refused, in words
  EXPECT_THROW(nf4_pack(ut, one, 64, 0, 66), std::invalid_argument);       // past the weight
  EXPECT_THROW(nf4_pack(t, absmax.slice(0, 0, 2), 64, 0, 192), std::invalid_argument);  // too few constants
  EXPECT_THROW(nf4_pack(ut, one, 0, 0, 64), std::invalid_argument);        // no block
}

TEST(Nf4, ChunkedQuantizationRefusesWhatItCannotBlock) {
  EXPECT_THROW(nf4_quantize_chunked(at::randn({10, 10}), 64), std::invalid_argument);
  EXPECT_THROW(nf4_quantize_chunked(at::randn({9}), 3), std::invalid_argument);
}

}  // namespace
}  // namespace wick
