#pragma once
// A template's tokens, lexed as jinja2 lexes with trim_blocks and
// lstrip_blocks: newlines normalised and one trailing newline dropped, text
// between tags with `-`, `+` and the two options applied, comments and raw
// blocks resolved, and the expressions inside tags split into tokens.

#include <string>
#include <vector>

#include "lib/jinja/value.hpp"

namespace wick::jinja::detail {

enum class Tok { kData, kBlockBegin, kBlockEnd, kVarBegin, kVarEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type;
  std::string text;
  int line;
  Value value;  // kString, kInt, kFloat
};

std::vector<Token> lex(const std::string& source);

/// Throws the TemplateError of a syntax error at `line`.
[[noreturn]] void fail(const std::string& message, int line);
/// jinja2's describe_token: a name or an operator as itself, else the token's kind.
std::string describe(const Token& t);

}  // namespace wick::jinja::detail
