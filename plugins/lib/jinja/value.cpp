#include "lib/jinja/value.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace wick::jinja::detail {

const Value* Dict::find(const Value& key) const {
  for (auto& [k, v] : items)
    if (equals(k, key)) return &v;
  return nullptr;
}

void Dict::set(const Value& key, Value value) {
  for (auto& [k, v] : items)
    if (equals(k, key)) {
      v = std::move(value);
      return;
    }
  items.emplace_back(key, std::move(value));
}

Value Value::of_list(List x, bool tuple) {
  Value v;
  v.kind = Kind::kList;
  v.list = std::make_shared<List>(std::move(x));
  v.tuple = tuple;
  return v;
}

Value Value::of_dict(Dict x) {
  Value v;
  v.kind = Kind::kDict;
  v.dict = std::make_shared<Dict>(std::move(x));
  return v;
}

Value Value::function(Function f) {
  Value v;
  v.kind = Kind::kFunction;
  v.fn = std::make_shared<Function>(std::move(f));
  return v;
}

namespace {
template <class Json>
Value value_of(const Json& j) {
  using Value = wick::jinja::detail::Value;
  using t = typename Json::value_t;
  switch (j.type()) {
    case t::null: return Value::none();
    case t::boolean: return Value::boolean(j.template get<bool>());
    case t::number_integer: return Value::integer(j.template get<std::int64_t>());
    case t::number_unsigned: return Value::integer(std::int64_t(j.template get<std::uint64_t>()));
    case t::number_float: return Value::real(j.template get<double>());
    case t::string: return Value::string(j.template get<std::string>());
    case t::array: {
      List l;
      l.reserve(j.size());
      for (auto& e : j) l.push_back(value_of(e));
      return Value::of_list(std::move(l));
    }
    case t::object: {
      Dict d;
      for (auto& [k, e] : j.items()) d.items.emplace_back(Value::string(k), value_of(e));
      return Value::of_dict(std::move(d));
    }
    default: return Value::none();
  }
}
}  // namespace

Value Value::from_json(const nlohmann::json& j) { return value_of(j); }
Value Value::from_json(const nlohmann::ordered_json& j) { return value_of(j); }

std::optional<Value> Args::take(std::size_t index, const std::string& name) {
  for (auto it = keyword.begin(); it != keyword.end(); ++it)
    if (it->first == name) {
      Value v = std::move(it->second);
      keyword.erase(it);
      return v;
    }
  if (index < positional.size()) {
    return positional[index];
  }
  return std::nullopt;
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return false;
    case Kind::kNone: return false;
    case Kind::kBool: return v.b;
    case Kind::kInt: return v.i != 0;
    case Kind::kFloat: return v.f != 0;
    case Kind::kString: return !v.s.empty();
    case Kind::kList: return !v.list->empty();
    case Kind::kDict: return !v.dict->items.empty();
    case Kind::kFunction: return true;
  }
  return false;
}

std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  // sci is [-]d[.ddd]e(+|-)XX: take the digits and the exponent.
  bool neg = sci[0] == '-';
  std::size_t epos = sci.find('e');
  std::string mant = sci.substr(neg ? 1 : 0, epos - (neg ? 1 : 0));
  int exp = std::stoi(sci.substr(epos + 1));
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  std::string out = neg ? "-" : "";
  if (exp < -4 || exp >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char e[16];
    std::snprintf(e, sizeof e, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    return out + e;
  }
  if (exp < 0) return out + "0." + std::string(-exp - 1, '0') + digits;
  if (int(digits.size()) <= exp + 1) return out + digits + std::string(exp + 1 - digits.size(), '0') + ".0";
  return out + digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
}

namespace {

std::string string_repr(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == q || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    } else {
      out += char(c);
    }
  }
  return out + q;
}

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (std::size_t k = 0; k < s.size(); ++k) {
    unsigned char c = s[k];
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          out += b;
        } else if (c >= 0x80 && ensure_ascii) {
          // decode one code point, write \uXXXX (a surrogate pair above the BMP)
          std::uint32_t cp = 0;
          int n = c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : c >= 0xC0 ? 1 : 0;
          cp = c & (0x3F >> n);
          for (int m = 0; m < n && k + 1 < s.size(); ++m) cp = (cp << 6) | (s[++k] & 0x3F);
          char b[16];
          if (cp >= 0x10000) {
            cp -= 0x10000;
            std::snprintf(b, sizeof b, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
          } else {
            std::snprintf(b, sizeof b, "\\u%04x", cp);
          }
          out += b;
        } else {
          out += char(c);
        }
    }
  }
  out += '"';
}

std::string json_float(double x) {
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "Infinity" : "-Infinity";
  return float_repr(x);
}

