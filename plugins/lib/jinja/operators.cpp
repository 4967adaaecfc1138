// The operators, with Python's semantics: + - * / // % ** ~, comparisons,
// `in`, and printf-style formatting.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "lib/jinja/builtins.hpp"
#include "lib/jinja/python.hpp"

namespace wick::jinja::detail {
namespace {

// Python's ints have no bound; wick's are 64-bit and fail where they would overflow.
[[noreturn]] void overflow() { error("integer overflow: the result does not fit in 64 bits"); }
std::int64_t add(std::int64_t a, std::int64_t b) {
  std::int64_t r;
  if (__builtin_add_overflow(a, b, &r)) overflow();
  return r;
}
std::int64_t sub(std::int64_t a, std::int64_t b) {
  std::int64_t r;
  if (__builtin_sub_overflow(a, b, &r)) overflow();
  return r;
}
std::int64_t mul(std::int64_t a, std::int64_t b) {
  std::int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) overflow();
  return r;
}

// A repetition ('ab' * n) that would exceed this is refused rather than exhaust memory.
constexpr std::int64_t kMaxRepeatBytes = std::int64_t(1) << 28;

std::int64_t py_floordiv(std::int64_t a, std::int64_t b) {
  if (a == INT64_MIN && b == -1) overflow();
  std::int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

// One %-conversion of percent_format: `spec` is "%" with the flags, width and
// precision, `conv` the conversion character.
std::string percent_convert(char conv, const std::string& spec, const Value& arg) {
  char buf[512];
  switch (conv) {
    case 's':
    case 'r': {
      std::string text = conv == 's' ? str(arg) : repr(arg);
      std::snprintf(buf, sizeof buf, (spec + "s").c_str(), text.c_str());
      return buf;
    }
    case 'd':
    case 'i':
    case 'x':
    case 'X':
    case 'o': {
      if (!number_kind_of(arg)) error("%" + std::string(1, conv) + " format: a real number is required, not " + type_name(arg));
      long long x = arg.kind == Kind::kFloat ? (long long)arg.f : arg.as_int();
      std::snprintf(buf, sizeof buf, (spec + "ll" + (conv == 'i' ? 'd' : conv)).c_str(), x);
      return buf;
    }
    case 'f':
    case 'F':
    case 'e':
    case 'E':
    case 'g':
    case 'G':
      if (!number_kind_of(arg)) error("must be real number, not " + type_name(arg));
      std::snprintf(buf, sizeof buf, (spec + conv).c_str(), arg.as_double());
      return buf;
    case 'c': return arg.is_string() ? arg.s : std::string(1, char(arg.as_int()));
    default: error(std::string("unsupported format character '") + conv + "'");
  }
}

// A %(key) of percent_format at fmt[k] == '(': the mapping's value; k moves past the ')'.
const Value* percent_key(const std::string& fmt, std::size_t& k, const Dict* named) {
  std::size_t close = fmt.find(')', k);
  if (close == std::string::npos) error("incomplete format key");
  if (!named) error("format requires a mapping");
  const Value* arg = named->find(Value::string(fmt.substr(k + 1, close - k - 1)));
  if (!arg) error("'" + fmt.substr(k + 1, close - k - 1) + "'");
  k = close + 1;
  return arg;
}

}  // namespace

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
    const Value* arg = fmt[k] == '(' ? percent_key(fmt, k, named) : nullptr;
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
    out += percent_convert(conv, spec, *arg);
  }
  if (!named && next < args.size()) error("not all arguments converted during string formatting");
  return out;
}

