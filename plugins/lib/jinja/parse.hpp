#pragma once
// A template's syntax tree and the parser that builds it from the tokens
// (lexer.hpp), with jinja2's grammar and its messages for syntax errors.

#include <memory>
#include <string>
#include <vector>

#include "lib/jinja/value.hpp"

namespace wick::jinja::detail {

enum class ExprKind {
  kConst, kName, kGetAttr, kGetItem, kSlice, kCall, kFilter, kTest, kNeg, kPos, kNot, kAnd, kOr,
  kBinary, kCompare, kCondition, kList, kTuple, kDict
};

struct Expr {
  ExprKind kind;
  int line = 0;
  Value value;                // kConst
  std::string name;           // kName, kGetAttr, kFilter and kTest's name, kBinary's operator
  std::vector<std::unique_ptr<Expr>> kids;   // operands; a call's callee then its arguments
  std::vector<std::string> arg_names;        // kCall/kFilter/kTest: "" for a positional argument
  std::vector<std::string> ops;              // kCompare: the operators between kids
  bool negated = false;       // kTest: `is not`
};
using ExprPtr = std::unique_ptr<Expr>;

enum class StmtKind { kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kCallBlock, kBreak, kContinue, kGeneration,
                      kFilterBlock };

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Stmt {
  StmtKind kind;
  int line = 0;
  std::string text;                       // kText
  ExprPtr expr;                           // kOutput, kSet's value, kFor's iterable, kFilterBlock's filter
  std::vector<ExprPtr> conditions;        // kIf: one per branch
  std::vector<Body> bodies;               // kIf: one per branch (+ else); kFor: body (+ else)
  std::vector<std::string> targets;       // kFor, kSet: names (several unpack a tuple)
  std::string attr;                       // kSet on `ns.attr`
  ExprPtr filter;                         // kFor's `if` condition
  std::vector<std::string> params;        // kMacro
  std::vector<ExprPtr> defaults;          // kMacro: one per param (null when none)
  std::string name;                       // kMacro
  bool recursive = false;
};

struct Program {
  Body body;
};

/// Parses a template; throws TemplateError naming the line and what was expected.
std::shared_ptr<Program> parse(const std::string& source);

}  // namespace wick::jinja::detail
