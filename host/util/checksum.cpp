#include "util/checksum.hpp"

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "wick/options.hpp"

namespace wick {
namespace {

constexpr std::array<std::uint32_t, 256> make_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr auto kTable = make_table();

std::uint32_t extend_table(std::uint32_t c, const unsigned char* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) c = kTable[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint32_t extend_hw(std::uint32_t c, const unsigned char* p, std::size_t n) {
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
const bool kHardware = __builtin_cpu_supports("sse4.2");
#endif

}  // namespace

std::uint32_t crc32c_extend(std::uint32_t crc, const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = crc ^ 0xffffffffu;
#if defined(__x86_64__)
  c = kHardware ? extend_hw(c, p, n) : extend_table(c, p, n);
#else
  c = extend_table(c, p, n);
#endif
  return c ^ 0xffffffffu;
}

std::uint32_t crc32c_file(const std::filesystem::path& file, std::uint64_t* bytes) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(file.c_str(), "rb"), &std::fclose);
  if (!f) throw Error("cannot read " + file.string() + ": " + std::strerror(errno));
  std::vector<char> buf(1 << 20);
  std::uint32_t crc = 0;
  std::uint64_t total = 0;
  for (;;) {
    const std::size_t n = std::fread(buf.data(), 1, buf.size(), f.get());
    if (n > 0) crc = crc32c_extend(crc, buf.data(), n);
    total += n;
    if (n < buf.size()) {
      if (std::ferror(f.get())) throw Error("cannot read " + file.string() + ": " + std::strerror(errno));
      break;
    }
  }
  if (bytes) *bytes = total;
  return crc;
}

}  // namespace wick
