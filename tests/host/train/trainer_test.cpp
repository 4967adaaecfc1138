#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <nlohmann/json.hpp>

#include "../../test_util.hpp"
#include "train/loader.hpp"
#include "train/trainer.hpp"
#include "wick/kit/safetensors.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

struct TrainRun {
  std::shared_ptr<Model> model;
  std::shared_ptr<Dataset> data;
  std::unique_ptr<Trainer> trainer;
  std::unique_ptr<Loader> loader;
};

struct Spec {
  std::int64_t micro = 8, accumulate = 1, max_items = 0;
  std::string optim = "adamw";
  std::map<std::string, Value> optim_opts = {{"lr", Value(1e-2)}};
  bool schedule = true;  // cosine with 3 warmup steps; false: constant lr
  double clip = 0;
};

TrainRun make_run(const Spec& s) {
  TrainRun r;
  at::manual_seed(0);  // same initial weights in every run
  r.model = test::make<Model>("mlp", PluginKind::Model,
                              {{"inputs", Value(8)}, {"hidden", Value(List{Value(16)})}, {"outputs", Value(3)}});
  r.data = test::make<Dataset>("synthetic", PluginKind::Data,
                               {{"size", Value(96)}, {"inputs", Value(8)}, {"classes", Value(3)},
                                {"max_items", Value(s.max_items)}, {"seed", Value(1)}});
  auto opt = test::make<Optimizer>(s.optim, PluginKind::Optim, s.optim_opts);
  std::shared_ptr<Schedule> sched;
  if (s.schedule)
    sched = test::make<Schedule>("schedule", PluginKind::Optim, {{"type", Value("cosine")}, {"warmup_steps", Value(3)}});
  r.trainer = std::make_unique<Trainer>(r.model, opt, sched, TrainerConfig{.clip_grad_norm = s.clip, .total_steps = 20});
  r.loader = std::make_unique<Loader>(r.data, LoaderConfig{.micro_batch = s.micro, .accumulate = s.accumulate, .seed = 4});
  return r;
}

void train_to(TrainRun& r, std::int64_t steps) {
  while (r.trainer->steps() < steps) {
    auto w = r.loader->next_window();
    if (!w) {
      r.loader->start_epoch(r.loader->epoch() + 1);
      continue;
    }
    r.trainer->step(*w);
  }
}

std::vector<at::Tensor> weights(TrainRun& r) {
  std::vector<at::Tensor> out;
  for (auto& p : r.model->parameters()) out.push_back(p.detach().clone());
  return out;
}

double max_rel_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, ((a[i] - b[i]).abs().max() / b[i].abs().max()).item<double>());
  return worst;
}

std::vector<at::Tensor> trained(const Spec& s, std::int64_t steps = 20) {
  TrainRun r = make_run(s);
  train_to(r, steps);
  return weights(r);
}

TEST(Trainer, AccumulationEqualsTheFullBatchAfter20AdamWSteps) {
  auto full = trained({.micro = 8, .accumulate = 1});
  auto split = trained({.micro = 2, .accumulate = 4});
  EXPECT_LT(max_rel_diff(split, full), 1e-5);
  // and training moved the weights: the comparison is not between two copies of the start
  TrainRun fresh = make_run({});
  EXPECT_GT(max_rel_diff(weights(fresh), full), 1e-2);
}

TEST(Trainer, AccumulationEqualsTheFullBatchWhenSamplesCarryDifferentItemCounts) {
  auto full = trained({.micro = 8, .accumulate = 1, .max_items = 5});
  auto split = trained({.micro = 2, .accumulate = 4, .max_items = 5});
  auto odd = trained({.micro = 3, .accumulate = 3, .max_items = 5}, 10);  // short last micro-batches too
  auto odd_full = trained({.micro = 9, .accumulate = 1, .max_items = 5}, 10);
  EXPECT_LT(max_rel_diff(split, full), 1e-5);
  EXPECT_LT(max_rel_diff(odd, odd_full), 1e-5);
}

TEST(Trainer, AccumulationEqualsTheFullBatchWithSgdMomentumAndNesterov) {
  Spec s{.optim = "sgd",
         .optim_opts = {{"lr", Value(0.1)}, {"momentum", Value(0.9)}, {"nesterov", Value(true)},
                        {"weight_decay", Value(1e-3)}}};
  Spec full = s, split = s;
  split.micro = 2;
  split.accumulate = 4;
  EXPECT_LT(max_rel_diff(trained(split), trained(full)), 1e-5);
}

