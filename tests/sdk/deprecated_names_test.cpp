// The SDK's names that ABI 8 replaced (docs/design/words.md, "number") still
// compile and mean what their new names mean, for plugins written against
// ABI 7, until ABI 9 removes them.
#include <gtest/gtest.h>

#include "wick/options.hpp"

namespace wick {
namespace {

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST(DeprecatedNames, MeanTheirNewNames) {
  static_assert(OptionType::Float == OptionType::Number && OptionType::FloatList == OptionType::NumberList);
  const OptionSpec old_spec = opt_float("lr", 0.5, "a rate").at_least(0);
  const OptionSpec new_spec = opt_number("lr", 0.5, "a rate").at_least(0);
  EXPECT_EQ(old_spec.type, new_spec.type);
  EXPECT_EQ(old_spec.min, new_spec.min);
  const Options o({{"lr", Value(2)}, {"betas", Value(List{Value(0.9), Value(1)})}});
  EXPECT_EQ(o.get_double("lr"), o.get_number("lr"));
  EXPECT_EQ(o.get_double_list("betas"), o.get_number_list("betas"));
  EXPECT_EQ(Value(3).as_double(), 3.0);
}
#pragma GCC diagnostic pop

}  // namespace
}  // namespace wick
