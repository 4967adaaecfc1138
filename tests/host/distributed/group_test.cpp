#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <set>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "../../test_util.hpp"
#include "distributed/group.hpp"
#include "distributed/reducer.hpp"
#include "train/trainer.hpp"
#include "wick/optim.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

TEST(DistEnv, ReadsTorchrunVariables) {
  auto d = parse_dist_env({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                           {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(d.rank, 3);
  EXPECT_EQ(d.world_size, 4);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.local_world_size, 2);
  EXPECT_EQ(d.master_addr, "node7");
  EXPECT_EQ(d.master_port, 1234);
}

TEST(DistEnv, ReadsSlurmVariables) {
  auto d = parse_dist_env({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                           {"SLURM_NTASKS_PER_NODE", "4(x2)"}, {"SLURM_NODELIST", "gpu[03-04],cpu1"}});
  EXPECT_EQ(d.source, "SLURM");
  EXPECT_EQ(d.rank, 5);
  EXPECT_EQ(d.world_size, 8);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.local_world_size, 4);
  EXPECT_EQ(d.master_addr, "gpu03");
  EXPECT_EQ(d.master_port, 29500);
}

TEST(DistEnv, SlurmWithoutMasterPortTakesAPortFromTheJobId) {
  auto job = [](const char* id, const char* port) {
    std::map<std::string, std::string> env{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", id}};
    if (port) env["MASTER_PORT"] = port;
    return parse_dist_env(env).master_port;
  };
  EXPECT_EQ(job("4242", nullptr), 15000 + 4242);
  EXPECT_EQ(job("123456", nullptr), 15000 + 3456);
  EXPECT_NE(job("123456", nullptr), job("123457", nullptr));  // two jobs on one node
  EXPECT_EQ(job("123456", "29511"), 29511);                   // MASTER_PORT wins
  EXPECT_THAT(test::error_of([&] { job("12x", nullptr); }), HasSubstr("SLURM_JOB_ID=12x is not an integer"));
  EXPECT_EQ(job("12x", "29511"), 29511);  // not read when MASTER_PORT names the port
}

TEST(DistEnv, TorchrunsAgentStoreIsJoinedAsAClientUnderTheAttemptsPrefix) {
  auto d = parse_dist_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1234"},
                           {"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "2"}});
  EXPECT_TRUE(d.agent_store);
  EXPECT_EQ(d.restart_count, 2);
  EXPECT_EQ(d.source, "torchrun's agent store");
  d = parse_dist_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "False"}});
  EXPECT_FALSE(d.agent_store);
  EXPECT_THAT(test::error_of([] {
                parse_dist_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                {"TORCHELASTIC_RESTART_COUNT", "-1"}});
              }),
              HasSubstr("TORCHELASTIC_RESTART_COUNT=-1 is below 0"));
}

TEST(DistEnv, ARanksDeviceIsItsLocalRankModuloTheDevicesItSees) {
  EXPECT_EQ(rank_cuda_device(3, 4, 4), 3);  // every rank sees the node's 4 devices
  EXPECT_EQ(rank_cuda_device(3, 4, 1), 0);  // srun --gpus-per-task=1: each sees its own
  EXPECT_EQ(rank_cuda_device(1, 2, 8), 1);
  EXPECT_EQ(rank_cuda_device(2, 4, 0), 0);
  EXPECT_THAT(test::error_of([] { rank_cuda_device(5, 8, 4); }),
              HasSubstr("LOCAL_WORLD_SIZE 8 ranks on this node see 4 CUDA devices: ranks would share a device"));
}

TEST(DistEnv, FirstSlurmHost) {
  EXPECT_EQ(first_slurm_host("a1"), "a1");
  EXPECT_EQ(first_slurm_host("a1,a2"), "a1");
  EXPECT_EQ(first_slurm_host("gpu[07,09-12]"), "gpu07");
}

TEST(DistEnv, NoVariablesMeansOneProcess) {
  auto d = parse_dist_env({});
  EXPECT_EQ(d.world_size, 1);
  EXPECT_EQ(d.rank, 0);
}

