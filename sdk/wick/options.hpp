#pragma once
/// \file options.hpp
/// Option values and option schemas: what a plugin declares it accepts, and
/// the validated, defaulted table it receives in its factory.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace wick {

/// Every error wick reports to a user: what went wrong, where, what was expected.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Value;
using List = std::vector<Value>;

/// A value from a recipe: nil, boolean, integer, number, string or list.
struct Value {
  std::variant<std::monostate, bool, std::int64_t, double, std::string, List> v;

  Value() = default;
  Value(bool b) : v(b) {}
  Value(int i) : v(std::int64_t{i}) {}
  Value(std::int64_t i) : v(i) {}
  Value(double d) : v(d) {}
  Value(const char* s) : v(std::string(s)) {}
  Value(std::string s) : v(std::move(s)) {}
  Value(List l) : v(std::move(l)) {}

  bool is_nil() const { return std::holds_alternative<std::monostate>(v); }
  bool is_bool() const { return std::holds_alternative<bool>(v); }
  bool is_int() const { return std::holds_alternative<std::int64_t>(v); }
  bool is_number() const { return is_int() || std::holds_alternative<double>(v); }
  bool is_string() const { return std::holds_alternative<std::string>(v); }
  bool is_list() const { return std::holds_alternative<List>(v); }

  bool as_bool() const { return std::get<bool>(v); }
  std::int64_t as_int() const { return std::get<std::int64_t>(v); }
  /// An integer or a number, as a double.
  double as_number() const {
    return is_int() ? static_cast<double>(std::get<std::int64_t>(v)) : std::get<double>(v);
  }
  const std::string& as_string() const { return std::get<std::string>(v); }
  const List& as_list() const { return std::get<List>(v); }

  /// A short rendering for messages: 3, 0.5, "relu", {1, 2}.
  std::string repr() const;
  /// For an integer expected: why a whole number read as a number (past 2^53,
  /// where Lua's numbers stop being exact integers), or "".
  std::string not_exact_note() const {
    const bool whole_past = std::holds_alternative<double>(v) && std::isfinite(std::get<double>(v)) &&
                            std::floor(std::get<double>(v)) == std::get<double>(v) &&
                            std::fabs(std::get<double>(v)) >= 9007199254740992.0;
    return whole_past ? " (past 2^53 = 9007199254740992, where Lua's numbers are no longer exact integers: "
                        "2^53 + 1 reads as 2^53)"
                      : "";
  }
  /// The Lua-ish name of the value's type: nil, boolean, integer, number, string, list.
  std::string type_name() const;
};

/// The types an option may declare. One word for Lua's numbers, in the names
/// as in messages: number (OptionType::Number, opt_number, get_number).
enum class OptionType {
  Bool,
  Int,
  Number,
  String,
  IntList,
  NumberList,
  StringList,
};

const char* to_string(OptionType t);

/// One declared option: name, type, default, range or choices, doc.
struct OptionSpec {
  std::string name;
  OptionType type = OptionType::Number;
  Value default_value;                 ///< nil means required
  std::optional<double> min, max;      ///< range for numbers (each list item too), inclusive unless *_open
  std::vector<std::string> choices;    ///< allowed strings (each list item too)
  std::string doc;
  bool optional = false;               ///< nil default, and may be left out
  bool min_open = false;               ///< min itself excluded: > min (ABI 8)
  bool max_open = false;               ///< max itself excluded: < max (ABI 8)
  bool required() const { return default_value.is_nil() && !optional; }
};

using OptionSchema = std::vector<OptionSpec>;

