#include "lib/jinja/parse.hpp"

#include <algorithm>

#include "lib/jinja/lexer.hpp"

namespace wick::jinja::detail {
namespace {

std::string quoted(const Token& t) { return "'" + describe(t) + "'"; }

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  std::shared_ptr<Program> run() {
    auto p = std::make_shared<Program>();
    p->body = parse_body({});
    if (cur().type != Tok::kEof) fail("unexpected " + quoted(cur()), cur().line);
    return p;
  }

 private:
  const Token& cur() const { return toks_[pos_]; }
  const Token& peek(int n = 1) const { return toks_[std::min(pos_ + n, toks_.size() - 1)]; }
  Token next() { return toks_[pos_ < toks_.size() - 1 ? pos_++ : pos_]; }
  bool is_op(const char* op) const { return cur().type == Tok::kOp && cur().text == op; }
  bool is_name(const char* name) const { return cur().type == Tok::kName && cur().text == name; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    ++pos_;
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    ++pos_;
    return true;
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) fail(std::string("expected token '") + op + "', got " + quoted(cur()), cur().line);
  }
  std::string expect_name() {
    if (cur().type != Tok::kName) fail("expected token 'name', got " + quoted(cur()), cur().line);
    return next().text;
  }
  void expect_block_end() {
    if (cur().type != Tok::kBlockEnd) fail("expected token 'end of statement block', got " + quoted(cur()), cur().line);
    ++pos_;
  }

  static std::string join_tags(const std::vector<std::string>& tags) {
    std::string s;
    for (std::size_t k = 0; k < tags.size(); ++k) s += (k ? " or " : "") + ("'" + tags[k] + "'");
    return s;
  }

