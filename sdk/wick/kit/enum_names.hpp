#pragma once
/// \file enum_names.hpp
/// An enum's strings written once: a table of {value, name} pairs from which
/// parsing, printing, an option's choices and the "expected a, b or c" of an
/// error all derive, so adding a value is one line.
/// \code
///   enum class Pad { Repeat, Loop };
///   inline constexpr wick::EnumName<Pad> kPadNames[] = {{Pad::Repeat, "repeat"}, {Pad::Loop, "loop"}};
///   static_assert(wick::enum_names_distinct(kPadNames));
///
///   wick::opt_string("pad", "repeat", "how short clips are filled").one_of(wick::enum_names(kPadNames))
///   const Pad pad = wick::parse_enum(kPadNames, o.get_string("pad"), "pad");  // the schema checked it already
///   std::string s{wick::enum_name(kPadNames, pad)};                          // "loop"
/// \endcode
/// A two-way choice kept as a bool (on_oom = "split" | "fail") takes the same
/// table over bool.

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "wick/options.hpp"  // wick::Error

namespace wick {

/// One value of an enum and the word recipes, messages and docs use for it.
template <class E>
struct EnumName {
  E value;
  std::string_view name;
};

/// No name or value twice: a table a static_assert can check.
template <class E, std::size_t N>
constexpr bool enum_names_distinct(const EnumName<E> (&table)[N]) {
  for (std::size_t i = 0; i < N; ++i)
    for (std::size_t j = i + 1; j < N; ++j)
      if (table[i].name == table[j].name || table[i].value == table[j].value) return false;
  return true;
}

/// The value named `name`, or nothing.
template <class E, std::size_t N>
constexpr std::optional<E> find_enum(const EnumName<E> (&table)[N], std::string_view name) {
  for (const auto& e : table)
    if (e.name == name) return e.value;
  return std::nullopt;
}

/// The name of `value` ("?" for a value the table lacks).
template <class E, std::size_t N>
constexpr std::string_view enum_name(const EnumName<E> (&table)[N], E value) {
  for (const auto& e : table)
    if (e.value == value) return e.name;
  return "?";
}

/// Every name, in the table's order: an option's choices (OptionBuilder::one_of).
template <class E, std::size_t N>
std::vector<std::string> enum_names(const EnumName<E> (&table)[N]) {
  std::vector<std::string> out;
  for (const auto& e : table) out.emplace_back(e.name);
  return out;
}

/// The names as a message lists them: `a, b or c`, or with `quoted`
/// `"a", "b" or "c"`.
template <class E, std::size_t N>
std::string enum_names_text(const EnumName<E> (&table)[N], bool quoted = false) {
  std::string out;
  for (std::size_t i = 0; i < N; ++i) {
    if (i) out += i + 1 == N ? " or " : ", ";
    const std::string name(table[i].name);
    out += quoted ? "\"" + name + "\"" : name;
  }
  return out;
}

/// The value named `name`; else throws wick::Error
/// "<what>: expected a, b or c, got '<name>'".
template <class E, std::size_t N>
E parse_enum(const EnumName<E> (&table)[N], std::string_view name, std::string_view what, bool quoted = false) {
  if (auto v = find_enum(table, name)) return *v;
  throw Error(std::string(what) + ": expected " + enum_names_text(table, quoted) + ", got '" + std::string(name) + "'");
}

}  // namespace wick
