// Rendering: evaluates a parsed template against a context, with jinja2's
// scoping (a loop's assignments stay in the loop; namespaces carry values
// out), its Undefined, and the filters, tests, globals and Python methods
// that chat templates call (builtins.cpp).

#include <cmath>
#include <cstdint>
#include <unordered_map>

#include "lib/jinja/builtins.hpp"
#include "lib/jinja/jinja.hpp"
#include "lib/jinja/parse.hpp"
#include "lib/jinja/python.hpp"

namespace wick::jinja {
namespace detail {
namespace {

enum class Flow { kNormal, kBreak, kContinue };

[[noreturn]] void raise(const std::string& message, int line) { throw TemplateError(message, line); }

class Renderer {
 public:
  template <class Json>
  Renderer(const Json& context, RenderResult& result) : result_(result), out_(&result.text) {
    frames_.emplace_back();
    add_globals(frames_.back(), [](const std::string& m, int line) { raise(m, line); });
    frames_.emplace_back();
    if (!context.is_null() && !context.is_object()) raise("the context to render with must be a JSON object", 0);
    if (context.is_object())
      for (auto& [k, v] : context.items()) frames_.back()[k] = Value::from_json(v);
  }

  void run(const Body& body) { exec(body); }

 private:
  using Frame = std::unordered_map<std::string, Value>;

  Value lookup(const std::string& name) const {
    for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return Value::undefined("'" + name + "' is undefined");
  }

