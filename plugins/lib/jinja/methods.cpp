// Attribute and item lookup with jinja2's Undefined and the immutable
// sandbox, the Python methods of str, dict and list, and slicing.
#include <algorithm>

#include "lib/jinja/builtins.hpp"
#include "lib/jinja/python.hpp"
#include "lib/jinja/text.hpp"

namespace wick::jinja::detail {
namespace {

// The methods of str: each called with the string, the method's name (one
// function serves strip, lstrip and rstrip, ...) and the call's arguments.
using StringMethod = Value (*)(const std::string& s, const std::string& name, Args& a);

Value str_strip(const std::string& s, const std::string& name, Args& a) {
  return Value::string(strip(s, a.take(0, "chars"), name != "rstrip", name != "lstrip"));
}
Value str_upper(const std::string& s, const std::string&, Args&) { return Value::string(upper(s)); }
Value str_lower(const std::string& s, const std::string&, Args&) { return Value::string(lower(s)); }
Value str_title(const std::string& s, const std::string&, Args&) { return Value::string(title(s)); }
Value str_capitalize(const std::string& s, const std::string&, Args&) { return Value::string(capitalize(s)); }

Value str_startswith(const std::string& s, const std::string& name, Args& a) {
  auto p = a.take(0, "prefix");
  if (!p) error("startswith() takes at least 1 argument (0 given)");
  return Value::boolean(affix(s, *p, name == "startswith"));
}

Value str_split(const std::string& s, const std::string&, Args& a) {
  auto sep = a.take(0, "sep");
  return Value::of_list(split(s, sep, int_arg(a.take(1, "maxsplit"), -1)));
}

Value str_rsplit(const std::string& s, const std::string&, Args& a) {
  auto sep = a.take(0, "sep");
  std::int64_t maxsplit = int_arg(a.take(1, "maxsplit"), -1);
  List all = split(s, sep, -1);
  if (maxsplit < 0 || std::int64_t(all.size()) <= maxsplit + 1) return Value::of_list(all);
  // join the leading pieces back
  std::size_t keep = all.size() - maxsplit;
  std::string joiner = sep && sep->is_string() ? sep->s : " ";
  std::string head;
  for (std::size_t k = 0; k < keep; ++k) head += (k ? joiner : "") + all[k].s;
  List out{Value::string(head)};
  for (std::size_t k = keep; k < all.size(); ++k) out.push_back(all[k]);
  return Value::of_list(out);
}

Value str_splitlines(const std::string& s, const std::string&, Args&) {
  List out;
  std::size_t pos = 0;
  while (pos < s.size()) {
    std::size_t f = s.find_first_of("\n\r", pos);
    if (f == std::string::npos) {
      out.push_back(Value::string(s.substr(pos)));
      break;
    }
    out.push_back(Value::string(s.substr(pos, f - pos)));
    pos = f + ((s[f] == '\r' && f + 1 < s.size() && s[f + 1] == '\n') ? 2 : 1);
  }
  return Value::of_list(out);
}

Value str_replace(const std::string& s, const std::string&, Args& a) {
  std::string from = str_arg(a.take(0, "old"), "old"), to = str_arg(a.take(1, "new"), "new");
  return Value::string(replace(s, from, to, int_arg(a.take(2, "count"), -1)));
}

// find, rfind, index and rindex: a code point index
Value str_find(const std::string& s, const std::string& name, Args& a) {
  std::string sub = str_arg(a.take(0, "sub"), "sub");
  std::size_t f = name[0] == 'r' ? s.rfind(sub) : s.find(sub);
  if (f == std::string::npos) {
    if (name.find("index") != std::string::npos) error("substring not found");
    return Value::integer(-1);
  }
  auto starts = code_point_starts(s);
  return Value::integer(std::lower_bound(starts.begin(), starts.end(), f) - starts.begin());
}

Value str_count(const std::string& s, const std::string&, Args& a) {
  std::string sub = str_arg(a.take(0, "sub"), "sub");
  if (sub.empty()) return Value::integer(code_point_starts(s).size());
  std::int64_t n = 0;
  for (std::size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
  return Value::integer(n);
}

Value str_join(const std::string& s, const std::string&, Args& a) {
  auto items = a.take(0, "iterable");
  std::string out;
  if (items && items->is_list())
    for (std::size_t k = 0; k < items->list->size(); ++k) {
      const Value& v = (*items->list)[k];
      if (!v.is_string()) error("sequence item " + std::to_string(k) + ": expected str instance, " + type_name(v) + " found");
      out += (k ? s : "") + v.s;
    }
  return Value::string(out);
}

// str.format's replacement field `field` (an index, empty for the next one,
// or a keyword's name)
const Value& format_argument(const std::string& field, std::size_t& auto_index, const Args& a) {
  if (field.empty() || std::all_of(field.begin(), field.end(), [](char d) { return std::isdigit((unsigned char)d); })) {
    std::size_t index = field.empty() ? auto_index++ : std::stoul(field);
    if (index >= a.positional.size()) error("Replacement index " + std::to_string(index) + " out of range for positional args tuple");
    return a.positional[index];
  }
  const Value* v = nullptr;
  for (auto& [key, x] : a.keyword)
    if (key == field) v = &x;
  if (!v) error("'" + field + "'");
  return *v;
}

// str.format with {}, {0} and {name} fields, !s and !r, and {{ }}; no format specs
Value str_format(const std::string& s, const std::string&, Args& a) {
  std::string out;
  std::size_t auto_index = 0;
  for (std::size_t k = 0; k < s.size(); ++k) {
    char c = s[k];
    if ((c == '{' || c == '}') && k + 1 < s.size() && s[k + 1] == c) {
      out += c;
      ++k;
      continue;
    }
    if (c == '}') error("Single '}' encountered in format string");
    if (c != '{') {
      out += c;
      continue;
    }
    std::size_t close = s.find('}', k);
    if (close == std::string::npos) error("Single '{' encountered in format string");
    std::string field = s.substr(k + 1, close - k - 1);
    k = close;
    char conversion = 's';
    if (auto bang = field.find('!'); bang != std::string::npos) {
      conversion = bang + 1 < field.size() ? field[bang + 1] : 's';
      field.resize(bang);
    }
    if (field.find(':') != std::string::npos) error("format specs are not supported in str.format");
    const Value& v = format_argument(field, auto_index, a);
    out += conversion == 'r' ? repr(v) : str(v);
  }
  return Value::string(out);
}

bool is_digit(char32_t c) { return c >= '0' && c <= '9'; }
bool is_alnum(char32_t c) { return is_alpha(c) || is_digit(c); }

// isdigit, isalpha, ...: a nonempty string all of whose code points pass
template <bool (*pred)(char32_t)>
Value str_all_of(const std::string& s, const std::string&, Args&) {
  auto cps = decode(s);
  if (cps.empty()) return Value::boolean(false);
  for (char32_t c : cps)
    if (!pred(c)) return Value::boolean(false);
  return Value::boolean(true);
}

Value str_islower(const std::string& s, const std::string&, Args&) { return Value::boolean(lower(s) == s && upper(s) != s); }
Value str_isupper(const std::string& s, const std::string&, Args&) { return Value::boolean(upper(s) == s && lower(s) != s); }

Value string_method(const std::string& s, const std::string& name) {
  static const std::unordered_map<std::string, StringMethod> methods = {
      {"strip", str_strip},
      {"lstrip", str_strip},
      {"rstrip", str_strip},
      {"upper", str_upper},
      {"lower", str_lower},
      {"title", str_title},
      {"capitalize", str_capitalize},
      {"startswith", str_startswith},
      {"endswith", str_startswith},
      {"split", str_split},
      {"rsplit", str_rsplit},
      {"splitlines", str_splitlines},
      {"replace", str_replace},
      {"find", str_find},
      {"rfind", str_find},
      {"index", str_find},
      {"rindex", str_find},
      {"count", str_count},
      {"join", str_join},
      {"format", str_format},
      {"isdigit", str_all_of<is_digit>},
      {"isnumeric", str_all_of<is_digit>},
      {"isdecimal", str_all_of<is_digit>},
      {"isalpha", str_all_of<is_alpha>},
      {"isalnum", str_all_of<is_alnum>},
      {"isspace", str_all_of<is_space>},
      {"islower", str_islower},
      {"isupper", str_isupper},
  };
  auto it = methods.find(name);
  if (it == methods.end()) return Value::undefined("'str object' has no attribute '" + name + "'");
  return Value::function([s, name, method = it->second](Args& a) { return method(s, name, a); });
}

Value dict_method(const Value& d, const std::string& name) {
  if (name == "items")
    return Value::function([d](Args&) {
      List out;
      for (auto& [k, v] : d.dict->items) out.push_back(Value::of_list({k, v}, true));
      return Value::of_list(out);
    });
  if (name == "keys")
    return Value::function([d](Args&) {
      List out;
      for (auto& kv : d.dict->items) out.push_back(kv.first);
      return Value::of_list(out);
    });
  if (name == "values")
    return Value::function([d](Args&) {
      List out;
      for (auto& kv : d.dict->items) out.push_back(kv.second);
      return Value::of_list(out);
    });
  if (name == "get")
    return Value::function([d](Args& a) {
      auto key = a.take(0, "key");
      if (!key) error("get expected at least 1 argument, got 0");
      const Value* v = d.dict->find(*key);
      if (v) return *v;
      auto fallback = a.take(1, "default");
      return fallback ? *fallback : Value::none();
    });
  if (name == "copy") return Value::function([d](Args&) { return Value::of_dict(*d.dict); });
  return Value();  // kind undefined with an empty message: not a method
}

bool is_mutator(const Value& obj, const std::string& name) {
  static const char* kList[] = {"append", "extend", "insert", "pop", "remove", "reverse", "sort", "clear"};
  static const char* kDict[] = {"update", "pop", "popitem", "setdefault", "clear"};
  if (obj.is_list())
    for (auto* n : kList)
      if (name == n) return true;
  if (obj.is_dict())
    for (auto* n : kDict)
      if (name == n) return true;
  return false;
}

Value unsafe(const Value& obj, const std::string& name) {
  return Value::undefined("access to attribute '" + name + "' of '" + type_name(obj) + "' object is unsafe.");
}

Value string_index(const std::string& s, std::int64_t i) {
  auto starts = code_point_starts(s);
  std::int64_t n = starts.size() - 1;
  if (i < 0) i += n;
  if (i < 0 || i >= n) return Value::undefined("'str object' has no element " + std::to_string(i));
  return Value::string(s.substr(starts[i], starts[i + 1] - starts[i]));
}

}  // namespace

Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind) {
    case Kind::kUndefined: error(obj.s);
    case Kind::kDict: {
      if (obj.namespace_) {
        const Value* v = obj.dict->find(Value::string(name));
        return v ? *v : Value::undefined("'Namespace object' has no attribute '" + name + "'");
      }
      if (is_mutator(obj, name)) return unsafe(obj, name);
      Value m = dict_method(obj, name);
      if (m.kind == Kind::kFunction) return m;
      const Value* v = obj.dict->find(Value::string(name));
      return v ? *v : missing_attr(obj, name);
    }
    case Kind::kString: return string_method(obj.s, name);
    case Kind::kList:
      if (is_mutator(obj, name)) return unsafe(obj, name);
      if (name == "index" || name == "count") {
        Value l = obj;
        bool index = name == "index";
        return Value::function([l, index](Args& a) {
          auto x = a.take(0, "value");
          std::int64_t n = 0;
          for (std::size_t k = 0; k < l.list->size(); ++k)
            if (x && equals((*l.list)[k], *x)) {
              if (index) return Value::integer(k);
              ++n;
            }
          if (index) error(repr(x.value_or(Value::none())) + " is not in list");
          return Value::integer(n);
        });
      }
      return missing_attr(obj, name);
    default: return missing_attr(obj, name);
  }
}

