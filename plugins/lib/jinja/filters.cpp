// jinja2's filters and tests, with transformers' tojson (json.dumps).
#include <algorithm>
#include <cerrno>
#include <cmath>

#include "lib/jinja/builtins.hpp"
#include "lib/jinja/python.hpp"
#include "lib/jinja/text.hpp"

namespace wick::jinja::detail {
namespace {

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

Value filter_trim(const Value& v, Args& a, const Callbacks&) {
  return Value::string(strip(str(v), a.take(0, "chars"), true, true));
}

Value filter_length(const Value& v, Args&, const Callbacks&) { return Value::integer(length(v)); }

Value filter_upper(const Value& v, Args&, const Callbacks&) { return Value::string(upper(str(v))); }

Value filter_lower(const Value& v, Args&, const Callbacks&) { return Value::string(lower(str(v))); }

Value filter_capitalize(const Value& v, Args&, const Callbacks&) { return Value::string(capitalize(str(v))); }

Value filter_title(const Value& v, Args&, const Callbacks&) {
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
}

Value filter_default(const Value& v, Args& a, const Callbacks&) {
  auto d = a.take(0, "default_value");
  auto boolean = a.take(1, "boolean");
  if (v.is_undefined() || (boolean && truthy(*boolean) && !truthy(v))) return d ? *d : Value::string("");
  return v;
}

Value filter_first(const Value& v, Args&, const Callbacks&) {
  List l = to_list(v);
  return l.empty() ? Value::undefined("No first item, sequence was empty.") : l.front();
}

Value filter_last(const Value& v, Args&, const Callbacks&) {
  List l = to_list(v);
  return l.empty() ? Value::undefined("No last item, sequence was empty.") : l.back();
}

Value filter_join(const Value& v, Args& a, const Callbacks&) {
  auto d = a.take(0, "d");
  auto attribute = a.take(1, "attribute");
  std::string sep = d ? str(*d) : "";
  std::string out;
  List l = to_list(v);
  for (std::size_t k = 0; k < l.size(); ++k) out += (k ? sep : "") + str(attribute ? attr_path(l[k], *attribute) : l[k]);
  return Value::string(out);
}

Value filter_list(const Value& v, Args&, const Callbacks&) { return Value::of_list(to_list(v)); }

Value filter_items(const Value& v, Args&, const Callbacks&) {
  List out;
  if (v.is_undefined()) return Value::of_list(out);
  if (!v.is_dict()) error("Can only get item pairs from a mapping.");
  for (auto& [k, x] : v.dict->items) out.push_back(Value::of_list({k, x}, true));
  return Value::of_list(out);
}

Value filter_string(const Value& v, Args&, const Callbacks&) { return Value::string(str(v)); }

Value filter_int(const Value& v, Args& a, const Callbacks&) {
  auto d = a.take(0, "default");
  return to_int(v, d ? *d : Value::integer(0), int_arg(a.take(1, "base"), 10));
}

Value filter_float(const Value& v, Args& a, const Callbacks&) {
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
}

Value filter_abs(const Value& v, Args&, const Callbacks&) {
  if (v.kind == Kind::kFloat) return Value::real(std::fabs(v.f));
  if (v.is_number()) return Value::integer(std::llabs(v.as_int()));
  error("bad operand type for abs(): '" + type_name(v) + "'");
}

Value filter_round(const Value& v, Args& a, const Callbacks&) {
  std::int64_t precision = int_arg(a.take(0, "precision"), 0);
  auto method = a.take(1, "method");
  std::string how = method ? str(*method) : "common";
  if (!number_kind_of(v)) error("type " + type_name(v) + " doesn't define __round__ method");
  if (how == "common" && v.kind != Kind::kFloat && precision >= 0) return Value::integer(v.as_int());  // round(int, n)
  double x = v.as_double(), scale = std::pow(10.0, double(precision));
  double r = how == "ceil" ? std::ceil(x * scale) / scale : how == "floor" ? std::floor(x * scale) / scale
                                                                              : std::nearbyint(x * scale) / scale;
  return Value::real(r);
}

Value filter_replace(const Value& v, Args& a, const Callbacks&) {
  auto old = a.take(0, "old"), neu = a.take(1, "new");
  if (!old || !neu) error("replace() missing required arguments");
  return Value::string(replace(str(v), str(*old), str(*neu), int_arg(a.take(2, "count"), -1)));
}

Value filter_tojson(const Value& v, Args& a, const Callbacks&) {
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
}

Value filter_safe(const Value& v, Args&, const Callbacks&) { return v; }

Value filter_format(const Value& v, Args& a, const Callbacks&) {
  if (!a.keyword.empty()) {
    Dict d;
    for (auto& [k, x] : a.keyword) d.set(Value::string(k), x);
    return Value::string(percent_format(str(v), Value::of_dict(std::move(d))));
  }
  return Value::string(percent_format(str(v), Value::of_list(a.positional, /*tuple=*/true)));
}

Value filter_escape(const Value& v, Args&, const Callbacks&) { return Value::string(html_escape(str(v))); }

Value filter_reverse(const Value& v, Args&, const Callbacks&) {
  List l = to_list(v);
  std::reverse(l.begin(), l.end());
  if (v.is_string()) {
    std::string s;
    for (auto& c : l) s += c.s;
    return Value::string(s);
  }
  return Value::of_list(l);
}

Value filter_unique(const Value& v, Args&, const Callbacks&) {
  List out;
  for (auto& x : to_list(v))
    if (std::none_of(out.begin(), out.end(), [&](const Value& y) { return equals(x, y); })) out.push_back(x);
  return Value::of_list(out);
}

Value filter_sum(const Value& v, Args& a, const Callbacks&) {
  auto attribute = a.take(0, "attribute");
  auto start = a.take(1, "start");
  Value total = start ? *start : Value::integer(0);
  for (auto& x : to_list(v)) total = binary("+", total, attribute ? attr_path(x, *attribute) : x);
  return total;
}

FilterFn filter_extreme(bool want_max) {
  return [want_max](const Value& v, Args& a, const Callbacks&) {
    auto attribute = a.take(1, "attribute");
    List l = to_list(v);
    if (l.empty()) return Value::undefined("No aggregated item, sequence was empty.");
    Value best = l[0];
    for (auto& x : l) {
      Value kx = attribute ? attr_path(x, *attribute) : x, kb = attribute ? attr_path(best, *attribute) : best;
      if (kx.is_string() && kb.is_string()) {  // case_sensitive=False
        kx = Value::string(lower(kx.s));
        kb = Value::string(lower(kb.s));
      }
      if (want_max ? less(kb, kx) : less(kx, kb)) best = x;
    }
    return best;
  };
}

Value filter_sort(const Value& v, Args& a, const Callbacks&) {
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
}

FilterFn filter_select(bool attr, bool keep) {
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
}

Value filter_map(const Value& v, Args& a, const Callbacks& cb) {
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
}

Value filter_attr(const Value& v, Args& a, const Callbacks&) {
  auto name = a.take(0, "name");
  return get_attr(v, name ? str(*name) : "");
}

Value filter_indent(const Value& v, Args& a, const Callbacks&) {
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
}

Value filter_wordcount(const Value& v, Args&, const Callbacks&) {
  return Value::integer(split(str(v), std::nullopt, -1).size());
}

Value filter_center(const Value& v, Args& a, const Callbacks&) {
  std::string s = str(v);
  std::int64_t width = int_arg(a.take(0, "width"), 80), n = length(v);
  if (n >= width) return Value::string(s);
  std::int64_t total = width - n, left = total / 2 + (total & width & 1);
  return Value::string(std::string(left, ' ') + s + std::string(total - left, ' '));
}

Value filter_dictsort(const Value& v, Args& a, const Callbacks&) {
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
}

// jinja2's names (and its aliases: count, d, e) for the filters above
std::unordered_map<std::string, FilterFn> make_filters() {
  return {
      {"trim", filter_trim},
      {"length", filter_length},
      {"count", filter_length},
      {"upper", filter_upper},
      {"lower", filter_lower},
      {"capitalize", filter_capitalize},
      {"title", filter_title},
      {"default", filter_default},
      {"d", filter_default},
      {"first", filter_first},
      {"last", filter_last},
      {"join", filter_join},
      {"list", filter_list},
      {"items", filter_items},
      {"string", filter_string},
      {"int", filter_int},
      {"float", filter_float},
      {"abs", filter_abs},
      {"round", filter_round},
      {"replace", filter_replace},
      {"tojson", filter_tojson},
      {"safe", filter_safe},
      {"format", filter_format},
      {"escape", filter_escape},
      {"e", filter_escape},
      {"reverse", filter_reverse},
      {"unique", filter_unique},
      {"sum", filter_sum},
      {"max", filter_extreme(true)},
      {"min", filter_extreme(false)},
      {"sort", filter_sort},
      {"select", filter_select(false, true)},
      {"reject", filter_select(false, false)},
      {"selectattr", filter_select(true, true)},
      {"rejectattr", filter_select(true, false)},
      {"map", filter_map},
      {"attr", filter_attr},
      {"indent", filter_indent},
      {"wordcount", filter_wordcount},
      {"center", filter_center},
      {"dictsort", filter_dictsort},
  };
}


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
  t["number"] = [](const Value& v, Args&) { return number_kind_of(v); };
  t["string"] = [](const Value& v, Args&) { return v.is_string(); };
  t["mapping"] = [](const Value& v, Args&) { return v.is_dict() && !v.namespace_; };
  t["iterable"] = [](const Value& v, Args&) { return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined(); };
  t["sequence"] = [](const Value& v, Args&) { return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined(); };
  t["callable"] = [](const Value& v, Args&) { return v.kind == Kind::kFunction; };
  // str.islower() / isupper(): some cased character, and none of the other case
  t["lower"] = [](const Value& v, Args&) {
    std::string s = str(v);
    return lower(s) == s && upper(s) != s;
  };
  t["upper"] = [](const Value& v, Args&) {
    std::string s = str(v);
    return upper(s) == s && lower(s) != s;
  };
  t["escaped"] = [](const Value&, Args&) { return false; };
  t["even"] = [](const Value& v, Args&) { return !truthy(binary("%", v, Value::integer(2))); };
  t["odd"] = [](const Value& v, Args&) { return equals(binary("%", v, Value::integer(2)), Value::integer(1)); };
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

}  // namespace wick::jinja::detail
