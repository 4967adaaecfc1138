#include "lib/jinja/lexer.hpp"
#include "lib/jinja/text.hpp"

#include <cctype>
#include <cstdint>
#include <cstdlib>

#include "lib/jinja/jinja.hpp"

namespace wick::jinja::detail {

[[noreturn]] void fail(const std::string& message, int line) {
  throw TemplateError("line " + std::to_string(line) + ": " + message, line);
}

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

namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

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
      case 'x': append_utf8(out, static_cast<char32_t>(hex(2))); break;
      case 'u': append_utf8(out, static_cast<char32_t>(hex(4))); break;
      case 'U': append_utf8(out, static_cast<char32_t>(hex(8))); break;
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
        pos = lex_name(pos);
      } else if (std::isdigit((unsigned char)c)) {
        pos = lex_number(pos);
      } else if (c == '\'' || c == '"') {
        pos = lex_string(pos);
      } else {
        pos = lex_operator(pos, balance);
      }
    }
  }

  // The token at pos, each returning the position after it.
  std::size_t lex_name(std::size_t pos) {
    std::size_t k = pos;
    while (k < src_.size() && (std::isalnum((unsigned char)src_[k]) || src_[k] == '_')) ++k;
    out_.push_back({Tok::kName, src_.substr(pos, k - pos), line_, {}});
    return k;
  }

  std::size_t skip_digits(std::size_t k, bool underscores) const {
    while (k < src_.size() && (std::isdigit((unsigned char)src_[k]) || (underscores && src_[k] == '_'))) ++k;
    return k;
  }

  std::size_t lex_number(std::size_t pos) {
    bool is_float = false;
    std::size_t k = skip_digits(pos, /*underscores=*/true);
    if (k + 1 < src_.size() && src_[k] == '.' && std::isdigit((unsigned char)src_[k + 1])) {
      is_float = true;
      k = skip_digits(k + 1, /*underscores=*/true);
    }
    if (k < src_.size() && (src_[k] == 'e' || src_[k] == 'E')) {
      std::size_t j = k + 1;
      if (j < src_.size() && (src_[j] == '+' || src_[j] == '-')) ++j;
      if (j < src_.size() && std::isdigit((unsigned char)src_[j])) {
        is_float = true;
        k = skip_digits(j, /*underscores=*/false);
      }
    }
    std::string text;
    for (std::size_t j = pos; j < k; ++j)
      if (src_[j] != '_') text += src_[j];
    Token t{is_float ? Tok::kFloat : Tok::kInt, text, line_, {}};
    t.value = is_float ? Value::real(std::strtod(text.c_str(), nullptr))
                       : Value::integer(std::strtoll(text.c_str(), nullptr, 10));
    out_.push_back(std::move(t));
    return k;
  }

  std::size_t lex_string(std::size_t pos) {
    const char quote = src_[pos];
    std::size_t k = pos + 1;
    while (k < src_.size() && src_[k] != quote) k += src_[k] == '\\' ? 2 : 1;
    if (k >= src_.size()) fail("unexpected end of string", line_);
    std::string raw = src_.substr(pos + 1, k - pos - 1);
    Token t{Tok::kString, raw, line_, {}};
    t.value = Value::string(unescape(raw, line_));
    out_.push_back(std::move(t));
    line_ += count_newlines(raw);
    return k + 1;
  }

  // An operator; brackets must pair (`balance`: the closing ones awaited).
  std::size_t lex_operator(std::size_t pos, std::vector<char>& balance) {
    static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">",
                                 "=", ".", ",", ":", "|", "(", ")", "[", "]", "{", "}"};
    std::string op;
    for (const char* o : kOps)
      if (src_.compare(pos, std::char_traits<char>::length(o), o) == 0) {
        op = o;
        break;
      }
    if (op.empty()) fail(std::string("unexpected char '") + src_[pos] + "'", line_);
    if (op == "(" || op == "[" || op == "{") {
      balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
    } else if (op == ")" || op == "]" || op == "}") {
      if (balance.empty()) fail("unexpected '" + op + "'", line_);
      if (balance.back() != op[0])
        fail("unexpected '" + op + "', expected '" + std::string(1, balance.back()) + "'", line_);
      balance.pop_back();
    }
    out_.push_back({Tok::kOp, op, line_, {}});
    return pos + op.size();
  }

  std::string src_;
  std::vector<Token> out_;
  int line_ = 1;
};

}  // namespace

std::vector<Token> lex(const std::string& source) { return Lexer(source).run(); }

}  // namespace wick::jinja::detail