/// Builders that keep schemas short to write (the host declares wick.train's
/// options with them too):
///   wick::opt_int("inputs", 4, "input features").range(1, 1 << 20)
///   wick::opt_number("decay", 0.5, "a factor in (0, 1)").above(0).below(1)
struct OptionBuilder {
  OptionSpec spec;
  /// [lo, hi]
  OptionBuilder& range(double lo, double hi) { at_least(lo); return at_most(hi); }
  /// >= lo, > lo; <= hi, < hi
  OptionBuilder& at_least(double lo) { spec.min = lo; spec.min_open = false; return *this; }
  OptionBuilder& above(double lo) { spec.min = lo; spec.min_open = true; return *this; }
  OptionBuilder& at_most(double hi) { spec.max = hi; spec.max_open = false; return *this; }
  OptionBuilder& below(double hi) { spec.max = hi; spec.max_open = true; return *this; }
  OptionBuilder& one_of(std::vector<std::string> c) { spec.choices = std::move(c); return *this; }
  OptionBuilder& required() { spec.default_value = Value(); return *this; }
  /// No default: the factory sees the option as absent (Options::has is false).
  OptionBuilder& optional() { spec.default_value = Value(); spec.optional = true; return *this; }
  operator OptionSpec() const { return spec; }
};
inline OptionBuilder opt(std::string name, OptionType t, Value def, std::string doc) {
  OptionSpec s;
  s.name = std::move(name);
  s.type = t;
  s.default_value = std::move(def);
  s.doc = std::move(doc);
  return OptionBuilder{std::move(s)};
}
inline OptionBuilder opt_bool(std::string n, bool d, std::string doc) { return opt(std::move(n), OptionType::Bool, d, std::move(doc)); }
inline OptionBuilder opt_int(std::string n, Value d, std::string doc) { return opt(std::move(n), OptionType::Int, std::move(d), std::move(doc)); }
inline OptionBuilder opt_number(std::string n, Value d, std::string doc) { return opt(std::move(n), OptionType::Number, std::move(d), std::move(doc)); }
inline OptionBuilder opt_string(std::string n, Value d, std::string doc) { return opt(std::move(n), OptionType::String, std::move(d), std::move(doc)); }

/// The validated options a factory receives: every declared key is present
/// (given or defaulted, except optional ones left nil), nothing undeclared is.
class Options {
 public:
  Options() = default;
  explicit Options(std::map<std::string, Value> values) : values_(std::move(values)) {}

  bool has(const std::string& key) const {
    auto it = values_.find(key);
    return it != values_.end() && !it->second.is_nil();
  }
  const Value& at(const std::string& key) const {
    auto it = values_.find(key);
    if (it == values_.end()) throw Error("option '" + key + "' was not declared");
    return it->second;
  }
  bool get_bool(const std::string& k) const { return at(k).as_bool(); }
  std::int64_t get_int(const std::string& k) const { return at(k).as_int(); }
  double get_number(const std::string& k) const { return at(k).as_number(); }
  const std::string& get_string(const std::string& k) const { return at(k).as_string(); }
  std::vector<std::int64_t> get_int_list(const std::string& k) const {
    std::vector<std::int64_t> out;
    for (const auto& x : at(k).as_list()) out.push_back(x.as_int());
    return out;
  }
  std::vector<double> get_number_list(const std::string& k) const {
    std::vector<double> out;
    for (const auto& x : at(k).as_list()) out.push_back(x.as_number());
    return out;
  }
  const std::map<std::string, Value>& values() const { return values_; }

 private:
  std::map<std::string, Value> values_;
};

// ---- inline implementations ----

inline std::string Value::type_name() const {
  switch (v.index()) {
    case 0: return "nil";
    case 1: return "boolean";
    case 2: return "integer";
    case 3: return "number";
    case 4: return "string";
    default: return "list";
  }
}

inline std::string Value::repr() const {
  switch (v.index()) {
    case 0: return "nil";
    case 1: return as_bool() ? "true" : "false";
    case 2: return std::to_string(as_int());
    case 3: {
      // the shortest form that reads back as the same double; NaN is "nan"
      // whatever its sign bit (0/0 in Lua is -nan, printf writes "-nan")
      const double x = std::get<double>(v);
      if (std::isnan(x)) return "nan";
      if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
      char buf[64];
      for (int prec = 6; prec <= 17; ++prec) {
        std::snprintf(buf, sizeof buf, "%.*g", prec, std::get<double>(v));
        if (std::strtod(buf, nullptr) == std::get<double>(v)) break;
      }
      return buf;
    }
    case 4: return "\"" + as_string() + "\"";
    default: {
      std::string s = "{";
      const auto& l = as_list();
      for (std::size_t i = 0; i < l.size(); ++i) s += (i ? ", " : "") + l[i].repr();
      return s + "}";
    }
  }
}

inline const char* to_string(OptionType t) {
  switch (t) {
    case OptionType::Bool: return "boolean";
    case OptionType::Int: return "integer";
    case OptionType::Number: return "number";
    case OptionType::String: return "string";
    case OptionType::IntList: return "list of integers";
    case OptionType::NumberList: return "list of numbers";
    case OptionType::StringList: return "list of strings";
  }
  return "?";
}

}  // namespace wick