  Flow exec(const Body& body) {
    for (auto& s : body) {
      Flow f = exec(*s);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

  Flow exec(const Stmt& s) {
    switch (s.kind) {
      case StmtKind::kText: *out_ += s.text; return Flow::kNormal;
      case StmtKind::kOutput: {
        Value v = eval(*s.expr);
        *out_ += str(v);
        return Flow::kNormal;
      }
      case StmtKind::kIf: {
        for (std::size_t k = 0; k < s.conditions.size(); ++k)
          if (truthy(eval(*s.conditions[k]))) return exec(s.bodies[k]);
        if (s.bodies.size() > s.conditions.size()) return exec(s.bodies.back());
        return Flow::kNormal;
      }
      case StmtKind::kFor: return exec_for(s);
      case StmtKind::kSet: {
        Value v = eval(*s.expr);
        if (!s.attr.empty()) {
          Value ns = lookup(s.targets[0]);
          if (!(ns.is_dict() && ns.namespace_)) raise("cannot assign attribute on non-namespace object", s.line);
          if (!s.attr.empty() && s.attr[0] == '_')
            raise("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" + s.attr +
                      "'. Please rename the attribute.", s.line);
          ns.dict->set(Value::string(s.attr), std::move(v));
        } else {
          assign(s.targets, std::move(v), s.line);
        }
        return Flow::kNormal;
      }
      case StmtKind::kSetBlock: {
        std::string text = capture(s.bodies[0]);
        Value v = Value::string(std::move(text));
        if (s.filter) v = apply_filters(*s.filter, std::move(v));
        assign(s.targets, std::move(v), s.line);
        return Flow::kNormal;
      }
      case StmtKind::kFilterBlock: {
        std::string text = capture(s.bodies[0]);
        *out_ += str(apply_filters(*s.filter, Value::string(std::move(text))));
        return Flow::kNormal;
      }
      case StmtKind::kMacro: {
        frames_.back()[s.name] = make_macro(s);
        return Flow::kNormal;
      }
      case StmtKind::kBreak: return Flow::kBreak;
      case StmtKind::kContinue: return Flow::kContinue;
      case StmtKind::kGeneration: {
        // transformers takes a span's start from the output rendered so far
        // at the top level, also when the block renders into a macro's or a
        // `set` block's text, and its end that many characters further
        std::size_t begin = out_->size();
        Flow f = exec(s.bodies[0]);
        std::size_t start = result_.text.size() - (out_ == &result_.text ? out_->size() - begin : 0);
        result_.generation_spans.emplace_back(start, start + (out_->size() - begin));
        return f;
      }
      default: raise("unsupported statement", s.line);
    }
  }

  std::string capture(const Body& body) {
    std::string text;
    std::string* saved = out_;
    out_ = &text;
    try {
      exec(body);
    } catch (...) {
      out_ = saved;
      throw;
    }
    out_ = saved;
    return text;
  }

  void assign(const std::vector<std::string>& targets, Value v, int line) {
    if (targets.size() == 1) {
      frames_.back()[targets[0]] = std::move(v);
      return;
    }
    List items = iterate(v, line);
    if (items.size() != targets.size())
      raise(items.size() < targets.size()
                ? "not enough values to unpack (expected " + std::to_string(targets.size()) + ", got " +
                      std::to_string(items.size()) + ")"
                : "too many values to unpack (expected " + std::to_string(targets.size()) + ")",
            line);
    for (std::size_t k = 0; k < targets.size(); ++k) frames_.back()[targets[k]] = items[k];
  }

  Flow exec_for(const Stmt& s) {
    Value seq = eval(*s.expr);
    List items = iterate(seq, s.line);
    frames_.emplace_back();
    struct Pop {
      std::vector<Frame>& f;
      ~Pop() { f.pop_back(); }
    } pop{frames_};
    if (s.filter) {
      List kept;
      for (auto& item : items) {
        assign(s.targets, item, s.line);
        if (truthy(eval(*s.filter))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      if (s.bodies.size() > 1) return exec(s.bodies[1]) == Flow::kNormal ? Flow::kNormal : Flow::kNormal;
      return Flow::kNormal;
    }
    const std::int64_t n = items.size();
    Value loop = Value::of_dict({});
    loop.dict->set(Value::string("length"), Value::integer(n));
    loop.dict->set(Value::string("depth"), Value::integer(1));
    loop.dict->set(Value::string("depth0"), Value::integer(0));
    for (std::int64_t k = 0; k < n; ++k) {
      Dict& d = *loop.dict;
      d.set(Value::string("index0"), Value::integer(k));
      d.set(Value::string("index"), Value::integer(k + 1));
      d.set(Value::string("revindex"), Value::integer(n - k));
      d.set(Value::string("revindex0"), Value::integer(n - k - 1));
      d.set(Value::string("first"), Value::boolean(k == 0));
      d.set(Value::string("last"), Value::boolean(k == n - 1));
      d.set(Value::string("previtem"), k > 0 ? items[k - 1] : Value::undefined("there is no previous item"));
      d.set(Value::string("nextitem"), k + 1 < n ? items[k + 1] : Value::undefined("there is no next item"));
      d.set(Value::string("cycle"), Value::function([k](Args& a) -> Value {
              if (a.positional.empty()) throw std::invalid_argument("no items for cycling given");
              return a.positional[k % a.positional.size()];
            }));
      frames_.back().clear();  // each pass starts afresh: a `set` lasts until the pass ends
      frames_.back()["loop"] = loop;
      assign(s.targets, items[k], s.line);
      Flow f = exec(s.bodies[0]);
      if (f == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  // A macro sees the template's top-level names as they are when it is
  // called, and the loop variables around its definition as they were then.
  Value make_macro(const Stmt& s) {
    const Stmt* def = &s;
    std::vector<Frame> closure(frames_.begin() + 2, frames_.end());
    return Value::function([this, def, closure](Args& args) -> Value {
      Frame frame;
      for (std::size_t k = 0; k < def->params.size(); ++k) {
        auto v = args.take(k, def->params[k]);
        if (v) frame[def->params[k]] = *v;
        else if (def->defaults[k]) frame[def->params[k]] = eval(*def->defaults[k]);
        else frame[def->params[k]] = Value::undefined("'" + def->params[k] + "' is undefined");
      }
      List varargs;
      for (std::size_t k = def->params.size(); k < args.positional.size(); ++k) varargs.push_back(args.positional[k]);
      frame["varargs"] = Value::of_list(std::move(varargs), true);
      Dict kwargs;
      for (auto& [k, v] : args.keyword) kwargs.set(Value::string(k), v);
      frame["kwargs"] = Value::of_dict(std::move(kwargs));
      std::vector<Frame> saved = std::move(frames_);
      frames_ = {saved[0], saved[1]};
      frames_.insert(frames_.end(), closure.begin(), closure.end());
      frames_.push_back(std::move(frame));
      std::string text;
      try {
        text = capture(def->bodies[0]);
      } catch (...) {
        frames_ = std::move(saved);
        throw;
      }
      frames_ = std::move(saved);
      return Value::string(std::move(text));
    });
  }

  // The items a for loop visits: a list's, a dict's keys, a string's characters.
  List iterate(const Value& v, int line) {
    return guard(line, [&] { return to_list(v); });
  }

  Args eval_args(const Expr& e, std::size_t first) {
    Args a;
    for (std::size_t k = first; k < e.kids.size(); ++k) {
      if (e.arg_names[k].empty()) a.positional.push_back(eval(*e.kids[k]));
      else a.keyword.emplace_back(e.arg_names[k], eval(*e.kids[k]));
    }
    return a;
  }

  Value apply_filters(const Expr& f, Value input) {
    // f is a chain of kFilter nodes whose innermost value is null
    if (f.kids[0]) input = apply_filters(*f.kids[0], std::move(input));
    Args a = eval_args(f, 1);
    return call_filter(f.name, std::move(input), a, f.line);
  }

  Value call_filter(const std::string& name, Value v, Args& a, int line) {
    const FilterFn* fn = find_filter(name);
    if (!fn) raise("No filter named '" + name + "'.", line);
    return guard(line, [&] { return (*fn)(v, a, callbacks()); });
  }

  Callbacks callbacks() {
    Callbacks cb;
    cb.test = [this](const std::string& name, const Value& v, Args& a) { return run_test(name, v, a, 0); };
    cb.filter = [this](const std::string& name, const Value& v, Args& a) { return call_filter(name, v, a, 0); };
    return cb;
  }

  bool run_test(const std::string& name, const Value& v, Args& a, int line) {
    const TestFn* fn = find_test(name);
    if (!fn) raise("No test named '" + name + "'.", line);
    return guard(line, [&] { return (*fn)(v, a); });
  }

  template <class F>
  auto guard(int line, F&& f) -> decltype(f()) {
    try {
      return f();
    } catch (const TemplateError& e) {
      if (e.line() != 0 || line == 0) throw;
      raise(e.what(), line);  // raise_exception's message, with the line of its call
    } catch (const std::exception& e) {
      raise(e.what(), line);
    }
  }

  // Deep nesting or a macro that calls itself forever ends in an error, as
  // Python's recursion limit ends it in jinja2, not in a stack overflow.
  struct Depth {
    int& d;
    Depth(int& depth, int line) : d(depth) {
      if (++d > kMaxDepth) {
        --d;
        raise("maximum recursion depth exceeded", line);
      }
    }
    ~Depth() { --d; }
  };
  static constexpr int kMaxDepth = 400;

  Value eval(const Expr& e) {
    Depth depth(depth_, e.line);
    switch (e.kind) {
      case ExprKind::kConst: return e.value;
      case ExprKind::kName: return lookup(e.name);
      case ExprKind::kGetAttr: {
        Value obj = eval(*e.kids[0]);
        return guard(e.line, [&] { return get_attr(obj, e.name); });
      }
      case ExprKind::kGetItem: {
        Value obj = eval(*e.kids[0]);
        Value key = eval(*e.kids[1]);
        return guard(e.line, [&] { return get_item(obj, key); });
      }
      case ExprKind::kSlice: {
        Value obj = eval(*e.kids[0]);
        std::optional<Value> parts[3];
        for (int k = 0; k < 3; ++k)
          if (e.kids[k + 1]) parts[k] = eval(*e.kids[k + 1]);
        return guard(e.line, [&] { return slice(obj, parts[0], parts[1], parts[2]); });
      }
      case ExprKind::kCall: {
        Value fn = eval(*e.kids[0]);
        Args a = eval_args(e, 1);
        if (fn.is_undefined()) raise(fn.s, e.line);
        if (fn.kind != Kind::kFunction) raise("'" + type_name(fn) + "' object is not callable", e.line);
        return guard(e.line, [&] { return (*fn.fn)(a); });
      }
      case ExprKind::kFilter: {
        Value v = eval(*e.kids[0]);
        Args a = eval_args(e, 1);
        return call_filter(e.name, std::move(v), a, e.line);
      }
      case ExprKind::kTest: {
        Value v = eval(*e.kids[0]);
        Args a = eval_args(e, 1);
        return Value::boolean(run_test(e.name, v, a, e.line) != e.negated);
      }
      case ExprKind::kNeg:
      case ExprKind::kPos: {
        Value v = eval(*e.kids[0]);
        if (v.is_undefined()) raise(v.s, e.line);
        if (!v.is_number()) raise("bad operand type for unary " + std::string(e.kind == ExprKind::kNeg ? "-" : "+") + ": '" + type_name(v) + "'", e.line);
        if (e.kind == ExprKind::kPos) return v.kind == Kind::kBool ? Value::integer(v.b) : v;
        if (v.kind != Kind::kFloat && v.as_int() == INT64_MIN) raise("integer overflow: the result does not fit in 64 bits", e.line);
        return v.kind == Kind::kFloat ? Value::real(-v.f) : Value::integer(-v.as_int());
      }
      case ExprKind::kNot: return Value::boolean(!truthy(eval(*e.kids[0])));
      case ExprKind::kAnd: {
        Value a = eval(*e.kids[0]);
        return truthy(a) ? eval(*e.kids[1]) : a;
      }
      case ExprKind::kOr: {
        Value a = eval(*e.kids[0]);
        return truthy(a) ? a : eval(*e.kids[1]);
      }
      case ExprKind::kBinary: {
        Value a = eval(*e.kids[0]);
        Value b = eval(*e.kids[1]);
        return guard(e.line, [&] { return binary(e.name, a, b); });
      }
      case ExprKind::kCompare: {
        Value a = eval(*e.kids[0]);
        for (std::size_t k = 0; k < e.ops.size(); ++k) {
          Value b = eval(*e.kids[k + 1]);
          bool ok = guard(e.line, [&] { return compare(e.ops[k], a, b); });
          if (!ok) return Value::boolean(false);
          a = std::move(b);
        }
        return Value::boolean(true);
      }
      case ExprKind::kCondition: {
        if (truthy(eval(*e.kids[0]))) return eval(*e.kids[1]);
        if (e.kids[2]) return eval(*e.kids[2]);
        return Value::undefined("the inline if-expression on line " + std::to_string(e.line) +
                                " evaluated to false and no else section was defined.");
      }
      case ExprKind::kList:
      case ExprKind::kTuple: {
        List l;
        for (auto& k : e.kids) l.push_back(eval(*k));
        return Value::of_list(std::move(l), e.kind == ExprKind::kTuple);
      }
      case ExprKind::kDict: {
        Dict d;
        for (std::size_t k = 0; k + 1 < e.kids.size(); k += 2) {
          Value key = eval(*e.kids[k]);
          d.set(key, eval(*e.kids[k + 1]));
        }
        return Value::of_dict(std::move(d));
      }
    }
    return Value::none();
  }

  RenderResult& result_;
  std::string* out_;
  std::vector<Frame> frames_;  // [globals, context, loop and macro frames...]
  int depth_ = 0;
};

}  // namespace
}  // namespace detail

namespace {
// Whatever fails inside (a bad_alloc on a huge repetition, say) reaches the
// caller as a TemplateError.
template <class F>
auto as_template_error(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const TemplateError&) {
    throw;
  } catch (const std::exception& e) {
    throw TemplateError(e.what(), 0);
  }
}
}  // namespace

ChatTemplate::ChatTemplate(const std::string& source)
    : program_(as_template_error([&] { return detail::parse(source); })) {}
ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

template <class Json>
static RenderResult render_with(const detail::Program& program, const Json& context) {
  return as_template_error([&] {
    RenderResult result;
    detail::Renderer r(context, result);
    r.run(program.body);
    return result;
  });
}

RenderResult ChatTemplate::render(const nlohmann::ordered_json& context) const { return render_with(*program_, context); }
RenderResult ChatTemplate::render(const nlohmann::json& context) const { return render_with(*program_, context); }

namespace {
// transformers' _alias_reasoning_fields: {"thinking": r, **message, "reasoning_content": r}.
nlohmann::ordered_json alias_reasoning(const nlohmann::ordered_json& message) {
  if (!message.is_object()) return message;
  const nlohmann::ordered_json* reasoning = nullptr;
  for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
    auto it = message.find(key);
    if (it != message.end() && !it->is_null()) {
      reasoning = &*it;
      break;
    }
  }
  if (!reasoning) return message;
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  out["thinking"] = *reasoning;
  for (auto& [k, v] : message.items()) out[k] = v;
  out["reasoning_content"] = *reasoning;
  return out;
}
}  // namespace

RenderResult ChatTemplate::apply(const nlohmann::ordered_json& messages, const ChatOptions& options) const {
  if (!messages.is_array()) throw TemplateError("the messages must be a list of dicts", 0);
  nlohmann::ordered_json chat = nlohmann::ordered_json::array();
  for (auto& m : messages) {
    if (!m.is_object()) throw TemplateError("Chat messages should be dicts, but got " + m.dump() + ".", 0);
    chat.push_back(alias_reasoning(m));
  }
  nlohmann::ordered_json context = {{"messages", std::move(chat)},
                                    {"tools", options.tools},
                                    {"documents", options.documents},
                                    {"add_generation_prompt", options.add_generation_prompt}};
  if (!options.variables.is_null() && !options.variables.is_object())
    throw TemplateError("the template's variables must be a JSON object", 0);
  if (options.variables.is_object())
    for (auto& [k, v] : options.variables.items()) context[k] = v;
  return render_with(*program_, context);
}

}  // namespace wick::jinja
