// wick.train's schema (train/run_options.cpp): the ranges, open bounds,
// choices and forms each option declares, the enums behind the choices, and
// the rules between options, as the errors a recipe sees name them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../../test_util.hpp"
#include "train/run_options.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

using Given = std::map<std::string, Value>;

std::string error_of(const Given& given, const std::vector<std::string>& objects = {}, bool trainer_only = false) {
  return test::error_of([&] { validate_run_options("wick.train", given, objects, trainer_only); });
}

TEST(RunOptionsSchema, InclusiveRangesTakeTheirBoundsAndRefuseBeyond) {
  EXPECT_EQ(error_of({{"memory_fraction", Value(1.0)}}), "");
  EXPECT_EQ(error_of({{"memory_fraction", Value(0.0)}}), "");
  EXPECT_THAT(error_of({{"memory_fraction", Value(1.5)}}),
              HasSubstr("wick.train: option 'memory_fraction': expected a value in [0, 1], got number 1.5"));
  EXPECT_THAT(error_of({{"epochs", Value(0)}}), HasSubstr("option 'epochs': expected a value >= 1, got integer 0"));
  EXPECT_THAT(error_of({{"keep_checkpoints", Value(0)}, {"out", Value("runs/x")}}),
              HasSubstr("option 'keep_checkpoints': expected a value >= 1"));
}

TEST(RunOptionsSchema, OpenBoundsRefuseTheBoundItself) {
  // ema in [0, 1): a decay of 1 would never move the average
  EXPECT_THAT(error_of({{"ema", Value(1.0)}}), HasSubstr("option 'ema': expected a value in [0, 1), got number 1"));
  EXPECT_EQ(error_of({{"ema", Value(0.999)}}), "");
  // loss_scale_backoff in (0, 1): both ends excluded
  for (double bad : {0.0, 1.0})
    EXPECT_THAT(error_of({{"loss_scale_backoff", Value(bad)}}),
                HasSubstr("option 'loss_scale_backoff': expected a value in (0, 1)"))
        << bad;
  EXPECT_EQ(error_of({{"loss_scale_backoff", Value(0.25)}}), "");
}

TEST(RunOptionsSchema, NumbersMustBeFinite) {
  EXPECT_THAT(error_of({{"clip_grad_norm", Value(std::nan(""))}}),
              HasSubstr("option 'clip_grad_norm': expected a finite number"));
  EXPECT_THAT(error_of({{"clip_grad_norm", Value(INFINITY)}}),
              HasSubstr("option 'clip_grad_norm': expected a finite number"));
}

TEST(RunOptionsSchema, ChoicesAreNamedWhenRefused) {
  EXPECT_THAT(error_of({{"precision", Value("fp8")}}),
              HasSubstr("option 'precision': expected one of fp32, bf16-mixed, fp16-mixed, bf16-true, fp16-true, got "
                        "string \"fp8\""));
  EXPECT_THAT(error_of({{"shard", Value("zero3")}}), HasSubstr("option 'shard': expected one of none, optimizer, "
                                                               "gradients, parameters"));
  EXPECT_EQ(error_of({{"shard", Value("parameters")}}), "");
}

TEST(RunOptionsSchema, EachFormOfAnOptionIsTakenAndAWrongTypeNamesThemAll) {
  const Options o = validate_run_options("wick.train", {{"micro_batch", Value("auto")}, {"batch_size", Value(32)}});
  EXPECT_EQ(o.at("micro_batch").as_string(), "auto");
  const Options k = validate_run_options("wick.train", {{"checkpointing", Value(2)}});
  EXPECT_EQ(k.at("checkpointing").as_int(), 2);
  EXPECT_THAT(error_of({{"micro_batch", Value(true)}}),
              HasSubstr("option 'micro_batch': expected integer or string, got boolean true"));
  // a fraction is no micro-batch: refused, never truncated
  EXPECT_THAT(error_of({{"micro_batch", Value(2.5)}}), HasSubstr("option 'micro_batch'"));
}

