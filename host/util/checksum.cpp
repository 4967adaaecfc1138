#include "util/checksum.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "wick/kit/crc32c.hpp"
#include "wick/options.hpp"

namespace wick {

// one implementation: the SDK kit's, which plugins use for their own files
std::uint32_t crc32c_extend(std::uint32_t crc, const void* data, std::size_t n) { return crc32c(data, n, crc); }

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
