#pragma once
// Python's str operations on UTF-8, by code point: whitespace as
// str.isspace() sees it, case mapping through utf8proc.

#include <cstdint>
#include <string>
#include <vector>

namespace wick::jinja::detail {

std::vector<char32_t> decode(const std::string& s);
std::string encode(const std::vector<char32_t>& cps);
void append_utf8(std::string& out, char32_t cp);

bool is_space(char32_t cp);
bool is_alpha(char32_t cp);
bool is_cased(char32_t cp);
std::string to_upper(const std::string& s);
std::string to_lower(const std::string& s);
/// str.capitalize(): the first character in title case, the rest lower.
std::string capitalize(const std::string& s);
/// str.title(): a cased character after an uncased one starts a word.
std::string title(const std::string& s);

/// str.strip(chars) (whitespace when `chars` is null).
std::string strip(const std::string& s, const std::string* chars, bool left, bool right);

}  // namespace wick::jinja::detail
