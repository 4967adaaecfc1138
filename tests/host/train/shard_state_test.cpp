// Sharded optimizer state in checkpoints (train/shard_state.cpp): a checkpoint
// written by two ranks that each keep pieces of the state holds one rank's
// state, whatever kind each entry is (one value per element, one per block,
// a counter every piece keeps); resuming cuts it into the ranks' pieces again;
// an entry of no such kind is refused with the parameter and the counts named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include "../../test_util.hpp"
#include "train/trainer.hpp"
#include "wick/kit/safetensors.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

// An optimizer with each kind of state the host joins and cuts: "sum", the
// gradients summed, element by element; "peak", the largest |sum| in each
// block of kShardAlign elements; "steps", a counter; with `odd`, "odd" of
// three values whatever the piece (a kind the host cannot join).
class Probe : public Optimizer, public ElementwiseUpdates {
 public:
  explicit Probe(bool odd = false) : odd_(odd) {}
  void attach(NamedTensors params) override {
    params_ = std::move(params);
    for (auto& [n, p] : params_) sum_[n] = at::zeros_like(p);  // a piece: flat
  }
  void step(double lr) override {
    at::NoGradGuard no_grad;
    for (auto& [n, p] : params_) {
      if (!p.grad().defined()) continue;
      sum_[n] += p.grad();
      p.sub_(p.grad(), lr);
    }
    ++steps_;
  }
  double base_lr() const override { return 0.1; }
  std::map<std::string, at::Tensor> state() const override {
    std::map<std::string, at::Tensor> out;
    for (const auto& [n, s] : sum_) {
      out[n + ".sum"] = s.clone();
      const std::int64_t blocks = (s.numel() + kShardAlign - 1) / kShardAlign;
      at::Tensor padded = at::zeros({blocks * kShardAlign}, s.options());
      padded.narrow(0, 0, s.numel()).copy_(s.abs().reshape({-1}));
      out[n + ".peak"] = std::get<0>(padded.view({blocks, kShardAlign}).max(1));
      out[n + ".steps"] = at::scalar_tensor(static_cast<double>(steps_), at::kDouble);
      if (odd_) out[n + ".odd"] = at::zeros({3});
    }
    return out;
  }
  void load_state(const std::map<std::string, at::Tensor>& state) override {
    for (auto& [n, s] : sum_) s.copy_(state.at(n + ".sum").reshape(s.sizes()));
    if (!sum_.empty()) steps_ = static_cast<std::int64_t>(state.at(sum_.begin()->first + ".steps").item<double>());
  }

 private:
  bool odd_;
  NamedTensors params_;
  std::map<std::string, at::Tensor> sum_;
  std::int64_t steps_ = 0;
};

// Its first weight (320 x 64 = 20480 elements, five blocks) is cut across two
// ranks: each parameter starts at a block, the three others take one block
// each, and each rank owns four of the eight.
std::shared_ptr<Model> mlp() {
  at::manual_seed(0);
  return test::make<Model>("mlp", PluginKind::Model,
                           {{"inputs", Value(64)}, {"hidden", Value(List{Value(320)})}, {"outputs", Value(3)}});
}

Batch batch(std::uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return {{"x", at::randn({8, 64}, gen)}, {"y", at::randint(0, 3, {8}, gen)}};
}

std::map<std::string, at::Tensor> optimizer_state(const std::filesystem::path& checkpoint) {
  std::map<std::string, at::Tensor> out;
  for (auto& [k, t] : read_safetensors(checkpoint / "optimizer.safetensors").tensors) out.emplace(k, t.clone());
  return out;
}

void expect_same_state(const std::map<std::string, at::Tensor>& got, const std::map<std::string, at::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [k, t] : want) {
    ASSERT_TRUE(got.count(k)) << k;
    const at::Tensor g = got.at(k);
    EXPECT_EQ(g.sizes(), t.sizes()) << k;
    EXPECT_TRUE(at::allclose(g.to(at::kDouble), t.to(at::kDouble), 1e-5, 1e-6)) << k;
  }
}