Value get_item(const Value& obj, const Value& key) {
  switch (obj.kind) {
    case Kind::kUndefined: error(obj.s);
    case Kind::kDict: {
      const Value* v = obj.dict->find(key);
      if (v) return *v;
      if (key.is_string()) return get_attr(obj, key.s);
      return Value::undefined("'" + object_type(obj) + "' has no element " + repr(key));
    }
    case Kind::kList:
      if (key.kind == Kind::kInt || key.kind == Kind::kBool) {
        std::int64_t i = key.as_int(), n = obj.list->size();
        if (i < 0) i += n;
        if (i < 0 || i >= n) return Value::undefined("'" + object_type(obj) + "' has no element " + repr(key));
        return (*obj.list)[i];
      }
      if (key.is_string()) return get_attr(obj, key.s);
      return Value::undefined("'" + object_type(obj) + "' has no element " + repr(key));
    case Kind::kString:
      if (key.kind == Kind::kInt || key.kind == Kind::kBool) return string_index(obj.s, key.as_int());
      if (key.is_string()) return get_attr(obj, key.s);
      return Value::undefined("'" + object_type(obj) + "' has no element " + repr(key));
    default:
      if (key.is_string()) return get_attr(obj, key.s);
      return Value::undefined("'" + object_type(obj) + "' has no element " + repr(key));
  }
}

