#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <future>
#include <thread>

#include "../test_util.hpp"
#include "dist/group.hpp"
#include "dist/reducer.hpp"

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

// Two ranks as two threads of this process, over gloo on loopback.
template <class F>
void two_ranks(F&& body) {
  const int port = 29000 + static_cast<int>(::getpid() % 5000);
  auto run = [&](int rank) {
    DistEnv env;
    env.rank = rank;
    env.world_size = 2;
    env.local_rank = rank;
    env.local_world_size = 2;
    env.master_port = port;
    auto g = std::make_shared<Group>(env, "gloo");
    body(g);
  };
  auto other = std::async(std::launch::async, run, 1);
  run(0);
  other.get();
}

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

TEST(GradReducer, SumsGradientsOverRanksStartingBucketsDuringTheBackward) {
  two_ranks([](std::shared_ptr<Group> g) {
    // three layers, buckets small enough that each parameter has its own
    at::manual_seed(0);
    std::vector<at::Tensor> w{at::randn({64, 64}).requires_grad_(), at::randn({64, 64}).requires_grad_(),
                              at::randn({64, 64}).requires_grad_()};
    GradReducer r(g, w, /*bucket_mb=*/0.01);
    EXPECT_EQ(r.buckets(), 3u);
    auto loss_of = [&](int rank) {
      at::Tensor x = at::full({4, 64}, static_cast<double>(rank + 1));
      for (auto& p : w) x = at::tanh(x.mm(p));
      return x.sum();
    };
    r.arm();
    loss_of(g->rank()).backward();
    EXPECT_GE(r.launched_during_backward(), 2u);  // the last layers' buckets went before the backward ended
    r.finish(1);
    // reference: both ranks' losses in one backward on fresh copies
    std::vector<at::Tensor> ref;
    for (auto& p : w) ref.push_back(p.detach().clone().requires_grad_());
    at::Tensor total = at::zeros({});
    for (int rank = 0; rank < 2; ++rank) {
      at::Tensor x = at::full({4, 64}, static_cast<double>(rank + 1));
      for (auto& p : ref) x = at::tanh(x.mm(p));
      total = total + x.sum();
    }
    total.backward();
    for (std::size_t k = 0; k < w.size(); ++k) EXPECT_TRUE(at::allclose(w[k].grad(), ref[k].grad(), 1e-5, 1e-6));
  });
}

}  // namespace
}  // namespace wick
