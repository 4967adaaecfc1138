// parse_arg_value: the one rule for the type of a command-line key=value.

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "util/args.hpp"

namespace wick {
namespace {

void expect_string(const std::string& text) {
  const Value v = parse_arg_value(text);
  ASSERT_TRUE(v.is_string()) << "'" << text << "' read as " << v.type_name() << " " << v.repr();
  EXPECT_EQ(v.as_string(), text);
}

void expect_int(const std::string& text, std::int64_t want) {
  const Value v = parse_arg_value(text);
  ASSERT_TRUE(v.is_int()) << "'" << text << "' read as " << v.type_name() << " " << v.repr();
  EXPECT_EQ(v.as_int(), want) << text;
}

void expect_double(const std::string& text, double want) {
  const Value v = parse_arg_value(text);
  ASSERT_TRUE(v.is_number() && !v.is_int()) << "'" << text << "' read as " << v.type_name() << " " << v.repr();
  EXPECT_EQ(v.as_number(), want) << text;  // exact: the nearest double, as a compiler reads the literal
}

TEST(ArgValue, TrueAndFalseAreBooleans) {
  ASSERT_TRUE(parse_arg_value("true").is_bool());
  EXPECT_TRUE(parse_arg_value("true").as_bool());
  ASSERT_TRUE(parse_arg_value("false").is_bool());
  EXPECT_FALSE(parse_arg_value("false").as_bool());
  for (const char* s : {"True", "FALSE", "yes", "1 ", "on"}) expect_string(s);
}

TEST(ArgValue, PlainDecimalIntegersAreIntegers) {
  expect_int("0", 0);
  expect_int("42", 42);
  expect_int("-7", -7);
  expect_int("+7", 7);
  expect_int("007", 7);  // decimal, never octal
  expect_int("9223372036854775807", std::numeric_limits<std::int64_t>::max());
  expect_int("-9223372036854775808", std::numeric_limits<std::int64_t>::min());
}

TEST(ArgValue, AnIntegerBeyondInt64IsANumber) {
  expect_double("9223372036854775808", 9223372036854775808.0);
  expect_double("-100000000000000000000", -1e20);
}

TEST(ArgValue, PlainDecimalNumbersAreNumbers) {
  expect_double("0.5", 0.5);
  expect_double("-2.25", -2.25);
  expect_double("+2.25", 2.25);
  expect_double(".5", 0.5);
  expect_double("1.", 1.0);
  expect_double("3e-4", 3e-4);
  expect_double("1E5", 1e5);
  expect_double("1e+5", 1e5);
  expect_double("2.5e3", 2500.0);
  expect_double("0.1", 0.1);
}

TEST(ArgValue, NanInfinityAndHexStayStrings) {
  for (const char* s : {"nan", "NaN", "-nan", "inf", "-inf", "Infinity", "0x10", "0X1p3", "0b101"}) expect_string(s);
}

TEST(ArgValue, NumbersWithAnythingAroundThemStayStrings) {
  for (const char* s : {"1e5x", "12abc", " 1", "1 ", "1\n", "1_000", "1,5", "1.2.3", "1e", "1e+", "e5", ".", "-", "+",
                        "--1", "+-1", "1..2", "1e5.0", "5%", "10GiB"})
    expect_string(s);
}

TEST(ArgValue, NumbersADoubleCannotHoldStayStrings) {
  expect_string("1e999");
  expect_string("-1e999");
  expect_string("1e-999");
}

TEST(ArgValue, EmptyAndPlainWordsStayStrings) {
  for (const char* s : {"", "cosine", "runs/a", "bf16-mixed", "relu"}) expect_string(s);
}

}  // namespace
}  // namespace wick
