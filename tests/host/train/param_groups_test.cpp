// Parameter groups (train/param_groups.cpp): which group takes a parameter,
// the rate each group steps at, their state side by side, and the errors for
// groups that cannot work as written.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "../../test_util.hpp"
#include "train/param_groups.hpp"

using ::testing::ElementsAre;
using ::testing::HasSubstr;

namespace wick {
namespace {

// An optimizer that notes what it is given: the parameters it is attached
// to (with their whole sizes when sharded), the rates it steps at, the state
// offered to it; its state is one entry per parameter.
class Recorder : public Optimizer {
 public:
  explicit Recorder(double lr, std::string key = "m") : lr_(lr), key_(std::move(key)) {}
  void attach(NamedTensors params) override {
    for (auto& [n, t] : params) names.push_back(n);
  }
  void attach_shard(NamedTensors params, const std::vector<std::int64_t>& whole_sizes) override {
    attach(std::move(params));
    whole = whole_sizes;
  }
  void step(double lr) override { rates.push_back(lr); }
  double base_lr() const override { return lr_; }
  std::map<std::string, at::Tensor> state() const override {
    std::map<std::string, at::Tensor> out;
    for (const auto& n : names) out[n + "." + key_] = at::full({1}, lr_);
    return out;
  }
  void load_state(const std::map<std::string, at::Tensor>& state) override { offered = state.size(); }
  std::int64_t state_bytes(const NamedTensors& params) const override {
    return static_cast<std::int64_t>(params.size()) * static_cast<std::int64_t>(lr_ * 1000);  // per group, its own
  }

  std::vector<std::string> names;
  std::vector<std::int64_t> whole;
  std::vector<double> rates;
  std::size_t offered = 0;

