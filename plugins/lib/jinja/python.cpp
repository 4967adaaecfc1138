#include "lib/jinja/python.hpp"

#include <algorithm>

#include "lib/jinja/builtins.hpp"
#include "lib/jinja/text.hpp"

namespace wick::jinja::detail {

void check_defined(const Value& v) {
  if (v.is_undefined()) error(v.s);
}

// jinja2's object_type_repr: "None", "dict object", ...
std::string object_type(const Value& v) {
  if (v.is_none()) return "None";
  return type_name(v) + " object";
}

bool number_kind_of(const Value& v) { return v.kind == Kind::kInt || v.kind == Kind::kFloat || v.kind == Kind::kBool; }

Value missing_attr(const Value& obj, const std::string& name) {
  return Value::undefined("'" + object_type(obj) + "' has no attribute '" + name + "'");
}

std::string strip(const std::string& s, const std::optional<Value>& chars, bool left, bool right) {
  if (chars && !chars->is_none()) {
    if (!chars->is_string()) error("strip arg must be None or str");
    return detail::strip(s, &chars->s, left, right);
  }
  return detail::strip(s, nullptr, left, right);
}

std::string upper(const std::string& s) { return to_upper(s); }
std::string lower(const std::string& s) { return to_lower(s); }

std::string replace(const std::string& s, const std::string& from, const std::string& to, std::int64_t count) {
  std::string out;
  if (from.empty()) {
    // Python inserts `to` between every character (and at both ends)
    auto starts = code_point_starts(s);
    for (std::size_t k = 0; k + 1 < starts.size(); ++k) {
      if (count >= 0 && std::int64_t(k) >= count) {
        out += s.substr(starts[k]);
        return out;
      }
      out += to + s.substr(starts[k], starts[k + 1] - starts[k]);
    }
    if (count < 0 || std::int64_t(starts.size() - 1) < count) out += to;
    return out;
  }
  std::size_t pos = 0;
  std::int64_t n = 0;
  while (true) {
    std::size_t f = s.find(from, pos);
    if (f == std::string::npos || (count >= 0 && n >= count)) break;
    out += s.substr(pos, f - pos) + to;
    pos = f + from.size();
    ++n;
  }
  return out + s.substr(pos);
}

List split(const std::string& s, const std::optional<Value>& sep, std::int64_t maxsplit) {
  List out;
  if (!sep || sep->is_none()) {
    auto cps = decode(s);
    std::size_t k = 0;
    while (true) {
      while (k < cps.size() && is_space(cps[k])) ++k;
      if (k >= cps.size()) break;
      if (maxsplit >= 0 && std::int64_t(out.size()) >= maxsplit) {
        std::size_t e = cps.size();
        while (e > k && is_space(cps[e - 1])) --e;
        out.push_back(Value::string(encode({cps.begin() + k, cps.begin() + e})));
        break;
      }
      std::size_t j = k;
      while (j < cps.size() && !is_space(cps[j])) ++j;
      out.push_back(Value::string(encode({cps.begin() + k, cps.begin() + j})));
      k = j;
    }
    return out;
  }
  if (!sep->is_string()) error("must be str or None, not " + type_name(*sep));
  if (sep->s.empty()) error("empty separator");
  std::size_t pos = 0;
  while (true) {
    std::size_t f = s.find(sep->s, pos);
    if (f == std::string::npos || (maxsplit >= 0 && std::int64_t(out.size()) >= maxsplit)) break;
    out.push_back(Value::string(s.substr(pos, f - pos)));
    pos = f + sep->s.size();
  }
  out.push_back(Value::string(s.substr(pos)));
  return out;
}

std::int64_t int_arg(const std::optional<Value>& v, std::int64_t fallback) {
  if (!v || v->is_none()) return fallback;
  if (v->kind != Kind::kInt && v->kind != Kind::kBool) error("an integer is required, not " + type_name(*v));
  return v->as_int();
}

std::string str_arg(const std::optional<Value>& v, const std::string& what) {
  if (!v) error("missing required argument '" + what + "'");
  if (!v->is_string()) error("must be str, not " + type_name(*v));
  return v->s;
}

bool affix(const std::string& s, const Value& x, bool start) {
  auto one = [&](const Value& p) {
    if (!p.is_string()) error(std::string(start ? "startswith" : "endswith") + " first arg must be str or a tuple of str, not " + type_name(p));
    if (p.s.size() > s.size()) return false;
    return start ? s.compare(0, p.s.size(), p.s) == 0 : s.compare(s.size() - p.s.size(), p.s.size(), p.s) == 0;
  };
  if (x.is_list()) {
    for (auto& p : *x.list)
      if (one(p)) return true;
    return false;
  }
  return one(x);
}



std::int64_t length(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return 0;
    case Kind::kString: return code_point_starts(v.s).size() - 1;
    case Kind::kList: return v.list->size();
    case Kind::kDict: return v.dict->items.size();
    default: error("object of type '" + type_name(v) + "' has no len()");
  }
}

List to_list(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined: return {};
    case Kind::kList: return *v.list;
    case Kind::kDict: {
      List keys;
      for (auto& kv : v.dict->items) keys.push_back(kv.first);
      return keys;
    }
    case Kind::kString: {
      List out;
      auto starts = code_point_starts(v.s);
      for (std::size_t k = 0; k + 1 < starts.size(); ++k)
        out.push_back(Value::string(v.s.substr(starts[k], starts[k + 1] - starts[k])));
      return out;
    }
    default: error("'" + type_name(v) + "' object is not iterable");
  }
}

// `a.b.0` as jinja2's make_attrgetter reads it (items first, ints as indices).
Value attr_path(const Value& v, const Value& attribute) {
  if (!attribute.is_string()) return get_item(v, attribute);
  Value cur = v;
  std::size_t pos = 0;
  const std::string& path = attribute.s;
  while (true) {
    std::size_t dot = path.find('.', pos);
    std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return std::isdigit((unsigned char)c); });
    cur = get_item(cur, digits ? Value::integer(std::stoll(part)) : Value::string(part));
    if (dot == std::string::npos) return cur;
    pos = dot + 1;
  }
}

}  // namespace wick::jinja::detail
