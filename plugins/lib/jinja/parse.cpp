#include "lib/jinja/parse.hpp"

#include <cctype>
#include <cstdint>
#include <cstdlib>

#include "lib/jinja/jinja.hpp"

namespace wick::jinja::detail {
namespace {

enum class Tok { kData, kBlockBegin, kBlockEnd, kVarBegin, kVarEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type;
  std::string text;
  int line;
  Value value;  // kString, kInt, kFloat
};

[[noreturn]] void fail(const std::string& message, int line) {
  throw TemplateError("line " + std::to_string(line) + ": " + message, line);
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

// The body of a string literal, its escapes decoded as Python's
// "unicode-escape" codec decodes them (what jinja2's lexer applies).
std::string unescape(const std::string& s, int line) {
  std::string out;
  for (std::size_t k = 0; k < s.size(); ++k) {
    if (s[k] != '\\' || k + 1 == s.size()) {
      out += s[k];
      continue;
    }
    char c = s[++k];
    auto hex = [&](int n) {
      if (k + n >= s.size()) fail("truncated escape in a string", line);
      std::uint32_t cp = std::strtoul(s.substr(k + 1, n).c_str(), nullptr, 16);
      k += n;
      return cp;
    };
    switch (c) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'v': out += '\v'; break;
      case '0': out += '\0'; break;
      case '\n': break;
      case 'x': append_utf8(out, hex(2)); break;
      case 'u': append_utf8(out, hex(4)); break;
      case 'U': append_utf8(out, hex(8)); break;
      default: out += '\\'; out += c;
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(normalize(std::move(source))) {}

  std::vector<Token> run() {
    std::size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      std::size_t open = find_tag(pos);
      std::string text = src_.substr(pos, open - pos);
      if (open == src_.size()) {
        emit_data(text);
        break;
      }
      char type = src_[open + 1];  // '%', '{' or '#'
      char sign = open + 2 < src_.size() ? src_[open + 2] : 0;
      if (sign == '-') {
        std::size_t e = text.size();
        while (e > 0 && is_space(text[e - 1])) --e;
        line_ += count_newlines(text.substr(e));
        text.resize(e);
      } else if (sign != '+' && type != '{') {
        std::size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if (l_pos > 0 || line_starting) {
          bool ws = l_pos < text.size();
          for (std::size_t k = l_pos; k < text.size(); ++k)
            if (!is_space(text[k])) ws = false;
          if (ws) text.resize(l_pos);
        }
      }
      emit_data(text);
      pos = open + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (type == '#') {
        std::size_t close = src_.find("#}", pos);
        if (close == std::string::npos) fail("Missing end of comment tag", line_);
        bool strip = close > pos && src_[close - 1] == '-';
        line_ += count_newlines(src_.substr(pos, close - pos));
        pos = finish_tag(close + 2, strip, /*trim=*/true, line_starting);
        continue;
      }
      if (type == '%' && is_raw(pos)) {
        pos = lex_raw(pos, line_starting);
        continue;
      }
      out_.push_back({type == '%' ? Tok::kBlockBegin : Tok::kVarBegin, "", line_, {}});
      pos = lex_tag(pos, type == '%', line_starting);
    }
    out_.push_back({Tok::kEof, "", line_, {}});
    return std::move(out_);
  }

 private:
  static std::string normalize(std::string s) {
    std::string out;
    out.reserve(s.size());
    for (std::size_t k = 0; k < s.size(); ++k) {
      if (s[k] == '\r') {
        out += '\n';
        if (k + 1 < s.size() && s[k + 1] == '\n') ++k;
      } else {
        out += s[k];
      }
    }
    if (!out.empty() && out.back() == '\n') out.pop_back();  // keep_trailing_newline=False
    return out;
  }

  static int count_newlines(const std::string& s) {
    int n = 0;
    for (char c : s) n += c == '\n';
    return n;
  }

  std::size_t find_tag(std::size_t pos) const {
    for (std::size_t k = pos; k + 1 < src_.size(); ++k)
      if (src_[k] == '{' && (src_[k + 1] == '%' || src_[k + 1] == '{' || src_[k + 1] == '#')) return k;
    return src_.size();
  }

  void emit_data(const std::string& text) {
    if (text.empty()) return;
    out_.push_back({Tok::kData, text, line_, {}});
    line_ += count_newlines(text);
  }

  // After a tag's closing characters: `-` strips all whitespace, otherwise a
  // block or comment drops one newline (trim_blocks) unless it ends in `+`.
  std::size_t finish_tag(std::size_t pos, bool strip, bool trim, bool& line_starting) {
    line_starting = false;
    if (strip) {
      while (pos < src_.size() && is_space(src_[pos])) {
        line_starting = src_[pos] == '\n';
        line_ += src_[pos] == '\n';
        ++pos;
      }
    } else if (trim && pos < src_.size() && src_[pos] == '\n') {
      ++line_;
      ++pos;
      line_starting = true;
    }
    return pos;
  }

  bool is_raw(std::size_t pos) const {
    std::size_t k = pos;
    while (k < src_.size() && is_space(src_[k])) ++k;
    return src_.compare(k, 3, "raw") == 0 && (k + 3 >= src_.size() || !std::isalnum((unsigned char)src_[k + 3]));
  }

  std::size_t lex_raw(std::size_t pos, bool& line_starting) {
    std::size_t close = src_.find("%}", pos);
    if (close == std::string::npos) fail("unexpected end of template inside a raw block", line_);
    bool strip = src_[close - 1] == '-';
    pos = finish_tag(close + 2, strip, src_[close - 1] != '+', line_starting);
    // find {% endraw %}
    for (std::size_t k = pos; k < src_.size(); ++k) {
      if (src_.compare(k, 2, "{%") != 0) continue;
      std::size_t j = k + 2;
      bool lstrip = j < src_.size() && src_[j] == '-';
      if (j < src_.size() && (src_[j] == '-' || src_[j] == '+')) ++j;
      while (j < src_.size() && is_space(src_[j])) ++j;
      if (src_.compare(j, 6, "endraw") != 0) continue;
      j += 6;
      while (j < src_.size() && is_space(src_[j])) ++j;
      bool rstrip = j < src_.size() && src_[j] == '-';
      if (j < src_.size() && (src_[j] == '-' || src_[j] == '+')) ++j;
      if (src_.compare(j, 2, "%}") != 0) continue;
      std::string text = src_.substr(pos, k - pos);
      if (lstrip)
        while (!text.empty() && is_space(text.back())) text.pop_back();
      emit_data(text);
      return finish_tag(j + 2, rstrip, src_[j - 1] != '+', line_starting);
    }
    fail("Missing end of raw directive", line_);
  }

  std::size_t lex_tag(std::size_t pos, bool block, bool& line_starting) {
    std::vector<char> balance;
    const char* end = block ? "%}" : "}}";
    while (true) {
      while (pos < src_.size() && is_space(src_[pos])) {
        line_ += src_[pos] == '\n';
        ++pos;
      }
      if (pos >= src_.size()) fail(std::string("unexpected end of template, expected '") + end + "'", line_);
      char c = src_[pos];
      if (balance.empty()) {
        bool sign = (c == '-' || c == '+') && src_.compare(pos + 1, 2, end) == 0;
        if (sign || src_.compare(pos, 2, end) == 0) {
          out_.push_back({block ? Tok::kBlockEnd : Tok::kVarEnd, "", line_, {}});
          std::size_t after = pos + (sign ? 3 : 2);
          return finish_tag(after, sign && c == '-', block && !(sign && c == '+'), line_starting);
        }
      }
      if (std::isalpha((unsigned char)c) || c == '_') {
        std::size_t k = pos;
        while (k < src_.size() && (std::isalnum((unsigned char)src_[k]) || src_[k] == '_')) ++k;
        out_.push_back({Tok::kName, src_.substr(pos, k - pos), line_, {}});
        pos = k;
      } else if (std::isdigit((unsigned char)c)) {
        std::size_t k = pos;
        bool is_float = false;
        while (k < src_.size() && (std::isdigit((unsigned char)src_[k]) || src_[k] == '_')) ++k;
        if (k + 1 < src_.size() && src_[k] == '.' && std::isdigit((unsigned char)src_[k + 1])) {
          is_float = true;
          ++k;
          while (k < src_.size() && (std::isdigit((unsigned char)src_[k]) || src_[k] == '_')) ++k;
        }
        if (k < src_.size() && (src_[k] == 'e' || src_[k] == 'E')) {
          std::size_t j = k + 1;
          if (j < src_.size() && (src_[j] == '+' || src_[j] == '-')) ++j;
          if (j < src_.size() && std::isdigit((unsigned char)src_[j])) {
            is_float = true;
            k = j;
            while (k < src_.size() && std::isdigit((unsigned char)src_[k])) ++k;
          }
        }
        std::string text;
        for (std::size_t j = pos; j < k; ++j)
          if (src_[j] != '_') text += src_[j];
        Token t{is_float ? Tok::kFloat : Tok::kInt, text, line_, {}};
        t.value = is_float ? Value::real(std::strtod(text.c_str(), nullptr))
                           : Value::integer(std::strtoll(text.c_str(), nullptr, 10));
        out_.push_back(std::move(t));
        pos = k;
      } else if (c == '\'' || c == '"') {
        std::size_t k = pos + 1;
        while (k < src_.size() && src_[k] != c) k += src_[k] == '\\' ? 2 : 1;
        if (k >= src_.size()) fail("unexpected end of string", line_);
        std::string raw = src_.substr(pos + 1, k - pos - 1);
        Token t{Tok::kString, raw, line_, {}};
        t.value = Value::string(unescape(raw, line_));
        out_.push_back(std::move(t));
        line_ += count_newlines(raw);
        pos = k + 1;
      } else {
        static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">",
                                     "=", ".", ",", ":", "|", "(", ")", "[", "]", "{", "}"};
        std::string op;
        for (const char* o : kOps)
          if (src_.compare(pos, std::char_traits<char>::length(o), o) == 0) {
            op = o;
            break;
          }
        if (op.empty()) fail(std::string("unexpected char '") + c + "'", line_);
        if (op == "(" || op == "[" || op == "{") {
          balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
        } else if (op == ")" || op == "]" || op == "}") {
          if (balance.empty()) fail("unexpected '" + op + "'", line_);
          if (balance.back() != op[0])
            fail("unexpected '" + op + "', expected '" + std::string(1, balance.back()) + "'", line_);
          balance.pop_back();
        }
        out_.push_back({Tok::kOp, op, line_, {}});
        pos += op.size();
      }
    }
  }

  std::string src_;
  std::vector<Token> out_;
  int line_ = 1;
};

// jinja2's describe_token: a name or an operator as itself, else the token's kind.
std::string describe(const Token& t) {
  switch (t.type) {
    case Tok::kData: return "template data / text";
    case Tok::kBlockBegin: return "begin of statement block";
    case Tok::kBlockEnd: return "end of statement block";
    case Tok::kVarBegin: return "begin of print statement";
    case Tok::kVarEnd: return "end of print statement";
    case Tok::kEof: return "end of template";
    case Tok::kString: return "string";
    case Tok::kInt: return "integer";
    case Tok::kFloat: return "float";
    default: return t.text;
  }
}

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
  return Parser(Lexer(source).run()).run();
}

}  // namespace wick::jinja::detail
