#include "lib/jinja/builtins.hpp"

#include "lib/jinja/text.hpp"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <stdexcept>

namespace wick::jinja::detail {

std::string percent_format(const std::string& fmt, const Value& values);

namespace {

[[noreturn]] void error(const std::string& message) { throw std::runtime_error(message); }

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

std::string py_title(const std::string& s) { return title(s); }

Value string_method(const std::string& s, const std::string& name) {
  auto m = [](auto f) { return Value::function(f); };
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    bool l = name != "rstrip", r = name != "lstrip";
    return m([s, l, r](Args& a) { return Value::string(strip(s, a.take(0, "chars"), l, r)); });
  }
  if (name == "upper") return m([s](Args&) { return Value::string(upper(s)); });
  if (name == "lower") return m([s](Args&) { return Value::string(lower(s)); });
  if (name == "title") return m([s](Args&) { return Value::string(py_title(s)); });
  if (name == "capitalize") return m([s](Args&) { return Value::string(capitalize(s)); });
  if (name == "startswith" || name == "endswith") {
    bool start = name == "startswith";
    return m([s, start](Args& a) {
      auto p = a.take(0, "prefix");
      if (!p) error("startswith() takes at least 1 argument (0 given)");
      return Value::boolean(affix(s, *p, start));
    });
  }
  if (name == "split")
    return m([s](Args& a) {
      auto sep = a.take(0, "sep");
      return Value::of_list(split(s, sep, int_arg(a.take(1, "maxsplit"), -1)));
    });
  if (name == "rsplit")
    return m([s](Args& a) {
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
    });
  if (name == "splitlines")
    return m([s](Args&) {
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
    });
  if (name == "replace")
    return m([s](Args& a) {
      std::string from = str_arg(a.take(0, "old"), "old"), to = str_arg(a.take(1, "new"), "new");
      return Value::string(replace(s, from, to, int_arg(a.take(2, "count"), -1)));
    });
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex")
    return m([s, name](Args& a) {
      std::string sub = str_arg(a.take(0, "sub"), "sub");
      std::size_t f = name[0] == 'r' ? s.rfind(sub) : s.find(sub);
      if (f == std::string::npos) {
        if (name.find("index") != std::string::npos) error("substring not found");
        return Value::integer(-1);
      }
      auto starts = code_point_starts(s);
      return Value::integer(std::lower_bound(starts.begin(), starts.end(), f) - starts.begin());
    });
  if (name == "count")
    return m([s](Args& a) {
      std::string sub = str_arg(a.take(0, "sub"), "sub");
      if (sub.empty()) return Value::integer(code_point_starts(s).size());
      std::int64_t n = 0;
      for (std::size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
      return Value::integer(n);
    });
  if (name == "join")
    return m([s](Args& a) {
      auto items = a.take(0, "iterable");
      std::string out;
      if (items && items->is_list())
        for (std::size_t k = 0; k < items->list->size(); ++k) {
          const Value& v = (*items->list)[k];
          if (!v.is_string()) error("sequence item " + std::to_string(k) + ": expected str instance, " + type_name(v) + " found");
          out += (k ? s : "") + v.s;
        }
      return Value::string(out);
    });
  if (name == "format")
    return m([s](Args& a) {
      // str.format with {}, {0} and {name} fields, !s and !r, and {{ }}; no format specs
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
        const Value* v = nullptr;
        if (field.empty() || std::all_of(field.begin(), field.end(), [](char d) { return std::isdigit((unsigned char)d); })) {
          std::size_t index = field.empty() ? auto_index++ : std::stoul(field);
          if (index >= a.positional.size()) error("Replacement index " + std::to_string(index) + " out of range for positional args tuple");
          v = &a.positional[index];
        } else {
          for (auto& [key, x] : a.keyword)
            if (key == field) v = &x;
          if (!v) error("'" + field + "'");
        }
        out += conversion == 'r' ? repr(*v) : str(*v);
      }
      return Value::string(out);
    });
  auto all_of = [&](auto pred) {
    return m([s, pred](Args&) {
      auto cps = decode(s);
      if (cps.empty()) return Value::boolean(false);
      for (char32_t c : cps)
        if (!pred(c)) return Value::boolean(false);
      return Value::boolean(true);
    });
  };
  auto digit = [](char32_t c) { return c >= '0' && c <= '9'; };
  if (name == "isdigit" || name == "isnumeric" || name == "isdecimal") return all_of(digit);
  if (name == "isalpha") return all_of([](char32_t c) { return is_alpha(c); });
  if (name == "isalnum") return all_of([digit](char32_t c) { return is_alpha(c) || digit(c); });
  if (name == "isspace") return all_of([](char32_t c) { return is_space(c); });
  if (name == "islower")
    return m([s](Args&) { return Value::boolean(lower(s) == s && upper(s) != s); });
  if (name == "isupper")
    return m([s](Args&) { return Value::boolean(upper(s) == s && lower(s) != s); });
  return Value::undefined("'str object' has no attribute '" + name + "'");
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

std::int64_t py_floordiv(std::int64_t a, std::int64_t b) {
  std::int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

Value string_index(const std::string& s, std::int64_t i) {
  auto starts = code_point_starts(s);
  std::int64_t n = starts.size() - 1;
  if (i < 0) i += n;
  if (i < 0 || i >= n) return Value::undefined("'str object' has no element " + std::to_string(i));
  return Value::string(s.substr(starts[i], starts[i + 1] - starts[i]));
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
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

Value to_int(const Value& v, const Value& fallback, std::int64_t base) {
  switch (v.kind) {
    case Kind::kInt: return v;
    case Kind::kBool: return Value::integer(v.b);
    case Kind::kFloat: return std::isfinite(v.f) ? Value::integer(std::int64_t(v.f)) : fallback;
    case Kind::kString: {
      std::string s = strip(v.s, std::nullopt, true, true);
      std::string digits;
      for (char c : s)
        if (c != '_') digits += c;
      if (digits.empty()) return fallback;
      char* end = nullptr;
      errno = 0;
      long long x = std::strtoll(digits.c_str(), &end, int(base));
      if (*end == 0 && errno == 0) return Value::integer(x);
      double d = std::strtod(digits.c_str(), &end);
      if (*end == 0 && std::isfinite(d)) return Value::integer(std::int64_t(d));
      return fallback;
    }
    default: return fallback;
  }
}

std::unordered_map<std::string, FilterFn> make_filters() {
  std::unordered_map<std::string, FilterFn> f;
  f["trim"] = [](const Value& v, Args& a, const Callbacks&) {
    return Value::string(strip(str(v), a.take(0, "chars"), true, true));
  };
  f["length"] = [](const Value& v, Args&, const Callbacks&) { return Value::integer(length(v)); };
  f["count"] = f["length"];
  f["upper"] = [](const Value& v, Args&, const Callbacks&) { return Value::string(upper(str(v))); };
  f["lower"] = [](const Value& v, Args&, const Callbacks&) { return Value::string(lower(str(v))); };
  f["capitalize"] = [](const Value& v, Args&, const Callbacks&) { return Value::string(capitalize(str(v))); };
  f["title"] = [](const Value& v, Args&, const Callbacks&) {
    // jinja2 splits on runs of "-", whitespace and ({[< and capitalizes each piece
    auto cps = decode(str(v));
    std::string out;
    std::size_t k = 0;
    auto sep = [](char32_t c) { return c == '-' || is_space(c) || c == '(' || c == '{' || c == '[' || c == '<'; };
    while (k < cps.size()) {
      std::size_t j = k;
      bool is_sep = sep(cps[k]);
      while (j < cps.size() && sep(cps[j]) == is_sep) ++j;
      std::string piece = encode({cps.begin() + k, cps.begin() + j});
      // jinja2: item[0].upper() + item[1:].lower()
      out += is_sep ? piece : to_upper(encode({cps[k]})) + to_lower(encode({cps.begin() + k + 1, cps.begin() + j}));
      k = j;
    }
    return Value::string(out);
  };
  f["default"] = [](const Value& v, Args& a, const Callbacks&) {
    auto d = a.take(0, "default_value");
    auto boolean = a.take(1, "boolean");
    if (v.is_undefined() || (boolean && truthy(*boolean) && !truthy(v))) return d ? *d : Value::string("");
    return v;
  };
  f["d"] = f["default"];
  f["first"] = [](const Value& v, Args&, const Callbacks&) {
    List l = to_list(v);
    return l.empty() ? Value::undefined("No first item, sequence was empty.") : l.front();
  };
  f["last"] = [](const Value& v, Args&, const Callbacks&) {
    List l = to_list(v);
    return l.empty() ? Value::undefined("No last item, sequence was empty.") : l.back();
  };
  f["join"] = [](const Value& v, Args& a, const Callbacks&) {
    auto d = a.take(0, "d");
    auto attribute = a.take(1, "attribute");
    std::string sep = d ? str(*d) : "";
    std::string out;
    List l = to_list(v);
    for (std::size_t k = 0; k < l.size(); ++k) out += (k ? sep : "") + str(attribute ? attr_path(l[k], *attribute) : l[k]);
    return Value::string(out);
  };
  f["list"] = [](const Value& v, Args&, const Callbacks&) { return Value::of_list(to_list(v)); };
  f["items"] = [](const Value& v, Args&, const Callbacks&) {
    List out;
    if (v.is_undefined()) return Value::of_list(out);
    if (!v.is_dict()) error("Can only get item pairs from a mapping.");
    for (auto& [k, x] : v.dict->items) out.push_back(Value::of_list({k, x}, true));
    return Value::of_list(out);
  };
  f["string"] = [](const Value& v, Args&, const Callbacks&) { return Value::string(str(v)); };
  f["int"] = [](const Value& v, Args& a, const Callbacks&) {
    auto d = a.take(0, "default");
    return to_int(v, d ? *d : Value::integer(0), int_arg(a.take(1, "base"), 10));
  };
  f["float"] = [](const Value& v, Args& a, const Callbacks&) {
    auto d = a.take(0, "default");
    Value fallback = d ? *d : Value::real(0);
    if (v.is_number()) return Value::real(v.as_double());
    if (v.is_string()) {
      std::string s = strip(v.s, std::nullopt, true, true);
      char* end = nullptr;
      double x = std::strtod(s.c_str(), &end);
      if (!s.empty() && *end == 0) return Value::real(x);
    }
    return fallback;
  };
  f["abs"] = [](const Value& v, Args&, const Callbacks&) {
    if (v.kind == Kind::kFloat) return Value::real(std::fabs(v.f));
    if (v.is_number()) return Value::integer(std::llabs(v.as_int()));
    error("bad operand type for abs(): '" + type_name(v) + "'");
  };
  f["round"] = [](const Value& v, Args& a, const Callbacks&) {
    std::int64_t precision = int_arg(a.take(0, "precision"), 0);
    auto method = a.take(1, "method");
    std::string how = method ? str(*method) : "common";
    double x = v.as_double(), scale = std::pow(10.0, double(precision));
    double r = how == "ceil" ? std::ceil(x * scale) / scale : how == "floor" ? std::floor(x * scale) / scale
                                                                                : std::nearbyint(x * scale) / scale;
    return Value::real(r);
  };
  f["replace"] = [](const Value& v, Args& a, const Callbacks&) {
    auto old = a.take(0, "old"), neu = a.take(1, "new");
    if (!old || !neu) error("replace() missing required arguments");
    return Value::string(replace(str(v), str(*old), str(*neu), int_arg(a.take(2, "count"), -1)));
  };
  f["tojson"] = [](const Value& v, Args& a, const Callbacks&) {
    auto ensure_ascii = a.take(0, "ensure_ascii");
    auto indent = a.take(1, "indent");
    auto separators = a.take(2, "separators");
    auto sort_keys = a.take(3, "sort_keys");
    std::optional<std::string> ind;
    if (indent && !indent->is_none()) {
      if (indent->is_string()) ind = indent->s;
      else ind = std::string(std::max<std::int64_t>(0, indent->as_int()), ' ');
    }
    std::optional<std::pair<std::string, std::string>> seps;
    if (separators && separators->is_list() && separators->list->size() == 2)
      seps = std::make_pair(str((*separators->list)[0]), str((*separators->list)[1]));
    return Value::string(to_json(v, ensure_ascii && truthy(*ensure_ascii), ind, seps, sort_keys && truthy(*sort_keys)));
  };
  f["safe"] = [](const Value& v, Args&, const Callbacks&) { return v; };
  f["format"] = [](const Value& v, Args& a, const Callbacks&) {
    if (!a.keyword.empty()) {
      Dict d;
      for (auto& [k, x] : a.keyword) d.set(Value::string(k), x);
      return Value::string(percent_format(str(v), Value::of_dict(std::move(d))));
    }
    return Value::string(percent_format(str(v), Value::of_list(a.positional, /*tuple=*/true)));
  };
  f["escape"] = [](const Value& v, Args&, const Callbacks&) { return Value::string(html_escape(str(v))); };
  f["e"] = f["escape"];
  f["reverse"] = [](const Value& v, Args&, const Callbacks&) {
    List l = to_list(v);
    std::reverse(l.begin(), l.end());
    if (v.is_string()) {
      std::string s;
      for (auto& c : l) s += c.s;
      return Value::string(s);
    }
    return Value::of_list(l);
  };
  f["unique"] = [](const Value& v, Args&, const Callbacks&) {
    List out;
    for (auto& x : to_list(v))
      if (std::none_of(out.begin(), out.end(), [&](const Value& y) { return equals(x, y); })) out.push_back(x);
    return Value::of_list(out);
  };
  f["sum"] = [](const Value& v, Args& a, const Callbacks&) {
    auto attribute = a.take(0, "attribute");
    auto start = a.take(1, "start");
    Value total = start ? *start : Value::integer(0);
    for (auto& x : to_list(v)) total = binary("+", total, attribute ? attr_path(x, *attribute) : x);
    return total;
  };
  auto extreme = [](bool want_max) {
    return [want_max](const Value& v, Args& a, const Callbacks&) {
      auto attribute = a.take(1, "attribute");
      List l = to_list(v);
      if (l.empty()) return Value::undefined("No aggregated item, sequence was empty.");
      Value best = l[0];
      for (auto& x : l) {
        Value kx = attribute ? attr_path(x, *attribute) : x, kb = attribute ? attr_path(best, *attribute) : best;
        if (want_max ? less(kb, kx) : less(kx, kb)) best = x;
      }
      return best;
    };
  };
  f["max"] = extreme(true);
  f["min"] = extreme(false);
  f["sort"] = [](const Value& v, Args& a, const Callbacks&) {
    auto rev = a.take(0, "reverse");
    a.take(1, "case_sensitive");
    auto attribute = a.take(2, "attribute");
    List l = to_list(v);
    std::stable_sort(l.begin(), l.end(), [&](const Value& x, const Value& y) {
      Value kx = attribute ? attr_path(x, *attribute) : x, ky = attribute ? attr_path(y, *attribute) : y;
      if (kx.is_string() && ky.is_string()) return lower(kx.s) < lower(ky.s);
      return less(kx, ky);
    });
    if (rev && truthy(*rev)) std::reverse(l.begin(), l.end());
    return Value::of_list(l);
  };
  auto select = [](bool attr, bool keep) {
    return [attr, keep](const Value& v, Args& a, const Callbacks& cb) {
      std::optional<Value> attribute;
      std::size_t next = 0;
      if (attr) attribute = a.positional.size() > next ? a.positional[next++] : Value();
      std::optional<Value> test = a.positional.size() > next ? std::optional<Value>(a.positional[next++]) : std::nullopt;
      Args rest;
      for (std::size_t k = next; k < a.positional.size(); ++k) rest.positional.push_back(a.positional[k]);
      rest.keyword = a.keyword;
      List out;
      for (auto& x : to_list(v)) {
        Value item = attribute ? attr_path(x, *attribute) : x;
        Args r = rest;
        bool ok = test ? cb.test(str(*test), item, r) : truthy(item);
        if (ok == keep) out.push_back(x);
      }
      return Value::of_list(out);
    };
  };
  f["select"] = select(false, true);
  f["reject"] = select(false, false);
  f["selectattr"] = select(true, true);
  f["rejectattr"] = select(true, false);
  f["map"] = [](const Value& v, Args& a, const Callbacks& cb) {
    List out;
    auto attribute = a.take(99, "attribute");
    if (attribute) {
      auto d = a.take(99, "default");
      for (auto& x : to_list(v)) {
        Value r = attr_path(x, *attribute);
        out.push_back(r.is_undefined() && d ? *d : r);
      }
      return Value::of_list(out);
    }
    if (a.positional.empty()) error("map requires a filter argument");
    std::string name = str(a.positional[0]);
    Args rest;
    for (std::size_t k = 1; k < a.positional.size(); ++k) rest.positional.push_back(a.positional[k]);
    rest.keyword = a.keyword;
    for (auto& x : to_list(v)) {
      Args r = rest;
      out.push_back(cb.filter(name, x, r));
    }
    return Value::of_list(out);
  };
  f["attr"] = [](const Value& v, Args& a, const Callbacks&) {
    auto name = a.take(0, "name");
    return get_attr(v, name ? str(*name) : "");
  };
  f["indent"] = [](const Value& v, Args& a, const Callbacks&) {
    auto width = a.take(0, "width");
    bool first = truthy(a.take(1, "first").value_or(Value::boolean(false)));
    bool blank = truthy(a.take(2, "blank").value_or(Value::boolean(false)));
    std::string pad = width && width->is_string() ? width->s : std::string(width ? width->as_int() : 4, ' ');
    std::string s = str(v) + "";
    // jinja2: splitlines, indent non-blank lines (all with blank=True), keep the first unless first=True
    std::vector<std::string> lines;
    std::size_t pos = 0;
    while (true) {
      std::size_t nl = s.find('\n', pos);
      lines.push_back(s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos));
      if (nl == std::string::npos) break;
      pos = nl + 1;
    }
    bool trailing = !s.empty() && s.back() == '\n';
    if (trailing) lines.pop_back();
    std::string out;
    for (std::size_t k = 0; k < lines.size(); ++k) {
      if (k) out += "\n";
      bool add = k == 0 ? first : (blank || !lines[k].empty());
      if (k == 0 && first && !blank && lines[k].empty()) add = false;
      out += (add ? pad : "") + lines[k];
    }
    if (trailing) out += "\n";
    return Value::string(out);
  };
  f["wordcount"] = [](const Value& v, Args&, const Callbacks&) {
    return Value::integer(split(str(v), std::nullopt, -1).size());
  };
  f["center"] = [](const Value& v, Args& a, const Callbacks&) {
    std::string s = str(v);
    std::int64_t width = int_arg(a.take(0, "width"), 80), n = length(v);
    if (n >= width) return Value::string(s);
    std::int64_t total = width - n, left = total / 2 + (total & width & 1);
    return Value::string(std::string(left, ' ') + s + std::string(total - left, ' '));
  };
  f["dictsort"] = [](const Value& v, Args& a, const Callbacks&) {
    if (!v.is_dict()) error("You can only sort by either \"key\" or \"value\"");
    auto by = a.take(1, "by");
    bool by_value = by && str(*by) == "value";
    List out;
    for (auto& [k, x] : v.dict->items) out.push_back(Value::of_list({k, x}, true));
    std::stable_sort(out.begin(), out.end(), [&](const Value& p, const Value& q) {
      const Value& x = (*p.list)[by_value], &y = (*q.list)[by_value];
      if (x.is_string() && y.is_string()) return lower(x.s) < lower(y.s);
      return less(x, y);
    });
    return Value::of_list(out);
  };
  return f;
}

bool number_kind(const Value& v) { return v.kind == Kind::kInt || v.kind == Kind::kFloat || v.kind == Kind::kBool; }

std::unordered_map<std::string, TestFn> make_tests() {
  std::unordered_map<std::string, TestFn> t;
  auto arg = [](Args& a) {
    auto v = a.take(0, "other");
    if (!v) error("test requires an argument");
    return *v;
  };
  t["defined"] = [](const Value& v, Args&) { return !v.is_undefined(); };
  t["undefined"] = [](const Value& v, Args&) { return v.is_undefined(); };
  t["none"] = [](const Value& v, Args&) { return v.is_none(); };
  t["boolean"] = [](const Value& v, Args&) { return v.kind == Kind::kBool; };
  t["true"] = [](const Value& v, Args&) { return v.kind == Kind::kBool && v.b; };
  t["false"] = [](const Value& v, Args&) { return v.kind == Kind::kBool && !v.b; };
  t["integer"] = [](const Value& v, Args&) { return v.kind == Kind::kInt; };
  t["float"] = [](const Value& v, Args&) { return v.kind == Kind::kFloat; };
  t["number"] = [](const Value& v, Args&) { return number_kind(v); };
  t["string"] = [](const Value& v, Args&) { return v.is_string(); };
  t["mapping"] = [](const Value& v, Args&) { return v.is_dict() && !v.namespace_; };
  t["iterable"] = [](const Value& v, Args&) { return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined(); };
  t["sequence"] = [](const Value& v, Args&) { return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined(); };
  t["callable"] = [](const Value& v, Args&) { return v.kind == Kind::kFunction; };
  t["lower"] = [](const Value& v, Args&) { std::string s = str(v); return lower(s) == s; };
  t["upper"] = [](const Value& v, Args&) { std::string s = str(v); return upper(s) == s; };
  t["escaped"] = [](const Value&, Args&) { return false; };
  t["even"] = [](const Value& v, Args&) { return v.as_int() % 2 == 0; };
  t["odd"] = [](const Value& v, Args&) { return v.as_int() % 2 != 0; };
  t["divisibleby"] = [arg](const Value& v, Args& a) {
    Value n = arg(a);
    if (n.as_int() == 0) error("integer modulo by zero");
    return v.as_int() % n.as_int() == 0;
  };
  t["sameas"] = [arg](const Value& v, Args& a) {
    Value o = arg(a);
    if (v.kind != o.kind) return false;
    if (v.is_none() || v.kind == Kind::kBool) return equals(v, o);
    if (v.is_list()) return v.list == o.list;
    if (v.is_dict()) return v.dict == o.dict;
    return equals(v, o);
  };
  t["eq"] = [arg](const Value& v, Args& a) { return equals(v, arg(a)); };
  t["ne"] = [arg](const Value& v, Args& a) { return !equals(v, arg(a)); };
  t["lt"] = [arg](const Value& v, Args& a) { return less(v, arg(a)); };
  t["gt"] = [arg](const Value& v, Args& a) { return less(arg(a), v); };
  t["le"] = [arg](const Value& v, Args& a) { return !less(arg(a), v); };
  t["ge"] = [arg](const Value& v, Args& a) { return !less(v, arg(a)); };
  t["in"] = [arg](const Value& v, Args& a) { return compare("in", v, arg(a)); };
  t["equalto"] = t["=="] = t["eq"];
  t["!="] = t["ne"];
  t["lessthan"] = t["<"] = t["lt"];
  t["greaterthan"] = t[">"] = t["gt"];
  t["<="] = t["le"];
  t[">="] = t["ge"];
  return t;
}

}  // namespace

const FilterFn* find_filter(const std::string& name) {
  static const auto filters = make_filters();
  auto it = filters.find(name);
  return it == filters.end() ? nullptr : &it->second;
}

const TestFn* find_test(const std::string& name) {
  static const auto tests = make_tests();
  auto it = tests.find(name);
  return it == tests.end() ? nullptr : &it->second;
}

void add_globals(std::unordered_map<std::string, Value>& frame,
                 const std::function<void(const std::string&, int)>& raise) {
  frame["raise_exception"] = Value::function([raise](Args& a) -> Value {
    auto m = a.take(0, "message");
    raise(m ? str(*m) : "", 0);
    return Value::none();
  });
  frame["range"] = Value::function([](Args& a) {
    std::int64_t start = 0, stop = 0, step = 1;
    if (a.positional.size() == 1) {
      stop = int_arg(a.positional[0], 0);
    } else if (a.positional.size() >= 2) {
      start = int_arg(a.positional[0], 0);
      stop = int_arg(a.positional[1], 0);
      if (a.positional.size() >= 3) step = int_arg(a.positional[2], 1);
    } else {
      error("range expected at least 1 argument, got 0");
    }
    if (step == 0) error("range() arg 3 must not be zero");
    List out;
    for (std::int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
      out.push_back(Value::integer(k));
      if (out.size() > 100000) error("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    }
    return Value::of_list(out);
  });
  frame["namespace"] = Value::function([](Args& a) {
    Value ns = Value::of_dict({});
    ns.namespace_ = true;
    for (auto& p : a.positional)
      if (p.is_dict())
        for (auto& [k, v] : p.dict->items) ns.dict->set(k, v);
    for (auto& [k, v] : a.keyword) {
      if (!k.empty() && k[0] == '_')
        error("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" + k +
              "'. Please rename the attribute.");
      ns.dict->set(Value::string(k), v);
    }
    return ns;
  });
  frame["dict"] = Value::function([](Args& a) {
    Value d = Value::of_dict({});
    for (auto& p : a.positional)
      if (p.is_dict())
        for (auto& [k, v] : p.dict->items) d.dict->set(k, v);
    for (auto& [k, v] : a.keyword) d.dict->set(Value::string(k), v);
    return d;
  });
  frame["strftime_now"] = Value::function([](Args& a) {
    auto fmt = a.take(0, "format");
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[256];
    std::size_t n = std::strftime(buf, sizeof buf, fmt ? str(*fmt).c_str() : "", &tm);
    return Value::string(std::string(buf, n));
  });
}

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

// Python's printf-style `format % values`: %s %r %d %i %f %F %e %x %o %c %%,
// with flags, width and precision.
std::string percent_format(const std::string& fmt, const Value& values) {
  List args = values.is_list() && values.tuple ? *values.list : List{values};
  const Dict* named = values.is_dict() ? values.dict.get() : nullptr;
  std::size_t next = 0;
  std::string out;
  for (std::size_t k = 0; k < fmt.size(); ++k) {
    if (fmt[k] != '%') {
      out += fmt[k];
      continue;
    }
    if (++k >= fmt.size()) error("incomplete format");
    const Value* arg = nullptr;
    if (fmt[k] == '(') {
      std::size_t close = fmt.find(')', k);
      if (close == std::string::npos) error("incomplete format key");
      if (!named) error("format requires a mapping");
      arg = named->find(Value::string(fmt.substr(k + 1, close - k - 1)));
      if (!arg) error("'" + fmt.substr(k + 1, close - k - 1) + "'");
      k = close + 1;
    }
    std::string spec = "%";
    while (k < fmt.size() && std::string("-+ #0").find(fmt[k]) != std::string::npos) spec += fmt[k++];
    while (k < fmt.size() && (std::isdigit((unsigned char)fmt[k]) || fmt[k] == '.')) spec += fmt[k++];
    if (k >= fmt.size()) error("incomplete format");
    char conv = fmt[k];
    if (conv == '%') {
      out += '%';
      continue;
    }
    if (!arg) {
      if (next >= args.size()) error("not enough arguments for format string");
      arg = &args[next++];
    }
    char buf[512];
    switch (conv) {
      case 's':
      case 'r': {
        std::string text = conv == 's' ? str(*arg) : repr(*arg);
        std::snprintf(buf, sizeof buf, (spec + "s").c_str(), text.c_str());
        out += buf;
        break;
      }
      case 'd':
      case 'i':
      case 'x':
      case 'X':
      case 'o': {
        if (!number_kind_of(*arg)) error("%" + std::string(1, conv) + " format: a real number is required, not " + type_name(*arg));
        long long x = arg->kind == Kind::kFloat ? (long long)arg->f : arg->as_int();
        std::snprintf(buf, sizeof buf, (spec + "ll" + (conv == 'i' ? 'd' : conv)).c_str(), x);
        out += buf;
        break;
      }
      case 'f':
      case 'F':
      case 'e':
      case 'E':
      case 'g':
      case 'G':
        if (!number_kind_of(*arg)) error("must be real number, not " + type_name(*arg));
        std::snprintf(buf, sizeof buf, (spec + conv).c_str(), arg->as_double());
        out += buf;
        break;
      case 'c': out += arg->is_string() ? arg->s : std::string(1, char(arg->as_int())); break;
      default: error(std::string("unsupported format character '") + conv + "'");
    }
  }
  if (!named && next < args.size()) error("not all arguments converted during string formatting");
  return out;
}

Value binary(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return Value::string(str(a) + str(b));
  check_defined(a);
  check_defined(b);
  auto unsupported = [&]() -> Value {
    error("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
  };
  bool nums = number_kind(a) && number_kind(b);
  bool floats = nums && (a.kind == Kind::kFloat || b.kind == Kind::kFloat);
  if (op == "+") {
    if (nums) return floats ? Value::real(a.as_double() + b.as_double()) : Value::integer(a.as_int() + b.as_int());
    if (a.is_string() && b.is_string()) return Value::string(a.s + b.s);
    if (a.is_list() && b.is_list()) {
      List l = *a.list;
      l.insert(l.end(), b.list->begin(), b.list->end());
      return Value::of_list(l, a.tuple);
    }
    if (a.is_string()) error("can only concatenate str (not \"" + type_name(b) + "\") to str");
    if (a.is_list()) error("can only concatenate list (not \"" + type_name(b) + "\") to list");
    return unsupported();
  }
  if (op == "-") {
    if (nums) return floats ? Value::real(a.as_double() - b.as_double()) : Value::integer(a.as_int() - b.as_int());
    return unsupported();
  }
  if (op == "*") {
    if (nums) return floats ? Value::real(a.as_double() * b.as_double()) : Value::integer(a.as_int() * b.as_int());
    const Value* seq = a.is_string() || a.is_list() ? &a : b.is_string() || b.is_list() ? &b : nullptr;
    const Value* count = seq == &a ? &b : &a;
    if (seq && (count->kind == Kind::kInt || count->kind == Kind::kBool)) {
      std::int64_t n = std::max<std::int64_t>(0, count->as_int());
      if (seq->is_string()) {
        std::string s;
        for (std::int64_t k = 0; k < n; ++k) s += seq->s;
        return Value::string(s);
      }
      List l;
      for (std::int64_t k = 0; k < n; ++k) l.insert(l.end(), seq->list->begin(), seq->list->end());
      return Value::of_list(l);
    }
    return unsupported();
  }
  if (op == "/") {
    if (!nums) return unsupported();
    if (b.as_double() == 0) error("division by zero");
    return Value::real(a.as_double() / b.as_double());
  }
  if (op == "//") {
    if (!nums) return unsupported();
    if (b.as_double() == 0) error("integer division or modulo by zero");
    if (floats) return Value::real(std::floor(a.as_double() / b.as_double()));
    return Value::integer(py_floordiv(a.as_int(), b.as_int()));
  }
  if (op == "%") {
    if (a.is_string()) return Value::string(percent_format(a.s, b));
    if (!nums) return unsupported();
    if (b.as_double() == 0) error("integer division or modulo by zero");
    if (floats) {
      double m = std::fmod(a.as_double(), b.as_double());
      if (m != 0 && ((m < 0) != (b.as_double() < 0))) m += b.as_double();
      return Value::real(m);
    }
    return Value::integer(a.as_int() - py_floordiv(a.as_int(), b.as_int()) * b.as_int());
  }
  if (op == "**") {
    if (!nums) return unsupported();
    if (!floats && b.as_int() >= 0) {
      std::int64_t r = 1;
      for (std::int64_t k = 0; k < b.as_int(); ++k) r *= a.as_int();
      return Value::integer(r);
    }
    return Value::real(std::pow(a.as_double(), b.as_double()));
  }
  return unsupported();
}

bool compare(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return equals(a, b);
  if (op == "!=") return !equals(a, b);
  if (op == "in" || op == "notin") {
    bool found = false;
    switch (b.kind) {
      case Kind::kUndefined: found = false; break;
      case Kind::kString:
        if (!a.is_string()) error("'in <string>' requires string as left operand, not " + type_name(a));
        found = b.s.find(a.s) != std::string::npos;
        break;
      case Kind::kList:
        found = std::any_of(b.list->begin(), b.list->end(), [&](const Value& x) { return equals(x, a); });
        break;
      case Kind::kDict: found = b.dict->find(a) != nullptr; break;
      default: error("argument of type '" + type_name(b) + "' is not iterable");
    }
    return op == "in" ? found : !found;
  }
  check_defined(a);
  check_defined(b);
  auto bad = [&]() {
    error("'" + op + "' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
  };
  bool comparable = (number_kind(a) && number_kind(b)) || (a.is_string() && b.is_string()) || (a.is_list() && b.is_list());
  if (!comparable) bad();
  if (op == "<") return less(a, b);
  if (op == ">") return less(b, a);
  if (op == "<=") return !less(b, a);
  if (op == ">=") return !less(a, b);
  bad();
  return false;
}

}  // namespace wick::jinja::detail