 private:
  double lr_;
  std::string key_;
};

NamedTensors params(std::initializer_list<const char*> names) {
  NamedTensors out;
  for (const char* n : names) out.emplace_back(n, at::zeros({2}));
  return out;
}

ParamGroup group(std::string name, std::vector<std::string> patterns, std::shared_ptr<Optimizer> optim) {
  ParamGroup g;
  g.name = std::move(name);
  g.patterns = std::move(patterns);
  g.optim = std::move(optim);
  return g;
}

TEST(ParamGroups, TheFirstGroupNamingAParameterTakesItAndTheDefaultTakesTheRest) {
  auto rest = std::make_shared<Recorder>(0.1), norms = std::make_shared<Recorder>(0.1),
       biases = std::make_shared<Recorder>(0.1);
  ParamGroups pg("optim 'sgd'", rest, {group("norms", {"*norm*"}, norms), group("biases", {"bias"}, biases)});
  pg.attach(params({"embed.weight", "norm.weight", "norm.bias", "head.bias", "head.weight"}));
  EXPECT_THAT(norms->names, ElementsAre("norm.weight", "norm.bias"));  // norm.bias: the first group's
  EXPECT_THAT(biases->names, ElementsAre("head.bias"));
  EXPECT_THAT(rest->names, ElementsAre("embed.weight", "head.weight"));
  EXPECT_EQ(pg.rest().name, "default");
  EXPECT_EQ(pg.rest().params.size(), 2u);
}

TEST(ParamGroups, EachGroupStepsAtItsOwnRateScaledAsTheDefaultsIs) {
  auto rest = std::make_shared<Recorder>(0.1), slow = std::make_shared<Recorder>(0.01);
  ParamGroups pg("optim 'sgd'", rest, {group("slow", {"a"}, slow)});
  pg.attach(params({"a", "b"}));
  pg.step(0.05);  // the schedule halved the default's rate: every group's is halved
  pg.step_scaled(2.0);
  EXPECT_THAT(rest->rates, ElementsAre(::testing::DoubleEq(0.05), ::testing::DoubleEq(0.2)));
  EXPECT_THAT(slow->rates, ElementsAre(::testing::DoubleEq(0.005), ::testing::DoubleEq(0.02)));
  EXPECT_DOUBLE_EQ(pg.base_lr(), 0.1);
}

TEST(ParamGroups, LogNamesAreTheGroupsNamesOrTheirPlaces) {
  auto r = [] { return std::make_shared<Recorder>(0.1); };
  ParamGroups pg("optim 'sgd'", r(), {group("", {"a"}, r()), group("head", {"b"}, r())});
  EXPECT_EQ(pg.groups()[0].log_name, "lr_group1");
  EXPECT_EQ(pg.groups()[0].name, "groups[1]");
  EXPECT_EQ(pg.groups()[1].log_name, "lr_head");
  EXPECT_THAT(test::error_of([&] {
                ParamGroups("optim 'sgd'", r(), {group("head", {"a"}, r()), group("head", {"b"}, r())});
              }),
              HasSubstr("optim 'sgd': groups[1] and groups[2] are both named 'head'"));
  // an unnamed second group would log as lr_group2: a group named group2 clashes with it
  EXPECT_THAT(test::error_of([&] {
                ParamGroups("optim 'sgd'", r(), {group("group2", {"a"}, r()), group("", {"b"}, r())});
              }),
              HasSubstr("are both named 'group2'"));
}

TEST(ParamGroups, AGroupWithoutPatternsOrWithABadOneIsRefusedAtOnce) {
  auto r = [] { return std::make_shared<Recorder>(0.1); };
  EXPECT_THAT(test::error_of([&] { ParamGroups("optim 'adamw'", r(), {group("", {}, r())}); }),
              HasSubstr("optim 'adamw': groups[1]: expected params = a pattern or a list of patterns, got none"));
  EXPECT_THAT(test::error_of([&] { ParamGroups("optim 'adamw'", r(), {group("x", {"re:("}, r())}); }),
              HasSubstr("optim 'adamw': x"));
  EXPECT_THAT(test::error_of([&] { ParamGroups("optim 'adamw'", nullptr, {}); }),
              HasSubstr("optim 'adamw': no optimizer for the default group"));
}

TEST(ParamGroups, AGroupThatTakesNoParameterIsAnErrorNamingItsPatterns) {
  auto r = [] { return std::make_shared<Recorder>(0.1); };
  // a typo
  ParamGroups typo("optim 'sgd'", r(), {group("head", {"haed.*"}, r())});
  EXPECT_THAT(test::error_of([&] { typo.attach(params({"head.weight", "head.bias"})); }),
              HasSubstr("optim 'sgd': head (params 'haed.*') takes no trainable parameter (an earlier group takes what "
                        "it names, or it names none: the trainable parameters are named like head.weight, head.bias)"));
  // everything it names is taken by an earlier group
  ParamGroups shadowed("optim 'sgd'", r(), {group("all", {"*"}, r()), group("bias", {"bias"}, r())});
  EXPECT_THAT(test::error_of([&] { shadowed.attach(params({"w", "x.bias"})); }),
              HasSubstr("optim 'sgd': bias (params 'bias') takes no trainable parameter"));
}

TEST(ParamGroups, StateIsEveryGroupsSideBySideAndEachGroupIsOfferedAllOfIt) {
  auto rest = std::make_shared<Recorder>(0.1), g = std::make_shared<Recorder>(0.5);
  ParamGroups pg("optim 'sgd'", rest, {group("g", {"a"}, g)});
  pg.attach(params({"a", "b"}));
  const auto s = pg.state();
  ASSERT_EQ(s.size(), 2u);
  EXPECT_FLOAT_EQ(s.at("a.m").item<float>(), 0.5f);
  EXPECT_FLOAT_EQ(s.at("b.m").item<float>(), 0.1f);
  pg.load_state(s);
  EXPECT_EQ(rest->offered, 2u);
  EXPECT_EQ(g->offered, 2u);
}

TEST(ParamGroups, TwoGroupsKeepingStateUnderOneNameAreRefused) {
  // state kept by a key of the optimizer's own, not by parameter name
  class Global : public Recorder {
   public:
    using Recorder::Recorder;
    std::map<std::string, at::Tensor> state() const override { return {{"step", at::zeros({1})}}; }
  };
  ParamGroups pg("optim 'odd'", std::make_shared<Global>(0.1), {group("g", {"a"}, std::make_shared<Global>(0.1))});
  pg.attach(params({"a", "b"}));
  EXPECT_THAT(test::error_of([&] { pg.state(); }), HasSubstr("optim 'odd': two groups keep state under one name, 'step'"));
}

TEST(ParamGroups, ShardedPiecesGoToTheirGroupsWithTheirWholeSizes) {
  auto rest = std::make_shared<Recorder>(0.1), g = std::make_shared<Recorder>(0.1);
  ParamGroups pg("optim 'sgd'", rest, {group("g", {"a"}, g)});
  pg.attach_shard(params({"b", "a"}), {9000, 5000});
  EXPECT_THAT(g->names, ElementsAre("a"));
  EXPECT_THAT(g->whole, ElementsAre(5000));
  EXPECT_THAT(rest->whole, ElementsAre(9000));
  // a group may get no piece on this rank: no error here (check() sees the whole parameters)
  auto g2 = std::make_shared<Recorder>(0.1);
  ParamGroups none("optim 'sgd'", std::make_shared<Recorder>(0.1), {group("g", {"a"}, g2)});
  EXPECT_NO_THROW(none.attach_shard(params({"b"}), {9000}));
  EXPECT_TRUE(g2->names.empty());
}

TEST(ParamGroups, StateBytesAddEachGroupsShare) {
  ParamGroups pg("optim 'sgd'", std::make_shared<Recorder>(0.1), {group("g", {"a*"}, std::make_shared<Recorder>(0.5))});
  EXPECT_EQ(pg.state_bytes(params({"a1", "a2", "b"})), 2 * 500 + 100);
}

}  // namespace
}  // namespace wick