TEST(DistEnv, InconsistentValuesAreErrors) {
  EXPECT_THAT(test::error_of([] { parse_dist_env({{"RANK", "2"}, {"WORLD_SIZE", "2"}}); }),
              HasSubstr("rank 2 is outside [0, 2)"));
  EXPECT_THAT(test::error_of([] { parse_dist_env({{"RANK", "x"}, {"WORLD_SIZE", "2"}}); }),
              HasSubstr("RANK=x is not an integer"));
  EXPECT_THAT(test::error_of([] { parse_dist_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}); }),
              HasSubstr("master port 70000"));
}

using test::free_port;
using test::two_ranks;

TEST(Group, SumsBroadcastsAndChecksAgreement) {
  two_ranks([](std::shared_ptr<Group> g) {
    EXPECT_EQ(g->sum(g->rank() + 10, "test"), 21);
    std::vector<at::Tensor> t{at::full({3}, static_cast<double>(g->rank() + 1))};
    g->broadcast(t, "test");
    EXPECT_TRUE(at::equal(t[0], at::ones({3})));
    g->check_same("options", "a=1");
    auto msg = test::error_of([&] { g->check_same("options", g->rank() == 0 ? "a=1" : "a=2"); });
    EXPECT_THAT(msg, HasSubstr("rank 1's options differs from rank 0's: a=2 vs a=1"));
  });
}

TEST(Group, ReduceScatterAndAllGatherSendWhatOneAllReduceSends) {
  two_ranks([](std::shared_ptr<Group> g) {
    const int r = g->rank();
    at::Tensor in = at::arange(8, at::kFloat) * (r + 1);  // rank 0: 0..7, rank 1: 0..14 by 2
    at::Tensor out = at::empty({4});
    const std::int64_t s0 = g->sent();
    g->wait(g->reduce_scatter_async(out, in), "test");
    EXPECT_TRUE(at::equal(out, (at::arange(8, at::kFloat) * 3).narrow(0, 4 * r, 4)));  // this rank's chunk of the sum
    at::Tensor all = at::empty({8});
    g->all_gather(all, out, "test");
    EXPECT_TRUE(at::equal(all, at::arange(8, at::kFloat) * 3));
    const std::int64_t s1 = g->sent();
    std::vector<at::Tensor> same{at::arange(8, at::kFloat) * (r + 1)};
    g->all_reduce(same, "test");
    EXPECT_TRUE(at::equal(same[0], all));
    EXPECT_EQ(s1 - s0, g->sent() - s1);  // ring algorithms: 2 (N-1)/N of 32 bytes either way
    EXPECT_EQ(s1 - s0, 32);
    // point to point and the store's gather
    at::Tensor t = at::full({3}, static_cast<double>(r + 5));
    if (r == 1) g->send(t, 0, "test");
    else g->recv(t, 1, "test");
    EXPECT_TRUE(at::equal(t, at::full({3}, 6.0)));
    const auto names = g->gather_strings("rank" + std::to_string(r), "test");
    if (r == 0) EXPECT_EQ(names, (std::vector<std::string>{"rank0", "rank1"}));
    else EXPECT_TRUE(names.empty());
  });
}

