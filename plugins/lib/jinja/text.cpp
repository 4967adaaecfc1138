#include "lib/jinja/text.hpp"

#include <algorithm>

#include <utf8proc.h>

namespace wick::jinja::detail {

std::vector<char32_t> decode(const std::string& s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t left = s.size();
  while (left > 0) {
    utf8proc_int32_t cp;
    utf8proc_ssize_t n = utf8proc_iterate(p, left, &cp);
    if (n <= 0) {  // a stray byte stands for itself (U+FFFD would change the text)
      cp = *p;
      n = 1;
    }
    out.push_back(char32_t(cp));
    p += n;
    left -= n;
  }
  return out;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

std::string encode(const std::vector<char32_t>& cps) {
  std::string out;
  for (char32_t cp : cps) append_utf8(out, cp);
  return out;
}

bool is_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

bool is_alpha(char32_t cp) {
  auto cat = utf8proc_category(utf8proc_int32_t(cp));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT ||
         cat == UTF8PROC_CATEGORY_LM || cat == UTF8PROC_CATEGORY_LO;
}

bool is_cased(char32_t cp) {
  auto cat = utf8proc_category(utf8proc_int32_t(cp));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

namespace {
template <class F>
std::string map(const std::string& s, F f) {
  std::string out;
  out.reserve(s.size());
  for (char32_t cp : decode(s)) append_utf8(out, char32_t(f(utf8proc_int32_t(cp))));
  return out;
}
}  // namespace

// Python maps case with SpecialCasing.txt's full mappings, where one
// character may become several; the common ones (utf8proc knows the simple
// mappings only).
std::string to_upper(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t cp : decode(s)) {
    switch (cp) {
      case 0xDF: out += "SS"; break;
      case 0xFB00: out += "FF"; break;
      case 0xFB01: out += "FI"; break;
      case 0xFB02: out += "FL"; break;
      case 0xFB03: out += "FFI"; break;
      case 0xFB04: out += "FFL"; break;
      case 0xFB05:
      case 0xFB06: out += "ST"; break;
      case 0x149: out += "\u02BCN"; break;
      default: append_utf8(out, char32_t(utf8proc_toupper(utf8proc_int32_t(cp))));
    }
  }
  return out;
}

std::string to_lower(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t cp : decode(s)) {
    if (cp == 0x130) out += "i\u0307";
    else append_utf8(out, char32_t(utf8proc_tolower(utf8proc_int32_t(cp))));
  }
  return out;
}

std::string capitalize(const std::string& s) {
  auto cps = decode(s);
  std::string out;
  for (std::size_t k = 0; k < cps.size(); ++k)
    append_utf8(out, char32_t(k == 0 ? utf8proc_totitle(utf8proc_int32_t(cps[k])) : utf8proc_tolower(utf8proc_int32_t(cps[k]))));
  return out;
}

std::string title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (char32_t cp : decode(s)) {
    bool cased = is_cased(cp);
    if (cased) cp = char32_t(prev_cased ? utf8proc_tolower(utf8proc_int32_t(cp)) : utf8proc_totitle(utf8proc_int32_t(cp)));
    prev_cased = cased;
    append_utf8(out, cp);
  }
  return out;
}

std::string strip(const std::string& s, const std::string* chars, bool left, bool right) {
  auto cps = decode(s);
  std::vector<char32_t> set;
  if (chars) set = decode(*chars);
  auto drop = [&](char32_t c) { return chars ? std::find(set.begin(), set.end(), c) != set.end() : is_space(c); };
  std::size_t b = 0, e = cps.size();
  if (left)
    while (b < e && drop(cps[b])) ++b;
  if (right)
    while (e > b && drop(cps[e - 1])) --e;
  return encode(std::vector<char32_t>(cps.begin() + b, cps.begin() + e));
}

}  // namespace wick::jinja::detail