Value slice(const Value& obj, const std::optional<Value>& start_v, const std::optional<Value>& stop_v,
            const std::optional<Value>& step_v) {
  check_defined(obj);
  auto get = [](const std::optional<Value>& v) -> std::optional<std::int64_t> {
    if (!v || v->is_none()) return std::nullopt;
    if (v->kind != Kind::kInt && v->kind != Kind::kBool)
      error("slice indices must be integers or None or have an __index__ method");
    return v->as_int();
  };
  std::int64_t step = get(step_v).value_or(1);
  if (step == 0) error("slice step cannot be zero");
  std::vector<std::size_t> starts;
  std::int64_t n;
  if (obj.is_string()) {
    starts = code_point_starts(obj.s);
    n = starts.size() - 1;
  } else if (obj.is_list()) {
    n = obj.list->size();
  } else {
    error("'" + type_name(obj) + "' object is not subscriptable");
  }
  // Python's PySlice_AdjustIndices
  auto adjust = [&](std::optional<std::int64_t> x, std::int64_t dflt) {
    if (!x) return dflt;
    std::int64_t i = *x;
    if (i < 0) {
      i += n;
      if (i < 0) i = step < 0 ? -1 : 0;
    } else if (i >= n) {
      i = step < 0 ? n - 1 : n;
    }
    return i;
  };
  std::int64_t start = adjust(get(start_v), step < 0 ? n - 1 : 0);
  std::int64_t stop = adjust(get(stop_v), step < 0 ? -1 : n);
  std::vector<std::int64_t> idx;
  for (std::int64_t k = start; step > 0 ? k < stop : k > stop; k += step) idx.push_back(k);
  if (obj.is_string()) {
    std::string out;
    for (auto k : idx) out += obj.s.substr(starts[k], starts[k + 1] - starts[k]);
    return Value::string(out);
  }
  List out;
  for (auto k : idx) out.push_back((*obj.list)[k]);
  return Value::of_list(out, obj.tuple);
}

}  // namespace wick::jinja::detail
