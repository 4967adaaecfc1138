#include "util/args.hpp"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <system_error>

namespace wick {
namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Advances i over digits; returns how many.
std::size_t digits(const std::string& s, std::size_t& i) {
  const std::size_t start = i;
  while (i < s.size() && is_digit(s[i])) ++i;
  return i - start;
}

}  // namespace

Value parse_arg_value(const std::string& text) {
  if (text == "true") return Value(true);
  if (text == "false") return Value(false);

  // The grammar by hand: std::from_chars takes "inf" and "nan" too, and the
  // spelling decides integer or number; the conversion after it (from_chars,
  // not strtod) ignores the locale.
  const std::string& s = text;
  std::size_t i = 0;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
  const std::size_t int_digits = digits(s, i);
  bool fraction = false, exponent = false;
  std::size_t frac_digits = 0;
  if (i < s.size() && s[i] == '.') {
    fraction = true;
    ++i;
    frac_digits = digits(s, i);
  }
  if (int_digits + frac_digits == 0) return Value(text);
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    exponent = true;
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    if (digits(s, i) == 0) return Value(text);
  }
  if (i != s.size()) return Value(text);

  // from_chars takes no leading '+'.
  const char* first = s.data() + (s[0] == '+' ? 1 : 0);
  const char* last = s.data() + s.size();
  if (!fraction && !exponent) {
    std::int64_t n = 0;
    const auto r = std::from_chars(first, last, n);
    if (r.ec == std::errc() && r.ptr == last) return Value(n);
    // beyond int64: still a plain decimal number, read as a double below
  }
  double d = 0;
  const auto r = std::from_chars(first, last, d, std::chars_format::general);
  // out of a double's range (1e999, 1e-999): kept as given rather than read as inf or 0
  if (r.ec != std::errc() || r.ptr != last || !std::isfinite(d)) return Value(text);
  return Value(d);
}

}  // namespace wick
