// The names transformers' environment defines: raise_exception, range,
// namespace, dict, strftime_now.
#include <ctime>

#include "lib/jinja/builtins.hpp"
#include "lib/jinja/python.hpp"

namespace wick::jinja::detail {

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

}  // namespace wick::jinja::detail
