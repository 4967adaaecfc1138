#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../../test_util.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

const OptionSchema kSchema = {
    opt_int("width", 8, "layer width").range(1, 1024),
    opt_number("lr", 1e-3, "learning rate").at_least(0),
    opt_string("act", "relu", "activation").one_of({"relu", "gelu"}),
    opt("hidden", OptionType::IntList, List{4, 4}, "widths").at_least(1),
    opt_bool("bias", true, "bias"),
    opt_string("file", Value(), "a file").required(),
};

std::string error_of(std::map<std::string, Value> given) {
  return test::error_of([&] { validate_options("model 'm'", kSchema, given); });
}

TEST(Options, FillsDefaultsAndConvertsNumbers) {
  auto o = validate_options("model 'm'", kSchema, {{"file", Value("a")}, {"lr", Value(1)}});
  EXPECT_EQ(o.get_int("width"), 8);
  EXPECT_DOUBLE_EQ(o.get_number("lr"), 1.0);
  EXPECT_TRUE(o.at("lr").is_number() && !o.at("lr").is_int());  // an integer given for a number is a number
  EXPECT_EQ(o.get_string("act"), "relu");
  EXPECT_EQ(o.get_int_list("hidden"), (std::vector<std::int64_t>{4, 4}));
  EXPECT_TRUE(o.get_bool("bias"));
}

TEST(Options, ASingleValueStandsForAOneItemList) {
  auto o = validate_options("model 'm'", kSchema, {{"file", Value("a")}, {"hidden", Value(16)}});
  EXPECT_EQ(o.get_int_list("hidden"), (std::vector<std::int64_t>{16}));
}

TEST(Options, UnknownKeyNamesPluginKeyAndKnownOptions) {
  auto msg = error_of({{"file", Value("a")}, {"widht", Value(3)}});
  EXPECT_THAT(msg, HasSubstr("model 'm': unknown option 'widht'"));
  EXPECT_THAT(msg, HasSubstr("width, lr, act, hidden, bias, file"));
}

TEST(Options, WrongTypeSaysExpectedAndGiven) {
  EXPECT_THAT(error_of({{"file", Value("a")}, {"width", Value("big")}}),
              HasSubstr("option 'width': expected integer, got string \"big\""));
  EXPECT_THAT(error_of({{"file", Value("a")}, {"width", Value(2.5)}}),
              HasSubstr("option 'width': expected integer, got number 2.5"));
  EXPECT_THAT(error_of({{"file", Value("a")}, {"hidden", Value(List{Value(1), Value("x")})}}),
              HasSubstr("option 'hidden': expected list of integers"));
  EXPECT_THAT(error_of({{"file", Value("a")}, {"bias", Value(1)}}),
              HasSubstr("option 'bias': expected boolean, got integer 1"));
}

TEST(Options, OutOfRangeSaysTheRange) {
  EXPECT_THAT(error_of({{"file", Value("a")}, {"width", Value(0)}}),
              HasSubstr("option 'width': expected a value in [1, 1024], got integer 0"));
  EXPECT_THAT(error_of({{"file", Value("a")}, {"lr", Value(-0.5)}}),
              HasSubstr("option 'lr': expected a value >= 0, got number -0.5"));
  EXPECT_THAT(error_of({{"file", Value("a")}, {"hidden", Value(List{Value(3), Value(0)})}}),
              HasSubstr("option 'hidden': expected a value >= 1"));
}

// above and below exclude their bound (ABI 8): (0, 1], > 0, [0, 1)
TEST(Options, AnOpenEndExcludesItsBound) {
  const OptionSchema schema = {opt_number("p", 1.0, "a share").above(0).at_most(1),
                               opt_number("scale", 1.0, "a scale").above(0),
                               opt_number("decay", 0.0, "a decay").at_least(0).below(1)};
  auto error = [&](const char* key, Value v) {
    return test::error_of([&] { validate_options("model 'm'", schema, {{key, v}}); });
  };
  EXPECT_EQ(error("p", Value(0.0)), "model 'm': option 'p': expected a value in (0, 1], got number 0");
  EXPECT_EQ(error("p", Value(1)), "");
  EXPECT_EQ(error("scale", Value(0)), "model 'm': option 'scale': expected a value > 0, got integer 0");
  EXPECT_EQ(error("decay", Value(1.0)), "model 'm': option 'decay': expected a value in [0, 1), got number 1");
  EXPECT_EQ(error("decay", Value(0)), "");
}

TEST(Options, ChoicesAreListed) {
  EXPECT_THAT(error_of({{"file", Value("a")}, {"act", Value("tanh")}}),
              HasSubstr("option 'act': expected one of relu, gelu, got string \"tanh\""));
}

TEST(Options, RequiredOptionMustBeGiven) {
  EXPECT_THAT(error_of({}), HasSubstr("option 'file' is required"));
}

}  // namespace
}  // namespace wick