// The shapes and places a caller may hand the gloo collectives: an input
// of any shape is cut over its flat elements, as NCCL cuts it; an all-gather
// into the output whose part is the input itself keeps that part; inputs
// gloo would read wrongly (strided, or another dtype than the output) are
// refused by name rather than summed over the wrong memory or converted.
TEST(Group, GlooCollectivesCutFlatElementsGatherInPlaceAndRefuseStridedOrMixedInputs) {
  two_ranks([](std::shared_ptr<Group> g) {
    const int r = g->rank();
    // a [4, 6] input on 2 ranks: each rank's 12 elements are 2 rows, not a
    // chunk of dim 0's 4 rows laid out as [2, 6] (the same here) nor of a [3, 8]
    at::Tensor in = (at::arange(24, at::kFloat) * (r + 1)).view({3, 8});
    at::Tensor out = at::empty({2, 6});
    g->wait(g->reduce_scatter_async(out, in), "test");
    EXPECT_TRUE(at::equal(out.reshape({-1}), (at::arange(24, at::kFloat) * 3).narrow(0, 12 * r, 12)));
    // gathered in place: the input is this rank's slice of the output
    at::Tensor all = at::full({8}, -1.0);
    at::Tensor mine = all.narrow(0, 4 * r, 4);
    mine.copy_(at::arange(4, at::kFloat) + 10 * r);
    g->all_gather(all, mine, "test");
    EXPECT_TRUE(at::equal(all, at::cat({at::arange(4, at::kFloat), at::arange(4, at::kFloat) + 10})));
    // refused: a strided input, mixed dtypes
    at::Tensor base = at::arange(16, at::kFloat), half = at::empty({4});
    at::Tensor strided = base.slice(0, 0, 16, 2);
    EXPECT_THAT(test::error_of([&] { g->reduce_scatter_async(half, strided); }),
                HasSubstr("reduce_scatter: non-contiguous input"));
    at::Tensor doubles = at::zeros({8}, at::kDouble);
    EXPECT_THAT(test::error_of([&] { g->reduce_scatter_async(half, doubles); }),
                HasSubstr("reduce_scatter: Double in, Float out"));
    at::Tensor gathered = at::empty({8}, at::kDouble), part = at::zeros({4});
    EXPECT_THAT(test::error_of([&] { g->all_gather(gathered, part, "test"); }),
                HasSubstr("all_gather: Float in, Double out"));
  });
}

}  // namespace
}  // namespace wick

namespace wick {
namespace {

// A linear model that records, at each forward, the collectives its rank has
// started so far and its current (local) gradient.
class Probe : public Model {
 public:
  explicit Probe(Group* g) : g_(g) { w_ = register_parameter("w", at::randn({4, 3})); }
  ForwardResult forward(const Batch& b) override {
    seen.push_back({g_->collectives(), w_.grad().defined() ? w_.grad().clone() : at::Tensor()});
    at::Tensor out = b.at("x").mm(w_);
    return {at::cross_entropy_loss(out, b.at("y"), {}, at::Reduction::Sum), b.at("x").size(0), {}};
  }
  struct Seen {
    std::int64_t collectives;
    at::Tensor grad;
  };
  std::vector<Seen> seen;
  at::Tensor w_;

 private:
  Group* g_;
};

TEST(Trainer, RanksExchangeNothingBeforeTheWindowsLastBackwardAndAgreeAfterIt) {
  std::vector<std::vector<Probe::Seen>> seen(2);
  std::vector<at::Tensor> grads(2), weights(2);
  std::vector<std::int64_t> before(2), after(2);
  auto opt0 = test::make<Optimizer>("sgd", PluginKind::Optim, {{"lr", Value(0.1)}});
  auto opt1 = test::make<Optimizer>("sgd", PluginKind::Optim, {{"lr", Value(0.1)}});
  two_ranks([&](std::shared_ptr<Group> g) {
    const int r = g->rank();
    at::manual_seed(100 + r);  // different starting weights: the trainer must broadcast rank 0's
    auto model = std::make_shared<Probe>(g.get());
    Trainer t(model, r == 0 ? opt0 : opt1, nullptr, {.group = g});
    std::vector<Batch> window;
    for (int m = 0; m < 3; ++m)  // each rank its own data
      window.push_back({{"x", at::randn({2, 4}) * (r + 1)}, {"y", at::randint(0, 3, {2})}});
    before[r] = g->collectives();
    t.step(window);
    after[r] = g->collectives();
    seen[r] = model->seen;
    grads[r] = model->w_.grad().clone();
    weights[r] = model->w_.detach().clone();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(seen[r].size(), 3u);
    // the item count is the window's only collective before its last backward
    EXPECT_EQ(seen[r][0].collectives, before[r] + 1);
    EXPECT_EQ(seen[r][1].collectives, before[r] + 1);
    EXPECT_EQ(seen[r][2].collectives, before[r] + 1);
    // then the out-of-memory agreement (before the last backward), one bucket
    // of gradients and one of loss and flags
    EXPECT_EQ(after[r], before[r] + 4);
  }
  EXPECT_FALSE(at::allclose(seen[0][2].grad, seen[1][2].grad));  // local gradients differ before the boundary
  EXPECT_TRUE(at::equal(grads[0], grads[1]));                     // the reduced ones are the same
  EXPECT_TRUE(at::equal(weights[0], weights[1]));
}

}  // namespace
}  // namespace wick
