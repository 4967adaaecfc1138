#pragma once
// What templates call: jinja2's filters and tests, transformers' globals,
// the Python methods of str, dict and list, attribute and item lookup with
// jinja2's Undefined, and the operators.

#include <functional>
#include <optional>
#include <string>
#include <unordered_map>

#include "lib/jinja/value.hpp"

namespace wick::jinja::detail {

/// Filters such as select and map run tests and filters by name.
struct Callbacks {
  std::function<bool(const std::string&, const Value&, Args&)> test;
  std::function<Value(const std::string&, const Value&, Args&)> filter;
};

using FilterFn = std::function<Value(const Value&, Args&, const Callbacks&)>;
using TestFn = std::function<bool(const Value&, Args&)>;

const FilterFn* find_filter(const std::string& name);
const TestFn* find_test(const std::string& name);

/// range, namespace, dict, raise_exception (which calls `raise` with its
/// message), strftime_now.
void add_globals(std::unordered_map<std::string, Value>& frame,
                 const std::function<void(const std::string&, int)>& raise);

/// `obj.name`: a method first, then an item (jinja2's getattr).
Value get_attr(const Value& obj, const std::string& name);
/// `obj[key]`: an item first, then a method (jinja2's getitem).
Value get_item(const Value& obj, const Value& key);
Value slice(const Value& obj, const std::optional<Value>& start, const std::optional<Value>& stop,
            const std::optional<Value>& step);
/// + - * / // % ** ~
Value binary(const std::string& op, const Value& a, const Value& b);
/// == != < > <= >= in notin
bool compare(const std::string& op, const Value& a, const Value& b);

}  // namespace wick::jinja::detail
