#pragma once
// Numbers as people read them in progress lines and summaries.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

namespace wick {

/// 1.50 GiB, 12.3 MiB, 800 KiB.
inline std::string fmt_bytes(double n) {
  char buf[32];
  if (n >= 1073741824.0) std::snprintf(buf, sizeof buf, "%.2f GiB", n / 1073741824.0);
  else if (n >= 1048576.0) std::snprintf(buf, sizeof buf, "%.1f MiB", n / 1048576.0);
  else std::snprintf(buf, sizeof buf, "%.0f KiB", n / 1024.0);
  return buf;
}

/// m:ss or h:mm:ss.
inline std::string fmt_time(double seconds) {
  const auto s = static_cast<std::int64_t>(std::floor(std::max(0.0, seconds) + 0.5));
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                               static_cast<long long>(s % 3600 / 60), static_cast<long long>(s % 60));
  else std::snprintf(buf, sizeof buf, "%lld:%02lld", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  return buf;
}

/// printf into a std::string.
template <class... A>
std::string strf(const char* f, A... a) {
  const int n = std::snprintf(nullptr, 0, f, a...);
  std::string s(static_cast<std::size_t>(n > 0 ? n : 0), '\0');
  std::snprintf(s.data(), s.size() + 1, f, a...);
  return s;
}

}  // namespace wick
