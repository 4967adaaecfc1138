#pragma once
// Command-line values: how `key=value` text becomes a typed value, in one
// place, for wick.args and the CLI's own numeric flags.

#include <string>

#include "wick/options.hpp"

namespace wick {

/// The value of a command-line `key=value` pair, by its spelling alone:
///   "true", "false"                    -> boolean
///   a plain decimal integer: [+-]digits -> integer (one beyond int64 is a number)
///   a plain decimal number: [+-], digits with at most one dot, at least one
///   digit, then an optional exponent e[+-]digits (3e-4, .5, 1.) -> number
///   anything else                      -> the string as given
/// So "nan", "inf", "0x10", "1e5x", " 1", "1_000" and numbers a double cannot
/// hold ("1e999", "1e-999") stay strings; nothing depends on the locale.
Value parse_arg_value(const std::string& text);

}  // namespace wick
