#pragma once
/// \file json_fields.hpp
/// Typed fields of a JSON file (a Hugging Face config.json, a
/// tokenizer.json, an adapter_config.json): an integer must be a JSON integer
/// (not 32.0, not "32"), a flag a JSON boolean, as transformers' strict
/// configs require, and every error names the file and the key path:
/// "<file>: <key> is <value>, expected <what>". No LibTorch.

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "wick/options.hpp"

namespace wick {

/// `s` with each byte that is not part of valid UTF-8 (or is a control
/// character) replaced by '?', so that a message stays one printable line.
inline std::string printable_utf8(const std::string& s) {
  std::string out;
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    bool ok = n > 0 && i + n <= s.size() && !(n == 1 && (c < 0x20 || c == 0x7f));
    for (std::size_t k = 1; ok && k < n; ++k) ok = (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80;
    if (ok) {
      out.append(s, i, n);
      i += n;
    } else {
      out.push_back('?');
      ++i;
    }
  }
  return out;
}

/// A JSON value as a short piece of text, for messages.
inline std::string json_brief(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return printable_utf8(s.size() > 40 ? s.substr(0, 37) + "..." : s);
}

/// nlohmann's message without its "[json.exception.parse_error.101] " tag.
inline std::string json_error_text(const std::exception& e) {
  std::string what = e.what();
  if (what.rfind("[json.exception", 0) == 0 && what.find("] ") != std::string::npos) what = what.substr(what.find("] ") + 2);
  return printable_utf8(what);
}

/// Parses `text`; `file` names it in errors.
inline nlohmann::json parse_json_text(const std::string& text, const std::string& file) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(file + " is not valid JSON: " + json_error_text(e));
  }
}

/// Reads and parses a JSON file; errors name it.
inline nlohmann::json read_json_file(const std::filesystem::path& file) {
  std::error_code ec;
  if (std::filesystem::is_directory(file, ec)) throw Error(file.string() + " is a directory, expected a JSON file");
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error("cannot open " + file.string() + ": " + std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_json_text(text, file.string());
}

/// The fields of one JSON object. `where` names the file (and maybe the
/// reader: "decoder_lm: m/config.json"), `path` the object inside it
/// ("text_config." for a nested one).
class JsonFields {
 public:
  JsonFields(const nlohmann::json& j, std::string where, std::string path = "")
      : j_(j), where_(std::move(where)), path_(std::move(path)) {
    if (!j_.is_object())
      throw Error(where_ + ": " + (path_.empty() ? std::string("the file") : path_.substr(0, path_.size() - 1)) + " is " +
                  json_brief(j_) + ", expected a JSON object");
  }

  const nlohmann::json& json() const { return j_; }
  const std::string& where() const { return where_; }

  /// The value of `key`, or null when it is absent or JSON null.
  const nlohmann::json* find(const std::string& key) const {
    auto it = j_.find(key);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  bool has(const std::string& key) const { return find(key) != nullptr; }

  /// "<where>: <path><key> is <value>, expected <what>"
  [[noreturn]] void bad(const std::string& key, const std::string& expected) const {
    // JSON null is said as null: a key written as null is there, not missing
    auto it = j_.find(key);
    throw Error(where_ + ": " + printable_utf8(path_ + key) +
                (it != j_.end() ? " is " + json_brief(*it) : std::string(" is missing")) + ", expected " + expected);
  }
  /// An error about `key` in words of the caller's: "<where>: <path><key> <what>".
  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw Error(where_ + ": " + printable_utf8(path_ + key) + " " + what);
  }

  /// A required integer in [lo, hi].
  std::int64_t integer(const std::string& key, std::int64_t lo = std::numeric_limits<std::int64_t>::min(),
                       std::int64_t hi = std::numeric_limits<std::int64_t>::max()) const {
    const auto* v = find(key);
    if (!v) bad(key, expectation(lo, hi));
    return checked(key, *v, lo, hi);
  }
  /// An optional integer in [lo, hi] (absent or null: `fallback`).
  std::int64_t integer(const std::string& key, std::int64_t fallback, std::int64_t lo, std::int64_t hi) const {
    const auto* v = find(key);
    return v ? checked(key, *v, lo, hi) : fallback;
  }
  /// An optional number (integer or not) of at least `lo`, finite.
  double number(const std::string& key, double fallback, double lo = -std::numeric_limits<double>::max(),
                bool lo_open = false) const {
    const auto* v = find(key);
    if (!v) return fallback;
    const std::string want = lo == -std::numeric_limits<double>::max()
                                 ? "a number"
                                 : std::string("a number ") + (lo_open ? "above " : "of at least ") + brief(lo);
    if (!v->is_number()) bad(key, want);
    const double x = v->get<double>();
    if (!(x >= lo) || (lo_open && x == lo)) bad(key, want);
    return x;
  }
  bool flag(const std::string& key, bool fallback) const {
    const auto* v = find(key);
    if (!v) return fallback;
    if (!v->is_boolean()) bad(key, "true or false");
    return v->get<bool>();
  }
  std::string string(const std::string& key, const std::string& fallback) const {
    const auto* v = find(key);
    if (!v) return fallback;
    if (!v->is_string()) bad(key, "a string");
    return v->get<std::string>();
  }
  std::string string(const std::string& key) const {
    const auto* v = find(key);
    if (!v || !v->is_string()) bad(key, "a string");
    return v->get<std::string>();
  }
  /// A nested object's fields (required).
  JsonFields object(const std::string& key) const {
    const auto* v = find(key);
    if (!v || !v->is_object()) bad(key, "an object");
    return JsonFields(*v, where_, path_ + key + ".");
  }
  /// A required array.
  const nlohmann::json& array(const std::string& key) const {
    const auto* v = find(key);
    if (!v || !v->is_array()) bad(key, "a list");
    return *v;
  }

 private:
  static std::string brief(double x) {
    std::string s = nlohmann::json(x).dump();
    if (s.size() > 2 && s.substr(s.size() - 2) == ".0") s.resize(s.size() - 2);
    return s;
  }
  static std::string expectation(std::int64_t lo, std::int64_t hi) {
    constexpr auto kMin = std::numeric_limits<std::int64_t>::min();
    constexpr auto kMax = std::numeric_limits<std::int64_t>::max();
    if (lo == kMin && hi == kMax) return "an integer";
    if (hi == kMax) return "an integer of at least " + std::to_string(lo);
    if (lo == kMin) return "an integer of at most " + std::to_string(hi);
    return "an integer from " + std::to_string(lo) + " to " + std::to_string(hi);
  }
  std::int64_t checked(const std::string& key, const nlohmann::json& v, std::int64_t lo, std::int64_t hi) const {
    std::int64_t x = 0;
    if (v.is_number_unsigned()) {
      if (v.get<std::uint64_t>() > static_cast<std::uint64_t>(hi)) bad(key, expectation(lo, hi));
      x = static_cast<std::int64_t>(v.get<std::uint64_t>());
    } else if (v.is_number_integer()) {
      x = v.get<std::int64_t>();
    } else {
      bad(key, expectation(lo, hi));
    }
    if (x < lo || x > hi) bad(key, expectation(lo, hi));
    return x;
  }

  const nlohmann::json& j_;
  std::string where_, path_;
};

}  // namespace wick