// A class token and a position table, as a ViT joins them to one image's
// patches: at a micro-batch of 1, PyTorch hands both parameters gradients that
// are views of one buffer, which the next micro-batch's in-place accumulation
// would write twice.
class Joined : public Model {
 public:
  Joined() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
    cls_ = register_parameter("cls", at::randn({1, 1, 8}, gen));
    pos_ = register_parameter("pos", at::randn({2, 8}, gen));
    w_ = register_parameter("w", at::randn({8, 3}, gen));
  }
  ForwardResult forward(const Batch& b) override {
    const at::Tensor x = b.at("x");
    const auto n = x.size(0);
    at::Tensor h = at::cat({cls_.expand({n, 1, 8}), x.view({n, 1, 8})}, 1) + pos_.view({1, 2, 8});
    at::Tensor out = h.tanh().sum(1).mm(w_);
    return {at::cross_entropy_loss(out, b.at("y"), {}, at::Reduction::Sum), n, {}};
  }
  at::Tensor cls_, pos_, w_;
};

TEST(Trainer, ParametersWhoseGradientsArriveAsViewsOfOneBufferAccumulateApart) {
  auto data = test::make<Dataset>("synthetic", PluginKind::Data,
                                  {{"size", Value(16)}, {"inputs", Value(8)}, {"classes", Value(3)}, {"seed", Value(1)}});
  auto run = [&](std::int64_t micro, std::int64_t accumulate, double clip) {
    auto m = std::make_shared<Joined>();
    auto opt = test::make<Optimizer>("sgd", PluginKind::Optim, {{"lr", Value(0.1)}});
    Trainer t(m, opt, nullptr, TrainerConfig{.clip_grad_norm = clip, .total_steps = 3});
    Loader loader(data, LoaderConfig{.micro_batch = micro, .accumulate = accumulate, .seed = 4});
    while (t.steps() < 3) t.step(*loader.next_window());
    return std::vector<at::Tensor>{m->cls_.detach().clone(), m->pos_.detach().clone(), m->w_.detach().clone()};
  };
  for (const double clip : {0.0, 0.5}) {  // clipping scales each gradient in place
    const auto whole = run(4, 1, clip), split = run(1, 4, clip);
    EXPECT_LT(max_rel_diff(split, whole), 1e-5) << "clip " << clip;
  }
  // the steps moved the class token and the table: the comparison is not of two starts
  Joined start;
  const auto moved = run(4, 1, 0.0);
  EXPECT_GT(((moved[0] - start.cls_).abs().max() / start.cls_.abs().max()).item<double>(), 1e-3);
  EXPECT_GT(((moved[1] - start.pos_).abs().max() / start.pos_.abs().max()).item<double>(), 1e-3);
}

// The loss is divided by the window's item count, not averaged per micro-batch:
// one SGD step with lr 1 moves the weights by exactly the full batch's gradient.
TEST(Trainer, OneStepMovesWeightsByTheFullBatchGradient) {
  TrainRun r = make_run({.micro = 3, .accumulate = 3, .max_items = 4, .optim = "sgd",
                         .optim_opts = {{"lr", Value(1.0)}}, .schedule = false});
  auto before = weights(r);
  auto w = r.loader->next_window();
  ASSERT_TRUE(w);
  // reference: the same samples as one batch, mean over all their items
  Batch full;
  for (const auto& [name, t] : (*w)[0]) {
    std::vector<at::Tensor> parts;
    for (auto& b : *w) parts.push_back(b.at(name));
    full[name] = at::cat(parts);
  }
  auto ref = r.model->forward(full);
  (ref.loss_sum / ref.items).backward();
  std::vector<at::Tensor> grads;
  for (auto& p : r.model->parameters()) {
    grads.push_back(p.grad().clone());
    p.mutable_grad() = at::Tensor();
  }
  auto stats = r.trainer->step(*w);
  EXPECT_EQ(stats.items, ref.items);
  EXPECT_EQ(stats.micro_batches, 3);
  EXPECT_NEAR(stats.loss, (ref.loss_sum / ref.items).item<double>(), 1e-6);
  auto moved = weights(r);
  for (std::size_t i = 0; i < moved.size(); ++i)
    EXPECT_TRUE(at::allclose(before[i] - moved[i], grads[i], 1e-5, 1e-7)) << "parameter " << i;
}