TEST(RunOptionsSchema, AbsentOptionalOptionsStayNilAndDefaultsAreFilled) {
  const Options o = validate_run_options("wick.train", {});
  EXPECT_TRUE(o.at("out").is_nil());
  EXPECT_EQ(o.at("precision").as_string(), "fp32");
  EXPECT_EQ(o.at("keep_checkpoints").as_int(), 3);
}

TEST(RunOptionsRules, AutomaticMicroBatchAndBatchSizeGoTogether) {
  EXPECT_THAT(error_of({{"micro_batch", Value("auto")}}),
              HasSubstr("option 'micro_batch': 'auto' needs batch_size"));
  EXPECT_THAT(error_of({{"micro_batch", Value(4)}, {"batch_size", Value(32)}}),
              HasSubstr("option 'batch_size' goes with micro_batch = 'auto'"));
  EXPECT_THAT(error_of({{"micro_batch", Value("auto")}, {"batch_size", Value(32)}, {"accumulate", Value(2)}}),
              HasSubstr("option 'accumulate' goes with a micro_batch given"));
}

TEST(RunOptionsRules, RunFolderOptionsNeedOutAndResumeExcludesOverwrite) {
  EXPECT_THAT(error_of({{"resume", Value(true)}}), HasSubstr("option 'resume' needs 'out'"));
  EXPECT_THAT(error_of({{"overwrite", Value(true)}}), HasSubstr("option 'overwrite' needs 'out'"));
  EXPECT_THAT(error_of({{"save_every", Value(10)}}), HasSubstr("option 'save_every' needs 'out'"));
  EXPECT_THAT(error_of({{"out", Value("runs/a")}, {"resume", Value(true)}, {"overwrite", Value(true)}}),
              HasSubstr("options 'resume' and 'overwrite' exclude each other"));
  EXPECT_THAT(error_of({{"out", Value("")}}), HasSubstr("option 'out': expected a run folder's path, got \"\""));
  EXPECT_EQ(error_of({{"out", Value("runs/a")}, {"resume", Value(true)}, {"save_every", Value(10)}}), "");
}

TEST(RunOptionsRules, ReturningTheWeightsInAFileNeedsOutAndDividedWeights) {
  EXPECT_THAT(error_of({{"return_weights", Value("file")}, {"shard", Value("parameters")}}),
              HasSubstr("option 'return_weights': \"file\" needs 'out'"));
  EXPECT_THAT(error_of({{"return_weights", Value("file")}, {"out", Value("runs/a")}, {"shard", Value("gradients")}}),
              HasSubstr("option 'return_weights': \"file\" is for shard = \"parameters\" (the weights divided); with "
                        "shard = \"gradients\" every rank holds them whole already"));
  EXPECT_THAT(error_of({{"return_weights", Value("disk")}}),
              HasSubstr("option 'return_weights': expected one of"));
  EXPECT_EQ(error_of({{"return_weights", Value("file")}, {"out", Value("runs/a")}, {"shard", Value("parameters")}}), "");
}

TEST(RunOptionsRules, MonitorNeedsEvalDataAndOutAndItsCompanionsNeedMonitor) {
  EXPECT_THAT(error_of({{"monitor", Value("eval_loss")}, {"out", Value("runs/a")}}),
              HasSubstr("option 'monitor' needs 'eval_data'"));
  EXPECT_THAT(error_of({{"monitor", Value("eval_loss")}}, {"eval_data"}), HasSubstr("option 'monitor' needs 'out'"));
  EXPECT_THAT(error_of({{"monitor_mode", Value("max")}}), HasSubstr("option 'monitor_mode' needs 'monitor'"));
  EXPECT_THAT(error_of({{"keep_best", Value(2)}}), HasSubstr("option 'keep_best' needs 'monitor'"));
  EXPECT_THAT(error_of({{"monitor", Value("eval_loss")}, {"out", Value("runs/a")}, {"patience", Value(2)}}, {"eval_data"}),
              HasSubstr("option 'patience' needs eval_every > 0"));
  EXPECT_EQ(error_of({{"monitor", Value("eval_loss")}, {"out", Value("runs/a")}, {"patience", Value(2)},
                      {"eval_every", Value(5)}},
                     {"eval_data"}),
            "");
}

