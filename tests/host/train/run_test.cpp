// The engine's run (train/run.hpp) without Lua: it ends where a loop written
// with the step primitives ends, reads numbers from the device only on the
// steps it reports, hands every step to observers in order, and checks its
// options with one schema.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include "../../test_util.hpp"
#include "train/loader.hpp"
#include "train/run.hpp"
#include "train/run_options.hpp"
#include "train/trainer.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

RunRequest request(std::map<std::string, Value> options) {
  at::manual_seed(0);
  RunRequest req;
  req.objects.model = test::make<Model>("mlp", PluginKind::Model,
                                        {{"inputs", Value(8)}, {"hidden", Value(List{Value(16)})}, {"outputs", Value(3)}});
  req.objects.data = test::make<Dataset>("synthetic", PluginKind::Data,
                                         {{"size", Value(160)}, {"inputs", Value(8)}, {"classes", Value(3)}, {"seed", Value(1)}});
  req.objects.optim = registry().create("adamw", PluginKind::Optim, {{"lr", Value(1e-2)}});
  options.emplace("quiet", Value(true));
  req.options = std::move(options);
  return req;
}

struct Counter : Observer {
  int starts = 0, ends = 0;
  std::vector<std::int64_t> steps;
  void on_start(const RunStart&) override { ++starts; }
  void on_step(const nlohmann::json& r) override { steps.push_back(r.at("step").get<std::int64_t>()); }
  void on_end(const nlohmann::json&) override { ++ends; }
};

TEST(Run, EndsAtTheWeightsOfALoopWrittenWithTheStepPrimitives) {
  auto req = request({{"micro_batch", Value(4)}, {"accumulate", Value(2)}, {"epochs", Value(2)}, {"seed", Value(3)}});
  const auto run = run_training(req);
  EXPECT_EQ(run.at("steps").get<std::int64_t>(), 40);

  auto ref = request({});
  at::manual_seed(3);
  TrainerConfig tc;
  tc.total_steps = 40;
  Trainer trainer(ref.objects.model, std::static_pointer_cast<Optimizer>(ref.objects.optim), nullptr, tc);
  LoaderConfig lc;
  lc.micro_batch = 4;
  lc.accumulate = 2;
  lc.seed = 3;
  Loader loader(ref.objects.data, lc);
  double last_loss = 0;
  for (int epoch = 0; epoch < 2; ++epoch) {
    loader.start_epoch(epoch);
    while (auto w = loader.next_window()) last_loss = trainer.step(*w).loss;
  }
  auto a = req.objects.model->parameters(), b = ref.objects.model->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i;
  EXPECT_DOUBLE_EQ(run.at("final_loss").get<double>(), last_loss);
}

TEST(Run, ReadsTheDeviceOnlyOnStepsItReports) {
  // 160 samples in windows of 4 x 2: 20 steps; numbers read at steps 1, 5, 10, 15, 20
  auto run = run_training(request({{"micro_batch", Value(4)}, {"accumulate", Value(2)}, {"log_every", Value(5)}}));
  EXPECT_EQ(run.at("steps").get<std::int64_t>(), 20);
  EXPECT_EQ(run.at("host_reads").get<std::int64_t>(), 5);
  // every step's numbers are still there, read in groups
  ASSERT_EQ(run.at("history").size(), 20u);
  for (const auto& rec : run.at("history")) {
    EXPECT_TRUE(rec.at("loss").is_number()) << rec.dump();
    EXPECT_GT(rec.at("grad_norm").get<double>(), 0) << rec.dump();
  }
  // reading every step costs a read per step
  run = run_training(request({{"micro_batch", Value(4)}, {"accumulate", Value(2)}, {"log_every", Value(1)}}));
  EXPECT_EQ(run.at("host_reads").get<std::int64_t>(), 20);
}

TEST(Run, ObserversSeeEveryStepOnceInOrder) {
  auto req = request({{"micro_batch", Value(8)}, {"max_steps", Value(7)}, {"log_every", Value(3)}});
  auto obs = std::make_shared<Counter>();
  req.observers.push_back(obs);
  run_training(req);
  EXPECT_EQ(obs->starts, 1);
  EXPECT_EQ(obs->ends, 1);
  EXPECT_EQ(obs->steps, (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7}));
}

TEST(Run, CommandLineOverridesAreReadAsTheOptionDeclares) {
  auto req = request({{"micro_batch", Value(8)}, {"accumulate", Value(1)}});
  RunContext context({{"micro_batch", "4"}, {"accumulate", "2"}, {"max_steps", "3"}, {"lr", "nan"}});
  req.context = &context;
  const auto run = run_training(req);
  EXPECT_EQ(run.at("micro_batch").get<std::int64_t>(), 4);
  EXPECT_EQ(run.at("accumulate").get<std::int64_t>(), 2);
  EXPECT_EQ(run.at("steps").get<std::int64_t>(), 3);
  req = request({});
  RunContext bad(std::vector<RunContext::Pair>{{"micro_batch", "0x10"}});
  req.context = &bad;
  EXPECT_THAT(test::error_of([&] { run_training(req); }), HasSubstr("micro_batch=0x10: expected integer >= 1 or string (auto)"));
}

