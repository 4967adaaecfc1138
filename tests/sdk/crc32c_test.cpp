// The kit's header-only CRC-32C (for plugins) is the host's checksum: the
// standard check value, and the host's result on bytes of every length and
// alignment the word-at-a-time path handles.

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "util/checksum.hpp"
#include "wick/kit/crc32c.hpp"

TEST(KitCrc32c, GivesTheCheckValueAndTheHostsChecksum) {
  EXPECT_EQ(wick::crc32c("123456789", 9), 0xE3069283u);  // CRC-32C's check value
  EXPECT_EQ(wick::crc32c("", 0), 0u);
  std::vector<unsigned char> bytes(300);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 131 + 7);
  for (std::size_t at = 0; at < 9; ++at)
    for (std::size_t n = 0; at + n <= bytes.size(); n += 37)
      EXPECT_EQ(wick::crc32c(bytes.data() + at, n), wick::crc32c_extend(0, bytes.data() + at, n)) << at << " " << n;
  // continued in two parts, as over several tensors
  EXPECT_EQ(wick::crc32c(bytes.data() + 100, 200, wick::crc32c(bytes.data(), 100)), wick::crc32c(bytes.data(), 300));
}