struct Fixture {
  Batch a = batch(11), b = batch(12);
  // made here: the ranks are threads sharing the global generator
  std::vector<std::shared_ptr<Model>> models{mlp(), mlp()};
};

// One rank's checkpoint after `steps` windows of {a, b}.
std::filesystem::path one_rank(Fixture& f, const std::filesystem::path& dir, int steps) {
  Trainer t(mlp(), std::make_shared<Probe>(), nullptr, {});
  for (int s = 0; s < steps; ++s) t.step({f.a, f.b});
  return t.save(dir, nlohmann::json::object());
}

TEST(ShardState, TwoRanksPiecesJoinIntoOneRanksStateOfEveryKind) {
  Fixture f;
  test::TempDir one, two;
  const auto want = optimizer_state(one_rank(f, one.path, 3));
  ASSERT_EQ(want.at("0.weight.peak").numel(), 5);
  std::filesystem::path written;
  test::two_ranks([&](std::shared_ptr<Group> g) {
    TrainerConfig c{.shard = ShardMode::Optimizer};
    c.group = g;
    Trainer t(f.models[g->rank()], std::make_shared<Probe>(), nullptr, c);
    for (int s = 0; s < 3; ++s) t.step({g->rank() == 0 ? f.a : f.b});
    const auto dir = t.save(two.path, nlohmann::json::object());
    if (g->rank() == 0) written = dir;
  });
  expect_same_state(optimizer_state(written), want);
}

TEST(ShardState, ResumingCutsTheWholeStateIntoEachRanksPieces) {
  // cut on load, joined again on save: the state comes back whole and equal,
  // and the steps after it match one rank's
  Fixture f;
  test::TempDir one, two;
  Trainer t(mlp(), std::make_shared<Probe>(), nullptr, {});
  for (int s = 0; s < 2; ++s) t.step({f.a, f.b});
  const auto checkpoint = t.save(one.path, nlohmann::json::object());
  const auto whole = optimizer_state(checkpoint);
  t.step({f.a, f.b});
  const auto want = optimizer_state(t.save(one.path, nlohmann::json::object()));
  std::map<int, std::map<std::string, at::Tensor>> resaved;
  std::filesystem::path after;
  test::two_ranks([&](std::shared_ptr<Group> g) {
    TrainerConfig c{.shard = ShardMode::Optimizer};
    c.group = g;
    Trainer r(f.models[g->rank()], std::make_shared<Probe>(), nullptr, c);
    r.load(checkpoint);
    const auto again = r.save(two.path / "again", nlohmann::json::object());
    r.step({g->rank() == 0 ? f.a : f.b});
    const auto next = r.save(two.path / "next", nlohmann::json::object());
    if (g->rank() == 0) {
      resaved[0] = optimizer_state(again);
      after = next;
    }
  });
  expect_same_state(resaved[0], whole);
  expect_same_state(optimizer_state(after), want);
}

TEST(ShardState, StateOfNoKnownKindIsRefusedNamingTheParameter) {
  Fixture f;
  test::TempDir dir;
  std::string error;
  test::two_ranks([&](std::shared_ptr<Group> g) {
    TrainerConfig c{.shard = ShardMode::Optimizer};
    c.group = g;
    Trainer t(f.models[g->rank()], std::make_shared<Probe>(/*odd=*/true), nullptr, c);
    t.step({g->rank() == 0 ? f.a : f.b});
    const std::string e = test::error_of([&] { t.save(dir.path, nlohmann::json::object()); });
    if (g->rank() == 0) error = e;
  });
  EXPECT_THAT(error, HasSubstr("shard: the optimizer's state '0.weight.odd' holds 6 elements over the pieces of a "
                               "parameter of 20480"));
  EXPECT_THAT(error, HasSubstr("this optimizer cannot run sharded"));
}

}  // namespace
}  // namespace wick