namespace {

// The two operands of an arithmetic operator, both defined.
struct Operands {
  const std::string& op;
  const Value &a, &b;
  bool nums = number_kind_of(a) && number_kind_of(b);
  bool floats = nums && (a.kind == Kind::kFloat || b.kind == Kind::kFloat);
  [[noreturn]] void unsupported() const {
    error("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
  }
};

Value plus(const Operands& o) {
  const Value &a = o.a, &b = o.b;
  if (o.nums) return o.floats ? Value::real(a.as_double() + b.as_double()) : Value::integer(add(a.as_int(), b.as_int()));
  if (a.is_string() && b.is_string()) return Value::string(a.s + b.s);
  if (a.is_list() && b.is_list()) {
    List l = *a.list;
    l.insert(l.end(), b.list->begin(), b.list->end());
    return Value::of_list(l, a.tuple);
  }
  if (a.is_string()) error("can only concatenate str (not \"" + type_name(b) + "\") to str");
  if (a.is_list()) error("can only concatenate list (not \"" + type_name(b) + "\") to list");
  o.unsupported();
}

Value minus(const Operands& o) {
  if (!o.nums) o.unsupported();
  return o.floats ? Value::real(o.a.as_double() - o.b.as_double()) : Value::integer(sub(o.a.as_int(), o.b.as_int()));
}

// 'ab' * n and [x] * n, either way round
Value repeat(const Value& seq, std::int64_t times) {
  std::int64_t n = std::max<std::int64_t>(0, times);
  std::int64_t unit = seq.is_string() ? std::int64_t(seq.s.size()) : std::int64_t(seq.list->size()) * 64;
  if (unit > 0 && n > kMaxRepeatBytes / unit) error("repetition too large: over 256 MiB");
  if (seq.is_string()) {
    std::string s;
    for (std::int64_t k = 0; k < n; ++k) s += seq.s;
    return Value::string(s);
  }
  List l;
  for (std::int64_t k = 0; k < n; ++k) l.insert(l.end(), seq.list->begin(), seq.list->end());
  return Value::of_list(l);
}

Value times(const Operands& o) {
  const Value &a = o.a, &b = o.b;
  if (o.nums) return o.floats ? Value::real(a.as_double() * b.as_double()) : Value::integer(mul(a.as_int(), b.as_int()));
  const Value* seq = a.is_string() || a.is_list() ? &a : b.is_string() || b.is_list() ? &b : nullptr;
  const Value* count = seq == &a ? &b : &a;
  if (seq && (count->kind == Kind::kInt || count->kind == Kind::kBool)) return repeat(*seq, count->as_int());
  o.unsupported();
}

Value divide(const Operands& o) {
  if (!o.nums) o.unsupported();
  if (o.b.as_double() == 0) error("division by zero");
  return Value::real(o.a.as_double() / o.b.as_double());
}

Value floor_divide(const Operands& o) {
  if (!o.nums) o.unsupported();
  if (o.b.as_double() == 0) error("integer division or modulo by zero");
  if (o.floats) return Value::real(std::floor(o.a.as_double() / o.b.as_double()));
  return Value::integer(py_floordiv(o.a.as_int(), o.b.as_int()));
}

// a % b: printf-style formatting for a string, else Python's modulo (the sign of b)
Value modulo(const Operands& o) {
  const Value &a = o.a, &b = o.b;
  if (a.is_string()) return Value::string(percent_format(a.s, b));
  if (!o.nums) o.unsupported();
  if (b.as_double() == 0) error("integer division or modulo by zero");
  if (o.floats) {
    double m = std::fmod(a.as_double(), b.as_double());
    if (m != 0 && ((m < 0) != (b.as_double() < 0))) m += b.as_double();
    return Value::real(m);
  }
  return Value::integer(sub(a.as_int(), mul(py_floordiv(a.as_int(), b.as_int()), b.as_int())));
}

Value power(const Operands& o) {
  if (!o.nums) o.unsupported();
  if (!o.floats && o.b.as_int() >= 0) {
    // by squaring, so 2 ** 62 takes 6 steps and (-1) ** 10**18 no time
    std::int64_t r = 1, base = o.a.as_int(), e = o.b.as_int();
    while (e > 0) {
      if (e & 1) r = mul(r, base);
      e >>= 1;
      if (e) base = mul(base, base);
    }
    return Value::integer(r);
  }
  return Value::real(std::pow(o.a.as_double(), o.b.as_double()));
}

}  // namespace

Value binary(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return Value::string(str(a) + str(b));
  check_defined(a);
  check_defined(b);
  const Operands o{op, a, b};
  if (op == "+") return plus(o);
  if (op == "-") return minus(o);
  if (op == "*") return times(o);
  if (op == "/") return divide(o);
  if (op == "//") return floor_divide(o);
  if (op == "%") return modulo(o);
  if (op == "**") return power(o);
  o.unsupported();
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
      case Kind::kDict:
        if (a.is_list() && !a.tuple) error("unhashable type: 'list'");
        if (a.is_dict()) error("unhashable type: '" + type_name(a) + "'");
        found = b.dict->find(a) != nullptr;
        break;
      default: error("argument of type '" + type_name(b) + "' is not iterable");
    }
    return op == "in" ? found : !found;
  }
  check_defined(a);
  check_defined(b);
  auto bad = [&]() {
    error("'" + op + "' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
  };
  bool comparable = (number_kind_of(a) && number_kind_of(b)) || (a.is_string() && b.is_string()) || (a.is_list() && b.is_list());
  if (!comparable) bad();
  if (op == "<") return less(a, b);
  if (op == ">") return less(b, a);
  if (op == "<=") return !less(b, a);
  if (op == ">=") return !less(a, b);
  bad();
  return false;
}

}  // namespace wick::jinja::detail
