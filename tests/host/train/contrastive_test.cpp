// Losses that couple a window's samples (contrastive): the trainer's two-pass
// path (Model::window_coupled) gives the gradients of one full batch whatever
// the split and the rank count; the per-micro-batch form does not.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "../../test_util.hpp"
#include "distributed/group.hpp"
#include "train/trainer.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

// Two linear towers (x -> 4, t -> 4, the first with dropout), normalised
// embeddings and a learnable temperature: CLIP's symmetric loss, summed over
// the samples.
class TwoTower : public Model, public WindowCoupled {
 public:
  TwoTower(bool coupled, double dropout) : coupled_(coupled), dropout_(dropout) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);  // the same weights in every instance, on every thread
    a_ = register_parameter("a", at::randn({6, 4}, gen) * 0.5);
    b_ = register_parameter("b", at::randn({5, 4}, gen) * 0.5);
    scale_ = register_parameter("logit_scale", at::full({}, 1.5));
  }
  bool window_coupled() const override { return coupled_; }
  std::vector<at::Tensor> embed(const Batch& batch) override {
    at::Tensor x = at::dropout(batch.at("x").mm(a_), dropout_, is_training());
    at::Tensor t = batch.at("t").mm(b_);
    return {x / x.norm(2, {1}, true), t / t.norm(2, {1}, true)};
  }
  ForwardResult window_loss(const std::vector<at::Tensor>& e) override {
    at::Tensor logits = scale_.exp() * e[0].mm(e[1].t());
    at::Tensor target = at::arange(logits.size(0), at::kLong);
    at::Tensor l = (at::cross_entropy_loss(logits, target, {}, at::Reduction::Sum) +
                    at::cross_entropy_loss(logits.t(), target, {}, at::Reduction::Sum)) * 0.5;
    return {l, logits.size(0), {{"accuracy", logits.argmax(1).eq(target).sum()}}};
  }
  ForwardResult forward(const Batch& batch) override { return window_loss(embed(batch)); }

 private:
  bool coupled_;
  double dropout_;
  at::Tensor a_, b_, scale_;
};

Batch rows(const Batch& b, std::int64_t from, std::int64_t n) {
  Batch out;
  for (const auto& [k, v] : b) out[k] = v.narrow(0, from, n);
  return out;
}

Batch data(std::int64_t n) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  return {{"x", at::randn({n, 6}, gen)}, {"t", at::randn({n, 5}, gen)}};
}

std::vector<Batch> window_of(const Batch& all, std::int64_t from, std::int64_t micro, std::int64_t count) {
  std::vector<Batch> w;
  for (std::int64_t i = 0; i < count; ++i) w.push_back(rows(all, from + i * micro, micro));
  return w;
}

// Weights after one SGD step (lr 1): w0 - gradient.
std::vector<at::Tensor> after_step(std::shared_ptr<Model> m, const std::vector<Batch>& window,
                                   std::shared_ptr<Group> group = nullptr, StepStats* stats = nullptr) {
  auto sgd = test::make<Optimizer>("sgd", PluginKind::Optim, {{"lr", Value(1.0)}});
  Trainer t(m, sgd, nullptr, {.group = group});
  StepStats s = t.step(window);
  if (stats) *stats = s;
  std::vector<at::Tensor> out;
  for (auto& p : m->parameters()) out.push_back(p.detach().clone());
  return out;
}

double max_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  return worst;
}

TEST(Contrastive, CoupledAccumulationEqualsTheFullBatch) {
  const Batch all = data(16);
  StepStats full_stats, split_stats;
  auto full = after_step(std::make_shared<TwoTower>(true, 0.0), {all}, nullptr, &full_stats);
  auto split = after_step(std::make_shared<TwoTower>(true, 0.0), window_of(all, 0, 2, 8), nullptr, &split_stats);
  EXPECT_LT(max_diff(full, split), 1e-6);
  EXPECT_NEAR(split_stats.loss, full_stats.loss, 1e-6);
  EXPECT_EQ(split_stats.items, 16);
  EXPECT_EQ(split_stats.micro_batches, 8);
  EXPECT_DOUBLE_EQ(split_stats.metrics.at("accuracy"), full_stats.metrics.at("accuracy"));
  // the temperature moved: its gradient comes from the window's loss itself
  auto before = std::make_shared<TwoTower>(true, 0.0)->parameters();
  EXPECT_GT((split[2] - before[2]).abs().item<double>(), 1e-4);
}