TEST(Trainer, ClipsTheGlobalNormLikeClipGradNorm) {
  TrainRun r = make_run({.optim = "sgd", .optim_opts = {{"lr", Value(1.0)}}, .schedule = false, .clip = 1e-3});
  auto before = weights(r);
  auto s = r.trainer->step(*r.loader->next_window());
  EXPECT_GT(s.grad_norm, 1e-3);
  double moved_sq = 0;
  auto after = weights(r);
  for (std::size_t i = 0; i < after.size(); ++i) moved_sq += (before[i] - after[i]).pow(2).sum().item<double>();
  EXPECT_NEAR(std::sqrt(moved_sq), 1e-3, 1e-6);  // lr 1: the step is the clipped gradient
}

TEST(Trainer, SameSeedGivesIdenticalRuns) {
  auto a = trained({.micro = 4, .accumulate = 2}, 12);
  auto b = trained({.micro = 4, .accumulate = 2}, 12);
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i]));
}

TEST(Trainer, ResumedRunEndsWhereTheUnbrokenRunEnds) {
  test::TempDir dir;
  Spec s{.micro = 4, .accumulate = 2, .max_items = 3};
  auto unbroken = trained(s, 20);
  {
    TrainRun first = make_run(s);
    train_to(first, 7);
    first.trainer->save(dir.path, {{"epoch", first.loader->epoch()}, {"window", first.loader->window()}});
  }
  TrainRun second = make_run(s);  // fresh weights and optimizer, then the checkpoint
  auto ckpt = latest_checkpoint(dir.path);
  ASSERT_EQ(ckpt.filename(), "step-00000007");
  auto extra = second.trainer->load(ckpt);
  EXPECT_EQ(second.trainer->steps(), 7);
  second.loader->start_epoch(extra["epoch"].get<std::int64_t>(), extra["window"].get<std::int64_t>());
  train_to(second, 20);
  auto resumed = weights(second);
  for (std::size_t i = 0; i < resumed.size(); ++i) EXPECT_TRUE(at::equal(resumed[i], unbroken[i])) << i;
}

TEST(Trainer, KeepsOnlyTheNewestCheckpoints) {
  test::TempDir dir;
  TrainRun r = make_run({});
  for (int k = 0; k < 5; ++k) {
    train_to(r, k + 1);
    r.trainer->save(dir.path, nlohmann::json::object(), /*keep=*/2);
  }
  std::vector<std::string> names;
  for (auto& e : std::filesystem::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"last", "step-00000004", "step-00000005"}));
}

TEST(Trainer, LoadingWeightsThatDoNotFitNamesTheProblem) {
  test::TempDir dir;
  TrainRun r = make_run({});
  write_safetensors(dir.path / "w.safetensors", {{"0.weight", at::zeros({16, 8})}, {"9.weight", at::zeros({1})},
                                                 {"2.weight", at::zeros({4, 16})}});
  auto msg = test::error_of([&] { load_model(*r.model, dir.path / "w.safetensors"); });
  EXPECT_THAT(msg, HasSubstr("do not fit the model"));
  EXPECT_THAT(msg, HasSubstr("missing 0.bias, 2.bias"));
  EXPECT_THAT(msg, HasSubstr("unexpected 9.weight"));
  EXPECT_THAT(msg, HasSubstr("shape mismatch 2.weight (file [4, 16], model [3, 16])"));
}

TEST(Trainer, EvaluateAveragesLossAndMetricsOverItems) {
  TrainRun r = make_run({.max_items = 4});
  auto s = evaluate(*r.model, r.data, EvalConfig{.micro_batch = 7});
  // reference: every sample in one batch
  std::vector<Sample> all;
  for (std::int64_t i = 0; i < r.data->size(); ++i) all.push_back(r.data->get(i));
  auto ref = r.model->forward(r.data->collate(all));
  EXPECT_EQ(s.items, ref.items);
  EXPECT_NEAR(s.loss, ref.loss_sum.item<double>() / ref.items, 1e-5);
  EXPECT_NEAR(s.metrics.at("accuracy"), ref.metrics.at("accuracy").item<double>() / ref.items, 1e-12);
}


// A linear classifier that records what evaluation asked of it, and runs out
// of memory (the error a full GPU raises) on micro-batches above `limit`.
class EvalProbe : public Model {
 public:
  explicit EvalProbe(std::int64_t limit = 1 << 20) : limit_(limit) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
    w_ = register_parameter("w", at::randn({8, 3}, gen));
  }
  ForwardResult forward(const Batch& b) override {
    const auto n = b.at("x").size(0);
    if (!is_training()) {
      largest = std::max(largest, n);
      autocast_seen = autocast_seen || at::autocast::is_autocast_enabled(at::kCPU);
    }
    if (n > limit_) TORCH_CHECK_WITH(OutOfMemoryError, false, "injected: ", n, " samples");
    at::Tensor out = b.at("x").mm(w_);
    return {at::cross_entropy_loss(out, b.at("y"), {}, at::Reduction::Sum), n,
            {{"accuracy", out.argmax(1).eq(b.at("y")).sum()}}};
  }
  std::int64_t largest = 0;
  bool autocast_seen = false;
  at::Tensor w_;

 private:
  std::int64_t limit_;
};