TEST(Run, UnknownOptionsAndMissingObjectsAreErrors) {
  auto req = request({{"epoch", Value(2)}});
  EXPECT_THAT(test::error_of([&] { run_training(req); }), HasSubstr("wick.train: unknown option 'epoch' (known options: model"));
  req = request({});
  req.objects.optim = nullptr;
  EXPECT_THAT(test::error_of([&] { run_training(req); }), HasSubstr("wick.train: option 'optim' is required"));
}

TEST(RunOptions, CommandLineTextParsesByDeclaredForm) {
  EXPECT_EQ(parse_run_option("micro_batch", "4").as_int(), 4);
  EXPECT_EQ(parse_run_option("micro_batch", "auto").as_string(), "auto");
  EXPECT_FALSE(parse_run_option("checkpointing", "false").as_bool());
  EXPECT_EQ(parse_run_option("checkpointing", "3").as_int(), 3);
  const Value names = parse_run_option("checkpointing", "blocks.0,blocks.2");
  ASSERT_TRUE(names.is_list());
  EXPECT_EQ(names.as_list().at(1).as_string(), "blocks.2");
  EXPECT_DOUBLE_EQ(parse_run_option("clip_grad_norm", "1e-3").as_number(), 1e-3);
  for (const char* bad : {"nan", "inf", "0x10", "1.0x", " 1", ""})
    EXPECT_THAT(test::error_of([&] { parse_run_option("clip_grad_norm", bad); }), HasSubstr("expected number >= 0"))
        << bad;
  EXPECT_THAT(test::error_of([&] { parse_run_option("epochs", "2.5"); }), HasSubstr("epochs=2.5: expected integer >= 1"));
  EXPECT_THAT(test::error_of([&] { parse_run_option("lr", "1"); }), HasSubstr("'lr' is not a wick.train option"));
}

TEST(RunOptions, TrainerTakesItsSubsetOnly) {
  EXPECT_THAT(test::error_of([] { validate_run_options("wick.trainer", {{"epochs", Value(2)}}, {}, true); }),
              HasSubstr("wick.trainer: unknown option 'epochs'"));
  EXPECT_THAT(test::error_of([] { validate_run_options("wick.train", {{"total_steps", Value(2)}}); }),
              HasSubstr("wick.train: unknown option 'total_steps'"));
  const Options o = validate_run_options("wick.trainer", {{"total_steps", Value(5)}, {"sync", Value("micro_batch")}}, {}, true);
  const TrainerConfig c = trainer_config(o);
  EXPECT_EQ(c.total_steps, 5);
  EXPECT_TRUE(c.sync_every_micro_batch);
}

TEST(RunOptions, LossScaleTableAndFixedScaleExcludeEachOther) {
  EXPECT_THAT(test::error_of([] {
                validate_run_options("wick.train", {{"loss_scale", Value(8.0)}, {"loss_scale_growth", Value(4.0)}});
              }),
              HasSubstr("option 'loss_scale': a fixed scale and loss_scale_growth (dynamic scaling) exclude each other"));
  const TrainerConfig fixed = trainer_config(validate_run_options("wick.train", {{"loss_scale", Value(8.0)}}));
  EXPECT_FALSE(fixed.loss_scale.dynamic);
  EXPECT_EQ(fixed.loss_scale.init, 8.0);
  const TrainerConfig dyn = trainer_config(validate_run_options("wick.train", {{"loss_scale_interval", Value(7)}}));
  EXPECT_TRUE(dyn.loss_scale.dynamic);
  EXPECT_EQ(dyn.loss_scale.interval, 7);
}


// evaluation runs the training micro-batch, not micro_batch x accumulate
class LargestEval : public Model {
 public:
  LargestEval() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
    w_ = register_parameter("w", at::randn({8, 3}, gen));
  }
  ForwardResult forward(const Batch& b) override {
    const auto n = b.at("x").size(0);
    if (!is_training()) largest = std::max(largest, n);
    return {at::cross_entropy_loss(b.at("x").mm(w_), b.at("y"), {}, at::Reduction::Sum), n, {}};
  }
  std::int64_t largest = 0;
  at::Tensor w_;
};

TEST(Run, EvaluatesAtTheTrainingMicroBatchUnlessTold) {
  for (auto [told, expected] : {std::pair<std::int64_t, std::int64_t>{0, 4}, {12, 12}}) {
    auto req = request({{"micro_batch", Value(4)}, {"accumulate", Value(4)}, {"max_steps", Value(2)}});
    auto m = std::make_shared<LargestEval>();
    req.objects.model = m;
    req.objects.eval_data = req.objects.data;
    if (told) req.options.emplace("eval_micro_batch", Value(told));
    const auto run = run_training(req);
    EXPECT_EQ(m->largest, expected) << "eval_micro_batch " << told;
    EXPECT_GT(run.at("eval").at("items").get<std::int64_t>(), 0);
  }
}

}  // namespace
}  // namespace wick