void dump(std::string& out, const Value& v, bool ensure_ascii, const std::optional<std::string>& indent,
          const std::string& item_sep, const std::string& key_sep, bool sort_keys, int depth) {
  auto newline = [&](int d) {
    out += '\n';
    for (int k = 0; k < d; ++k) out += *indent;
  };
  switch (v.kind) {
    case Kind::kNone: out += "null"; return;
    case Kind::kBool: out += v.b ? "true" : "false"; return;
    case Kind::kInt: out += std::to_string(v.i); return;
    case Kind::kFloat: out += json_float(v.f); return;
    case Kind::kString: json_string(out, v.s, ensure_ascii); return;
    case Kind::kList: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      bool first = true;
      for (auto& e : *v.list) {
        if (!first) out += item_sep;
        first = false;
        if (indent) newline(depth + 1);
        dump(out, e, ensure_ascii, indent, item_sep, key_sep, sort_keys, depth + 1);
      }
      if (indent) newline(depth);
      out += ']';
      return;
    }
    case Kind::kDict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<Value, Value>*> items;
      for (auto& kv : v.dict->items) items.push_back(&kv);
      if (sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return less(a->first, b->first); });
      out += '{';
      bool first = true;
      for (auto* kv : items) {
        if (!first) out += item_sep;
        first = false;
        if (indent) newline(depth + 1);
        const Value& k = kv->first;
        if (k.is_string()) json_string(out, k.s, ensure_ascii);
        else if (k.kind == Kind::kFloat) json_string(out, json_float(k.f), ensure_ascii);
        else if (k.kind == Kind::kInt) json_string(out, std::to_string(k.i), ensure_ascii);
        else if (k.kind == Kind::kBool) json_string(out, k.b ? "true" : "false", ensure_ascii);
        else if (k.is_none()) json_string(out, "null", ensure_ascii);
        else throw std::invalid_argument("keys must be str, int, float, bool or None, not " + type_name(k));
        out += key_sep;
        dump(out, kv->second, ensure_ascii, indent, item_sep, key_sep, sort_keys, depth + 1);
      }
      if (indent) newline(depth);
      out += '}';
      return;
    }
    default:
      throw std::invalid_argument("Object of type " + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string str(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return "";
    case Kind::kString: return v.s;
    default: return repr(v);
  }
}

std::string repr(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "None";
    case Kind::kBool: return v.b ? "True" : "False";
    case Kind::kInt: return std::to_string(v.i);
    case Kind::kFloat: return float_repr(v.f);
    case Kind::kString: return string_repr(v.s);
    case Kind::kList: {
      std::string out = v.tuple ? "(" : "[";
      for (std::size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + repr((*v.list)[k]);
      if (v.tuple && v.list->size() == 1) out += ",";
      return out + (v.tuple ? ")" : "]");
    }
    case Kind::kDict: {
      if (v.namespace_) {
        std::string out = "<Namespace {";
        for (std::size_t k = 0; k < v.dict->items.size(); ++k)
          out += (k ? ", " : "") + repr(v.dict->items[k].first) + ": " + repr(v.dict->items[k].second);
        return out + "}>";
      }
      std::string out = "{";
      for (std::size_t k = 0; k < v.dict->items.size(); ++k)
        out += (k ? ", " : "") + repr(v.dict->items[k].first) + ": " + repr(v.dict->items[k].second);
      return out + "}";
    }
    case Kind::kFunction: return "<function>";
  }
  return "";
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::kFloat || b.kind == Kind::kFloat) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::kUndefined: return true;
    case Kind::kNone: return true;
    case Kind::kString: return a.s == b.s;
    case Kind::kList: {
      if (a.list->size() != b.list->size()) return false;
      for (std::size_t k = 0; k < a.list->size(); ++k)
        if (!equals((*a.list)[k], (*b.list)[k])) return false;
      return true;
    }
    case Kind::kDict: {
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (auto& [k, v] : a.dict->items) {
        const Value* o = b.dict->find(k);
        if (!o || !equals(v, *o)) return false;
      }
      return true;
    }
    case Kind::kFunction: return a.fn == b.fn;
    default: return false;
  }
}

bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::kFloat || b.kind == Kind::kFloat) return a.as_double() < b.as_double();
    return a.as_int() < b.as_int();
  }
  if (a.is_string() && b.is_string()) return a.s < b.s;  // UTF-8 bytes order as code points
  if (a.is_list() && b.is_list()) {
    std::size_t n = std::min(a.list->size(), b.list->size());
    for (std::size_t k = 0; k < n; ++k) {
      if (equals((*a.list)[k], (*b.list)[k])) continue;
      return less((*a.list)[k], (*b.list)[k]);
    }
    return a.list->size() < b.list->size();
  }
  throw std::invalid_argument("'<' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) +
                              "'");
}

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "NoneType";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return "str";
    case Kind::kList: return v.tuple ? "tuple" : "list";
    case Kind::kDict: return v.namespace_ ? "Namespace" : "dict";
    case Kind::kFunction: return "function";
  }
  return "object";
}

std::string to_json(const Value& v, bool ensure_ascii, std::optional<std::string> indent,
                    std::optional<std::pair<std::string, std::string>> separators, bool sort_keys) {
  std::string item_sep = indent ? "," : ", ", key_sep = ": ";
  if (separators) std::tie(item_sep, key_sep) = *separators;
  std::string out;
  dump(out, v, ensure_ascii, indent, item_sep, key_sep, sort_keys, 0);
  return out;
}

std::vector<std::size_t> code_point_starts(const std::string& s) {
  std::vector<std::size_t> starts;
  starts.reserve(s.size() + 1);
  for (std::size_t k = 0; k < s.size(); ++k)
    if ((static_cast<unsigned char>(s[k]) & 0xC0) != 0x80) starts.push_back(k);
  starts.push_back(s.size());
  return starts;
}

}  // namespace wick::jinja::detail
