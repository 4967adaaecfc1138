#pragma once
// The values a template computes with, modelled on the Python objects jinja2
// hands around: how they print (str and repr), compare, test true, and turn
// into JSON (json.dumps).

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace wick::jinja::detail {

struct Value;
struct Args;
using List = std::vector<Value>;
using Function = std::function<Value(Args&)>;

/// A dict keeps its keys in insertion order, like Python's.
struct Dict {
  std::vector<std::pair<Value, Value>> items;
  const Value* find(const Value& key) const;
  void set(const Value& key, Value value);
};

enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kFunction };

struct Value {
  Kind kind = Kind::kUndefined;
  bool b = false;
  std::int64_t i = 0;
  double f = 0;
  std::string s;  // a string's bytes (UTF-8); an undefined value's error message
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<Function> fn;
  bool tuple = false;      // a list that prints as a tuple
  bool namespace_ = false; // a dict whose keys are attributes that `set` may assign

  static Value undefined(std::string message) { Value v; v.s = std::move(message); return v; }
  static Value none() { Value v; v.kind = Kind::kNone; return v; }
  static Value boolean(bool x) { Value v; v.kind = Kind::kBool; v.b = x; return v; }
  static Value integer(std::int64_t x) { Value v; v.kind = Kind::kInt; v.i = x; return v; }
  static Value real(double x) { Value v; v.kind = Kind::kFloat; v.f = x; return v; }
  static Value string(std::string x) { Value v; v.kind = Kind::kString; v.s = std::move(x); return v; }
  static Value of_list(List x, bool tuple = false);
  static Value of_dict(Dict x);
  static Value function(Function f);
  static Value from_json(const nlohmann::json& j);
  static Value from_json(const nlohmann::ordered_json& j);

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_none() const { return kind == Kind::kNone; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_number() const { return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool; }
  bool is_list() const { return kind == Kind::kList; }
  bool is_dict() const { return kind == Kind::kDict; }
  double as_double() const { return kind == Kind::kFloat ? f : kind == Kind::kBool ? b : double(i); }
  std::int64_t as_int() const { return kind == Kind::kBool ? b : i; }
};

/// Positional and keyword arguments of a call.
struct Args {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
  /// The argument named `name` or at `index`, consumed; nullopt when absent.
  std::optional<Value> take(std::size_t index, const std::string& name);
};

/// Python's bool(x).
bool truthy(const Value& v);
/// Python's str(x) (an undefined value prints as nothing).
std::string str(const Value& v);
/// Python's repr(x).
std::string repr(const Value& v);
/// Python's ==.
bool equals(const Value& a, const Value& b);
/// Python's < on numbers, strings and lists; throws std::invalid_argument otherwise.
bool less(const Value& a, const Value& b);
/// The type's name in Python's messages ("str", "dict", "NoneType", ...).
std::string type_name(const Value& v);
/// json.dumps(v, ensure_ascii, indent, separators, sort_keys).
std::string to_json(const Value& v, bool ensure_ascii, std::optional<std::string> indent,
                    std::optional<std::pair<std::string, std::string>> separators, bool sort_keys);
/// Python's repr of a float.
std::string float_repr(double x);

/// The code points of a UTF-8 string, as byte offsets of their starts (and
/// the size at the end), for indexing and slicing strings as Python does.
std::vector<std::size_t> code_point_starts(const std::string& s);

}  // namespace wick::jinja::detail