std::shared_ptr<Dataset> eval_data() {
  return test::make<Dataset>("synthetic", PluginKind::Data,
                             {{"size", Value(40)}, {"inputs", Value(8)}, {"classes", Value(3)}, {"seed", Value(2)}});
}

// the whole set in one fp32 forward, autocast optional
std::pair<double, double> full_batch(EvalProbe& m, const Dataset& data, bool bf16) {
  std::vector<Sample> all;
  for (std::int64_t i = 0; i < data.size(); ++i) all.push_back(data.get(i));
  const Batch b = data.collate(all);
  at::NoGradGuard no_grad;
  at::autocast::set_autocast_enabled(at::kCPU, bf16);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  at::Tensor out = b.at("x").mm(m.w_);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  const double n = static_cast<double>(all.size());
  return {at::cross_entropy_loss(out.to(at::kFloat), b.at("y"), {}, at::Reduction::Sum).item<double>() / n,
          out.argmax(1).eq(b.at("y")).sum().item<double>() / n};
}

TEST(Trainer, EvaluationRunsUnderTheTrainingPrecision) {
  auto data = eval_data();
  for (Precision p : {Precision::FP32, Precision::BF16Mixed}) {
    auto m = std::make_shared<EvalProbe>();
    Trainer t(m, test::make<Optimizer>("sgd", PluginKind::Optim, {{"lr", Value(0.1)}}), nullptr, {.precision = p});
    const EvalStats s = t.evaluate(data, 8);
    const bool mixed = p == Precision::BF16Mixed;
    EXPECT_EQ(m->autocast_seen, mixed) << to_string(p);
    EXPECT_EQ(m->largest, 8);
    const auto [loss, acc] = full_batch(*m, *data, mixed);
    EXPECT_NEAR(s.loss, loss, 1e-5 * std::abs(loss)) << to_string(p);
    EXPECT_NEAR(s.metrics.at("accuracy"), acc, 1e-12);
    EXPECT_TRUE(m->is_training()) << "evaluation gives the model back in training mode";
  }
  // bf16 and fp32 differ here, so the check above could tell them apart
  auto m = std::make_shared<EvalProbe>();
  EXPECT_GT(std::abs(full_batch(*m, *data, true).first - full_batch(*m, *data, false).first), 1e-5);
}

TEST(Trainer, EvaluationHalvesAMicroBatchThatRunsOutOfMemory) {
  auto data = eval_data();
  auto m = std::make_shared<EvalProbe>(/*limit=*/3);
  Trainer t(m, test::make<Optimizer>("sgd", PluginKind::Optim, {{"lr", Value(0.1)}}), nullptr, {});
  const EvalStats s = t.evaluate(data, 16);  // 16 -> 8 -> 4 -> 2 samples a part
  EXPECT_EQ(s.split, 8);
  EXPECT_EQ(s.oom_retries, 3);  // halved three times on the first micro-batch; later ones start split
  EXPECT_EQ(s.items, 40);
  const auto [loss, acc] = full_batch(*m, *data, false);
  EXPECT_NEAR(s.loss, loss, 1e-6 * std::abs(loss));
  EXPECT_NEAR(s.metrics.at("accuracy"), acc, 1e-12);
}

TEST(Trainer, EvaluationOutOfMemoryWithoutRecoveryOrAtOneSampleIsOneLine) {
  auto data = eval_data();
  auto m = std::make_shared<EvalProbe>(/*limit=*/0);
  Trainer fail(m, test::make<Optimizer>("sgd", PluginKind::Optim, {{"lr", Value(0.1)}}), nullptr,
               {.split_on_oom = false});
  auto msg = test::error_of([&] { fail.evaluate(data, 4); });
  EXPECT_THAT(msg, HasSubstr("evaluation after step 0, micro-batch 1"));
  EXPECT_THAT(msg, HasSubstr("on_oom = \"fail\""));
  Trainer split(m, test::make<Optimizer>("sgd", PluginKind::Optim, {{"lr", Value(0.1)}}), nullptr, {});
  msg = test::error_of([&] { split.evaluate(data, 4); });
  EXPECT_THAT(msg, HasSubstr("out of memory even at micro-batch 1"));
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_TRUE(m->is_training());
}

}  // namespace
}  // namespace wick