  // Statements up to a block whose first name is in `ends` (left unconsumed, after its {%).
  Body parse_body(const std::vector<std::string>& ends) {
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == Tok::kEof) {
        if (!ends.empty()) {
          std::string msg = "Unexpected end of template. Jinja was looking for the following tags: " + join_tags(ends) + ".";
          if (!open_.empty()) msg += " The innermost block that needs to be closed is '" + open_.back() + "'.";
          fail(msg, t.line);
        }
        return body;
      }
      if (t.type == Tok::kData) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kText;
        s->line = t.line;
        s->text = t.text;
        body.push_back(std::move(s));
        ++pos_;
      } else if (t.type == Tok::kVarBegin) {
        ++pos_;
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::kOutput;
        s->line = t.line;
        s->expr = parse_tuple();
        if (cur().type != Tok::kVarEnd) fail("expected token 'end of print statement', got " + quoted(cur()), cur().line);
        ++pos_;
        body.push_back(std::move(s));
      } else if (t.type == Tok::kBlockBegin) {
        if (peek().type != Tok::kName) fail("tag name expected", peek().line);
        const std::string& name = peek().text;
        for (auto& e : ends)
          if (e == name) {
            ++pos_;  // leave the name for the caller
            return body;
          }
        ++pos_;
        body.push_back(parse_statement(ends));
      } else {
        fail("unexpected " + quoted(t), t.line);
      }
    }
  }

  std::unique_ptr<Stmt> parse_statement(const std::vector<std::string>& ends) {
    int line = cur().line;
    if (open_.size() > 100) fail("blocks nested too deeply", line);
    std::string tag = next().text;
    auto s = std::make_unique<Stmt>();
    s->line = line;
    if (tag == "if") {
      s->kind = StmtKind::kIf;
      open_.push_back("if");
      s->conditions.push_back(parse_tuple());
      expect_block_end();
      while (true) {
        s->bodies.push_back(parse_body({"elif", "else", "endif"}));
        std::string t = next().text;
        if (t == "elif") {
          s->conditions.push_back(parse_tuple());
          expect_block_end();
        } else if (t == "else") {
          expect_block_end();
          s->bodies.push_back(parse_body({"endif"}));
          ++pos_;
          expect_block_end();
          break;
        } else {
          expect_block_end();
          break;
        }
      }
      open_.pop_back();
    } else if (tag == "for") {
      s->kind = StmtKind::kFor;
      open_.push_back("for");
      s->targets.push_back(expect_name());
      while (skip_op(",")) s->targets.push_back(expect_name());
      if (!skip_name("in")) fail("expected token 'in', got " + quoted(cur()), cur().line);
      s->expr = parse_tuple(/*with_condexpr=*/false);
      if (skip_name("if")) s->filter = parse_expression();
      if (skip_name("recursive")) s->recursive = true;
      expect_block_end();
      s->bodies.push_back(parse_body({"endfor", "else"}));
      if (next().text == "else") {
        expect_block_end();
        s->bodies.push_back(parse_body({"endfor"}));
        ++pos_;
      }
      expect_block_end();
      open_.pop_back();
    } else if (tag == "set") {
      std::string target = expect_name();
      if (skip_op(".")) {
        s->attr = expect_name();
        s->targets.push_back(target);
        expect_op("=");
        s->kind = StmtKind::kSet;
        s->expr = parse_tuple();
        expect_block_end();
      } else {
        s->targets.push_back(target);
        while (skip_op(",")) s->targets.push_back(expect_name());
        if (skip_op("=")) {
          s->kind = StmtKind::kSet;
          s->expr = parse_tuple();
          expect_block_end();
        } else {
          s->kind = StmtKind::kSetBlock;
          if (skip_op("|")) s->filter = parse_filter_chain(nullptr);
          expect_block_end();
          open_.push_back("set");
          s->bodies.push_back(parse_body({"endset"}));
          ++pos_;
          expect_block_end();
          open_.pop_back();
        }
      }
    } else if (tag == "macro") {
      s->kind = StmtKind::kMacro;
      s->name = expect_name();
      expect_op("(");
      while (!skip_op(")")) {
        if (!s->params.empty()) expect_op(",");
        if (skip_op(")")) break;
        s->params.push_back(expect_name());
        s->defaults.push_back(skip_op("=") ? parse_expression() : nullptr);
      }
      expect_block_end();
      open_.push_back("macro");
      s->bodies.push_back(parse_body({"endmacro"}));
      ++pos_;
      if (cur().type == Tok::kName) ++pos_;  // {% endmacro name %}
      expect_block_end();
      open_.pop_back();
    } else if (tag == "filter") {
      s->kind = StmtKind::kFilterBlock;
      s->filter = parse_filter_chain(nullptr);
      expect_block_end();
      open_.push_back("filter");
      s->bodies.push_back(parse_body({"endfilter"}));
      ++pos_;
      expect_block_end();
      open_.pop_back();
    } else if (tag == "generation") {
      s->kind = StmtKind::kGeneration;
      expect_block_end();
      open_.push_back("generation");
      s->bodies.push_back(parse_body({"endgeneration"}));
      ++pos_;
      expect_block_end();
      open_.pop_back();
    } else if (tag == "break" || tag == "continue") {
      bool in_loop = false;
      for (auto& o : open_) in_loop |= o == "for";
      if (!in_loop) fail("'" + tag + "' outside of a loop", line);
      s->kind = tag == "break" ? StmtKind::kBreak : StmtKind::kContinue;
      expect_block_end();
    } else {
      std::string msg = "Encountered unknown tag '" + tag + "'.";
      if (!ends.empty()) {
        msg += " Jinja was looking for the following tags: " + join_tags(ends) + ".";
        if (!open_.empty()) msg += " The innermost block that needs to be closed is '" + open_.back() + "'.";
      }
      fail(msg, line);
    }
    return s;
  }

  ExprPtr make(ExprKind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // An expression, or a tuple of them without parentheses (`{{ a, b }}`).
  ExprPtr parse_tuple(bool with_condexpr = true) {
    int line = cur().line;
    if (cur().type == Tok::kBlockEnd || cur().type == Tok::kVarEnd)
      fail("Expected an expression, got " + quoted(cur()), line);
    ExprPtr first = with_condexpr ? parse_expression() : parse_or();
    if (!is_op(",")) return first;
    auto t = make(ExprKind::kTuple, line);
    t->kids.push_back(std::move(first));
    while (skip_op(",")) {
      if (cur().type == Tok::kBlockEnd || cur().type == Tok::kVarEnd || is_op(")")) break;
      t->kids.push_back(with_condexpr ? parse_expression() : parse_or());
    }
    return t;
  }

  ExprPtr parse_expression() {
    ExprPtr e = parse_or();
    while (is_name("if")) {
      int line = next().line;
      auto c = make(ExprKind::kCondition, line);
      ExprPtr cond = parse_or();
      ExprPtr other = skip_name("else") ? parse_expression() : nullptr;
      c->kids.push_back(std::move(cond));
      c->kids.push_back(std::move(e));
      c->kids.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      auto o = make(ExprKind::kOr, next().line);
      o->kids.push_back(std::move(e));
      o->kids.push_back(parse_and());
      e = std::move(o);
    }
    return e;
  }

  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      auto o = make(ExprKind::kAnd, next().line);
      o->kids.push_back(std::move(e));
      o->kids.push_back(parse_not());
      e = std::move(o);
    }
    return e;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      auto n = make(ExprKind::kNot, next().line);
      n->kids.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    int line = cur().line;
    ExprPtr e = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().type == Tok::kOp &&
          (cur().text == "==" || cur().text == "!=" || cur().text == "<" || cur().text == ">" || cur().text == "<=" ||
           cur().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        ++pos_;
        op = "in";
      } else if (is_name("not") && peek().type == Tok::kName && peek().text == "in") {
        pos_ += 2;
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = make(ExprKind::kCompare, line);
        cmp->kids.push_back(std::move(e));
      }
      cmp->ops.push_back(op);
      cmp->kids.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(e);
  }

  ExprPtr binary(const std::string& op, ExprPtr a, ExprPtr b, int line) {
    auto e = make(ExprKind::kBinary, line);
    e->name = op;
    e->kids.push_back(std::move(a));
    e->kids.push_back(std::move(b));
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      Token t = next();
      e = binary(t.text, std::move(e), parse_concat(), t.line);
    }
    return e;
  }

  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (is_op("~")) {
      Token t = next();
      e = binary("~", std::move(e), parse_math2(), t.line);
    }
    return e;
  }

  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      Token t = next();
      e = binary(t.text, std::move(e), parse_pow(), t.line);
    }
    return e;
  }

  ExprPtr parse_pow() {
    ExprPtr e = parse_unary();
    while (is_op("**")) {
      Token t = next();
      e = binary("**", std::move(e), parse_unary(), t.line);
    }
    return e;
  }

  ExprPtr parse_unary(bool with_filter = true) {
    struct Nest {
      int& d;
      ~Nest() { --d; }
    } nest{++nesting_};
    if (nesting_ > kMaxNesting) fail("expressions nested too deeply", cur().line);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      Token t = next();
      e = make(t.text == "-" ? ExprKind::kNeg : ExprKind::kPos, t.line);
      e->kids.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    int line = t.line;
    if (t.type == Tok::kName) {
      std::string n = next().text;
      if (n == "true" || n == "True") return constant(Value::boolean(true), line);
      if (n == "false" || n == "False") return constant(Value::boolean(false), line);
      if (n == "none" || n == "None") return constant(Value::none(), line);
      auto e = make(ExprKind::kName, line);
      e->name = n;
      return e;
    }
    if (t.type == Tok::kString) {
      std::string s = next().value.s;
      while (cur().type == Tok::kString) s += next().value.s;
      return constant(Value::string(s), line);
    }
    if (t.type == Tok::kInt || t.type == Tok::kFloat) return constant(next().value, line);
    if (is_op("(")) {
      ++pos_;
      if (skip_op(")")) return make(ExprKind::kTuple, line);
      ExprPtr e = parse_expression();
      if (is_op(",")) {
        auto tup = make(ExprKind::kTuple, line);
        tup->kids.push_back(std::move(e));
        while (skip_op(",")) {
          if (is_op(")")) break;
          tup->kids.push_back(parse_expression());
        }
        e = std::move(tup);
      }
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      ++pos_;
      auto l = make(ExprKind::kList, line);
      while (!skip_op("]")) {
        if (!l->kids.empty()) expect_op(",");
        if (skip_op("]")) break;
        l->kids.push_back(parse_expression());
      }
      return l;
    }
    if (is_op("{")) {
      ++pos_;
      auto d = make(ExprKind::kDict, line);
      while (!skip_op("}")) {
        if (!d->kids.empty()) expect_op(",");
        if (skip_op("}")) break;
        d->kids.push_back(parse_expression());
        expect_op(":");
        d->kids.push_back(parse_expression());
      }
      return d;
    }
    fail("unexpected " + quoted(t), line);
  }

  ExprPtr constant(Value v, int line) {
    auto e = make(ExprKind::kConst, line);
    e->value = std::move(v);
    return e;
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".")) {
        int line = next().line;
        if (cur().type == Tok::kName) {
          auto a = make(ExprKind::kGetAttr, line);
          a->name = next().text;
          a->kids.push_back(std::move(e));
          e = std::move(a);
        } else if (cur().type == Tok::kInt) {
          auto a = make(ExprKind::kGetItem, line);
          a->kids.push_back(std::move(e));
          a->kids.push_back(constant(next().value, line));
          e = std::move(a);
        } else {
          fail("expected name or number", line);
        }
      } else if (is_op("[")) {
        int line = next().line;
        e = parse_subscript(std::move(e), line);
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr obj, int line) {
    // [a], [a:b], [a:b:c] with any part left out
    ExprPtr parts[3];
    int n = 0;
    bool slice = false;
    while (true) {
      if (is_op("]")) break;
      if (is_op(":")) {
        ++pos_;
        slice = true;
        ++n;
        if (n > 2) fail("expected ']'", cur().line);
        continue;
      }
      if (parts[n]) fail("expected ':' or ']', got " + quoted(cur()), cur().line);
      parts[n] = parse_expression();
    }
    expect_op("]");
    if (!slice) {
      if (!parts[0]) fail("expected subscript expression", line);
      auto g = make(ExprKind::kGetItem, line);
      g->kids.push_back(std::move(obj));
      g->kids.push_back(std::move(parts[0]));
      return g;
    }
    auto s = make(ExprKind::kSlice, line);
    s->kids.push_back(std::move(obj));
    for (auto& p : parts) s->kids.push_back(std::move(p));
    return s;
  }

  // Arguments in parentheses, appended to e's kids and arg_names.
  void parse_args(Expr& e) {
    expect_op("(");
    bool first = true;
    while (!skip_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (skip_op(")")) break;
      if (cur().type == Tok::kName && peek().type == Tok::kOp && peek().text == "=") {
        e.arg_names.push_back(next().text);
        ++pos_;
      } else {
        e.arg_names.push_back("");
      }
      e.kids.push_back(parse_expression());
    }
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto c = make(ExprKind::kCall, cur().line);
    c->kids.push_back(std::move(callee));
    c->arg_names.push_back("");
    parse_args(*c);
    return c;
  }

  // One or more filters after a `|` (already consumed); `value` may be null (filter blocks).
  ExprPtr parse_filter_chain(ExprPtr value) {
    while (true) {
      int line = cur().line;
      auto f = make(ExprKind::kFilter, line);
      f->name = expect_name();
      while (skip_op(".")) f->name += "." + expect_name();
      f->kids.push_back(std::move(value));
      f->arg_names.push_back("");
      if (is_op("(")) parse_args(*f);
      value = std::move(f);
      if (!skip_op("|")) return value;
    }
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (skip_op("|")) {
        e = parse_filter_chain(std::move(e));
      } else if (is_name("is")) {
        int line = next().line;
        auto t = make(ExprKind::kTest, line);
        t->negated = skip_name("not");
        t->name = expect_name();
        while (skip_op(".")) t->name += "." + expect_name();
        t->kids.push_back(std::move(e));
        t->arg_names.push_back("");
        if (is_op("(")) {
          parse_args(*t);
        } else if ((cur().type == Tok::kName || cur().type == Tok::kString || cur().type == Tok::kInt ||
                    cur().type == Tok::kFloat || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          // jinja2 reads `x is divisibleby 3`, `x is sameas none`
          if (is_name("is")) fail("You cannot chain multiple tests with is", cur().line);
          t->arg_names.push_back("");
          t->kids.push_back(parse_postfix(parse_primary()));
        }
        e = std::move(t);
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  std::vector<Token> toks_;
  std::size_t pos_ = 0;
  std::vector<std::string> open_;  // blocks being parsed, innermost last
  int nesting_ = 0;
  static constexpr int kMaxNesting = 200;
};

}  // namespace

std::shared_ptr<Program> parse(const std::string& source) {
  return Parser(lex(source)).run();
}

}  // namespace wick::jinja::detail
