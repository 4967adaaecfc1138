#pragma once
/// \file crc32c.hpp
/// CRC-32C (Castagnoli) of bytes, header only, for plugins that check the
/// files they write themselves (a cache read back next run): the same
/// checksum the host records for checkpoint files. Uses the processor's
/// crc32 instruction where it has one (SSE 4.2).

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace wick {

namespace detail {

constexpr std::array<std::uint32_t, 256> crc32c_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    t[i] = c;
  }
  return t;
}

inline std::uint32_t crc32c_bytes(std::uint32_t c, const unsigned char* p, std::size_t n) {
  static constexpr auto kTable = crc32c_table();
  for (std::size_t i = 0; i < n; ++i) c = kTable[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_sse42(std::uint32_t c, const unsigned char* p,
                                                                    std::size_t n) {
  std::uint64_t c64 = c;
  while (n >= 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = __builtin_ia32_crc32di(c64, v);
    p += 8;
    n -= 8;
  }
  c = static_cast<std::uint32_t>(c64);
  while (n--) c = __builtin_ia32_crc32qi(c, *p++);
  return c;
}
#endif

}  // namespace detail

/// Continues `crc` (start with 0) over n bytes.
inline std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc = 0) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = crc ^ 0xffffffffu;
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  c = hardware ? detail::crc32c_sse42(c, p, n) : detail::crc32c_bytes(c, p, n);
#else
  c = detail::crc32c_bytes(c, p, n);
#endif
  return c ^ 0xffffffffu;
}

}  // namespace wick
