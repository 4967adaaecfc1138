// NF4 quantization a chunk at a time (nf4_quantize_chunked, used while
// loading) gives the very bytes of nf4_quantize on the whole weight: every
// chunk size, block size, dtype and a weight whose block count is not a
// multiple of the chunk or of the 256 constants of a double-quantization block.
#include <gtest/gtest.h>

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

TEST(Nf4, ChunkedQuantizationRefusesWhatItCannotBlock) {
  EXPECT_THROW(nf4_quantize_chunked(at::randn({10, 10}), 64), std::invalid_argument);
  EXPECT_THROW(nf4_quantize_chunked(at::randn({9}), 3), std::invalid_argument);
}

}  // namespace
}  // namespace wick