TEST(Contrastive, PlainAccumulationSeesFewerNegativesAndDiffers) {
  const Batch all = data(16);
  auto full = after_step(std::make_shared<TwoTower>(false, 0.0), {all});
  auto plain = after_step(std::make_shared<TwoTower>(false, 0.0), window_of(all, 0, 2, 8));
  EXPECT_GT(max_diff(full, plain), 1e-2);
  // and it is what the per-micro-batch losses give: mean over the window of
  // each micro-batch's own contrastive loss
  auto ref = std::make_shared<TwoTower>(false, 0.0);
  at::Tensor total = at::zeros({});
  for (const auto& b : window_of(all, 0, 2, 8)) total = total + ref->forward(b).loss_sum;
  (total / 16).backward();
  std::vector<at::Tensor> expect;
  for (auto& p : ref->parameters()) expect.push_back((p - p.grad()).detach());
  EXPECT_LT(max_diff(plain, expect), 1e-6);
}

TEST(Contrastive, TheSecondPassReplaysTheFirstPassRandomness) {
  // Dropout in a tower: the gradient must be the one of the embeddings the
  // loss saw. Reference: the same random draws, one graph over the window.
  const Batch all = data(12);
  const auto window = window_of(all, 0, 3, 4);
  at::manual_seed(11);
  auto got = after_step(std::make_shared<TwoTower>(true, 0.5), window);
  at::manual_seed(11);
  auto ref = std::make_shared<TwoTower>(true, 0.5);
  ref->train(true);
  std::vector<at::Tensor> img, txt;
  for (const auto& b : window) {
    auto e = ref->embed(b);
    img.push_back(e[0]);
    txt.push_back(e[1]);
  }
  (ref->window_loss({at::cat(img), at::cat(txt)}).loss_sum / 12).backward();
  std::vector<at::Tensor> expect;
  for (auto& p : ref->parameters()) expect.push_back((p - p.grad()).detach());
  EXPECT_LT(max_diff(got, expect), 1e-6);
}

TEST(Contrastive, TwoRanksGatherEmbeddingsAndEqualOneRank) {
  // 16 samples: rank 0 takes the first 8 (2 x 4 micro-batches), rank 1 the
  // rest; one rank with the whole window is the reference. Then an uneven
  // split where rank 1's window is empty.
  const Batch all = data(16);
  auto one = after_step(std::make_shared<TwoTower>(true, 0.0), window_of(all, 0, 2, 8));
  for (const bool uneven : {false, true}) {
    std::vector<std::vector<at::Tensor>> got(2);
    std::vector<StepStats> stats(2);
    test::two_ranks([&](std::shared_ptr<Group> g) {
      const int r = g->rank();
      std::vector<Batch> w = uneven ? (r == 0 ? window_of(all, 0, 4, 4) : std::vector<Batch>{})
                                    : window_of(all, 8 * r, 2, 4);
      got[r] = after_step(std::make_shared<TwoTower>(true, 0.0), w, g, &stats[r]);
    });
    EXPECT_LT(max_diff(got[0], one), 1e-6) << (uneven ? "uneven" : "even");
    EXPECT_LT(max_diff(got[1], one), 1e-6) << (uneven ? "uneven" : "even");
    EXPECT_EQ(stats[0].items, 16);
    EXPECT_NEAR(stats[0].loss, stats[1].loss, 1e-9);
  }
}

// A model whose embed() breaks the contract is named clearly.
class BadEmbed : public TwoTower {
 public:
  BadEmbed() : TwoTower(true, 0.0) {}
  std::vector<at::Tensor> embed(const Batch& batch) override { return {batch.at("x").sum(1)}; }
};

TEST(Contrastive, EmbeddingsOfTheWrongShapeAreAnError) {
  const Batch all = data(8);
  auto msg = test::error_of([&] { after_step(std::make_shared<BadEmbed>(), window_of(all, 0, 4, 2)); });
  EXPECT_THAT(msg, HasSubstr("embed() must give [items, width] tensors"));
}

}  // namespace
}  // namespace wick
