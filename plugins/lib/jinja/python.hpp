#pragma once
// Python's semantics that several builtins share: its errors, str methods'
// argument handling, len(), iteration, and jinja2's dotted attribute paths.

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "lib/jinja/value.hpp"

namespace wick::jinja::detail {

[[noreturn]] inline void error(const std::string& message) { throw std::runtime_error(message); }
/// Fails with an undefined value's message (using it is an error).
void check_defined(const Value& v);
/// jinja2's object_type_repr: "None", "dict object", ...
std::string object_type(const Value& v);
/// The Undefined that `obj.name` gives when obj has no such attribute.
Value missing_attr(const Value& obj, const std::string& name);
bool number_kind_of(const Value& v);

std::string strip(const std::string& s, const std::optional<Value>& chars, bool left, bool right);
std::string upper(const std::string& s);
std::string lower(const std::string& s);
std::string replace(const std::string& s, const std::string& from, const std::string& to, std::int64_t count);
/// str.split(sep, maxsplit): on runs of whitespace when sep is None.
List split(const std::string& s, const std::optional<Value>& sep, std::int64_t maxsplit);
std::int64_t int_arg(const std::optional<Value>& v, std::int64_t fallback);
std::string str_arg(const std::optional<Value>& v, const std::string& what);
/// str.startswith / endswith with a str or a tuple of them.
bool affix(const std::string& s, const Value& x, bool start);

/// len(v); an Undefined's is 0.
std::int64_t length(const Value& v);
/// list(v): a list's items, a dict's keys, a string's characters.
List to_list(const Value& v);
/// `a.b.0` as jinja2's make_attrgetter reads it (items first, ints as indices).
Value attr_path(const Value& v, const Value& attribute);
/// Python's printf-style `format % values`.
std::string percent_format(const std::string& fmt, const Value& values);

}  // namespace wick::jinja::detail
