// An enum's strings declared once (wick/kit/enum_names.hpp): parsing,
// printing, choices and the error's list all read the one table.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../test_util.hpp"
#include "wick/kit/enum_names.hpp"

using ::testing::ElementsAre;

namespace wick {
namespace {

enum class Fruit { Apple, Pear, Plum };
constexpr EnumName<Fruit> kFruitNames[] = {{Fruit::Apple, "apple"}, {Fruit::Pear, "pear"}, {Fruit::Plum, "plum"}};
static_assert(enum_names_distinct(kFruitNames));
static_assert(*find_enum(kFruitNames, "pear") == Fruit::Pear);  // a table works at compile time

TEST(EnumNames, EveryNameParsesBackToItsValue) {
  for (const auto& e : kFruitNames) {
    EXPECT_EQ(parse_enum(kFruitNames, e.name, "fruit"), e.value);
    EXPECT_EQ(enum_name(kFruitNames, e.value), e.name);
  }
  EXPECT_FALSE(find_enum(kFruitNames, "Apple"));  // names are exact
}

TEST(EnumNames, ChoicesAndMessagesListTheTableInOrder) {
  EXPECT_THAT(enum_names(kFruitNames), ElementsAre("apple", "pear", "plum"));
  EXPECT_EQ(enum_names_text(kFruitNames), "apple, pear or plum");
  EXPECT_EQ(test::error_of([] { parse_enum(kFruitNames, "fig", "fruit"); }), "fruit: expected apple, pear or plum, got 'fig'");
  EXPECT_EQ(test::error_of([] { parse_enum(kFruitNames, "fig", "fruit", /*quoted=*/true); }),
            "fruit: expected \"apple\", \"pear\" or \"plum\", got 'fig'");
}

TEST(EnumNames, ATableWithANameOrValueTwiceIsRefused) {
  constexpr EnumName<Fruit> twice[] = {{Fruit::Apple, "apple"}, {Fruit::Pear, "apple"}};
  constexpr EnumName<Fruit> value_twice[] = {{Fruit::Apple, "apple"}, {Fruit::Apple, "pear"}};
  static_assert(!enum_names_distinct(twice) && !enum_names_distinct(value_twice));
  SUCCEED();
}

}  // namespace
}  // namespace wick
