// wick.train's schema (train/run_options.hpp) and the enums behind it: each
// choice it offers is a name of the enum's one table and reads back as its
// value, and the rules a constructor used to repeat are the schema's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../../test_util.hpp"
#include "train/run_options.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

std::vector<std::string> choices_of(const std::string& name) {
  for (const auto& o : run_options())
    if (o.name == name) return o.forms.at(0).choices;
  return {};
}

TEST(RunOptionsSchema, ChoicesAreTheEnumsNames) {
  EXPECT_EQ(choices_of("precision"), enum_names(kPrecisionNames));
  EXPECT_EQ(choices_of("shard"), enum_names(kShardModeNames));
  EXPECT_EQ(choices_of("on_oom"), enum_names(kOnOomNames));
  EXPECT_EQ(choices_of("sync"), enum_names(kSyncNames));
}

TEST(RunOptionsSchema, EveryChoiceReachesTheTrainerConfigAndBack) {
  for (const auto& p : kPrecisionNames) {
    const auto c = trainer_config(validate_run_options("wick.trainer", {{"precision", Value(std::string(p.name))}}, {}, true));
    EXPECT_EQ(c.precision, p.value);
    EXPECT_EQ(to_string(c.precision), p.name);
  }
  for (const auto& s : kShardModeNames) {
    const auto c = trainer_config(validate_run_options("wick.trainer", {{"shard", Value(std::string(s.name))}}, {}, true));
    EXPECT_EQ(c.shard, s.value);
    EXPECT_EQ(to_string(c.shard), s.name);
  }
  const auto fail = trainer_config(validate_run_options("wick.trainer", {{"on_oom", Value("fail")}}, {}, true));
  EXPECT_FALSE(fail.split_on_oom);
  EXPECT_NO_THROW(check_trainer_config(fail));
  EXPECT_EQ(test::error_of([] { parse_precision("fp8"); }),
            "precision: expected fp32, bf16-mixed, fp16-mixed, bf16-true or fp16-true, got 'fp8'");
  EXPECT_EQ(test::error_of([] { parse_shard("all"); }),
            "shard: expected \"none\", \"optimizer\", \"gradients\" or \"parameters\", got 'all'");
}

// what the Trainer's constructor checked again, now the schema's alone
TEST(RunOptionsSchema, OffloadingNeedsABlockCheckpointed) {
  TrainerConfig c;
  c.checkpointing.offload = true;
  EXPECT_THAT(test::error_of([&] { check_trainer_config(c); }),
              HasSubstr("TrainerConfig: option 'offload_activations': it moves the checkpointed blocks' inputs to host "
                        "memory, and checkpointing is false"));
  c.checkpointing.mode = CheckpointingConfig::Mode::Names;
  EXPECT_THAT(test::error_of([&] { check_trainer_config(c); }), HasSubstr("and checkpointing names no block"));
  c.checkpointing.mode = CheckpointingConfig::Mode::EveryK;
  c.checkpointing.k = 0;
  EXPECT_THAT(test::error_of([&] { check_trainer_config(c); }),
              HasSubstr("TrainerConfig: option 'checkpointing': expected a value >= 1, got integer 0"));
}

}  // namespace
}  // namespace wick