TEST(RunOptionsRules, EmaCompanionsNeedEma) {
  EXPECT_THAT(error_of({{"ema_start", Value(10)}}), HasSubstr("option 'ema_start' needs 'ema'"));
  EXPECT_THAT(error_of({{"eval_ema", Value(true)}}), HasSubstr("option 'eval_ema' needs 'ema'"));
  EXPECT_EQ(error_of({{"ema", Value(0.99)}, {"ema_start", Value(10)}, {"eval_ema", Value(true)}}), "");
}

TEST(RunOptionsRules, TrainerRulesHoldForWickTrainerToo) {
  for (bool trainer_only : {false, true}) {
    EXPECT_THAT(error_of({{"master_weights", Value(true)}}, {}, trainer_only),
                HasSubstr("option 'master_weights': only with precision = \"bf16-true\" or \"fp16-true\" (fp32 weights "
                          "are fp32 already)"));
    EXPECT_THAT(error_of({{"shard", Value("optimizer")}, {"sync", Value("micro_batch")}}, {}, trainer_only),
                HasSubstr("option 'sync': shard = \"optimizer\": gradients are reduce-scattered once per window"));
    EXPECT_THAT(error_of({{"offload_activations", Value(true)}, {"checkpointing", Value(false)}}, {}, trainer_only),
                HasSubstr("option 'offload_activations': it moves the checkpointed blocks' inputs to host memory, and "
                          "checkpointing is false"));
    EXPECT_THAT(error_of({{"precision", Value("bf16-true")}, {"master_weights", Value(true)}, {"sync", Value("micro_batch")}},
                         {}, trainer_only),
                HasSubstr("option 'sync': master_weights: gradients are summed in fp32 over the window"));
  }
  EXPECT_EQ(error_of({{"precision", Value("bf16-true")}, {"master_weights", Value(true)}}), "");
}

TEST(RunOptionsRules, RunRulesAreNotWickTrainersConcern) {
  // wick.trainer has no run folder or batch finder: their rules stay wick.train's
  EXPECT_THAT(error_of({{"out", Value("runs/a")}}, {}, true), HasSubstr("unknown option 'out'"));
  EXPECT_EQ(error_of({{"total_steps", Value(3)}}, {}, true), "");
}

TEST(RunOptionsLoader, TakesTheRunsDeclarationsWithAWholeMicroBatchOnly) {
  const auto loader_error = [](const Given& g) {
    return test::error_of([&] { validate_loader_options("wick.loader", g); });
  };
  EXPECT_THAT(loader_error({{"micro_batch", Value(2.5)}}), HasSubstr("wick.loader: option 'micro_batch'"));
  EXPECT_THAT(loader_error({{"micro_batch", Value("auto")}}), HasSubstr("wick.loader: option 'micro_batch'"));
  EXPECT_THAT(loader_error({{"epochs", Value(2)}}), HasSubstr("wick.loader: unknown option 'epochs'"));
  EXPECT_THAT(loader_error({{"world_size", Value(0)}}), HasSubstr("option 'world_size': expected a value"));
  const Options o = validate_loader_options("wick.loader", {{"micro_batch", Value(3)}});
  EXPECT_EQ(o.at("micro_batch").as_int(), 3);
  EXPECT_TRUE(o.at("rank").is_nil());
}

TEST(RunOptionsConfig, TrainerConfigBuiltInCppIsCheckedByTheSchema) {
  TrainerConfig c;
  c.memory_fraction = 1.5;
  EXPECT_THAT(test::error_of([&] { check_trainer_config(c); }),
              HasSubstr("TrainerConfig: option 'memory_fraction': expected a value in [0, 1]"));
  c = TrainerConfig{};
  c.ema = 1.0;
  EXPECT_THAT(test::error_of([&] { check_trainer_config(c); }), HasSubstr("TrainerConfig: option 'ema'"));
  EXPECT_EQ(test::error_of([&] { check_trainer_config(TrainerConfig{}); }), "");
}

// The choices are the enums' names (one table each) and read back as their values.
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
