#include <gtest/gtest.h>

#include <set>

#include "../../test_util.hpp"
#include "train/loader.hpp"

namespace wick {
namespace {

// A data set whose sample i is the number i, to see exactly what the loader hands out.
class Counting : public Dataset {
 public:
  explicit Counting(std::int64_t n) : n_(n) {}
  std::int64_t size() const override { return n_; }
  Sample get(std::int64_t i) const override { return {{"i", at::scalar_tensor(i, at::kLong)}}; }

 private:
  std::int64_t n_;
};

std::vector<std::vector<std::vector<std::int64_t>>> epoch_windows(Loader& l, std::int64_t epoch) {
  std::vector<std::vector<std::vector<std::int64_t>>> out;
  l.start_epoch(epoch);
  while (auto w = l.next_window()) {
    out.emplace_back();
    for (auto& b : *w) {
      auto t = b.at("i");
      out.back().emplace_back(t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
    }
  }
  return out;
}

TEST(Loader, EverySampleOncePerEpochInWindowsOfAccumulateMicroBatches) {
  auto data = std::make_shared<Counting>(23);
  Loader l(data, {.micro_batch = 3, .accumulate = 2, .seed = 5});
  EXPECT_EQ(l.windows_per_epoch(), 4);  // ceil(23 / 6)
  auto w = epoch_windows(l, 0);
  ASSERT_EQ(w.size(), 4u);
  std::multiset<std::int64_t> seen;
  for (std::size_t k = 0; k < w.size(); ++k)
    for (std::size_t m = 0; m < w[k].size(); ++m) {
      for (auto i : w[k][m]) seen.insert(i);
      if (k + 1 < w.size()) EXPECT_EQ(w[k][m].size(), 3u);
    }
  EXPECT_EQ(seen.size(), 23u);
  EXPECT_EQ(std::set<std::int64_t>(seen.begin(), seen.end()).size(), 23u);
  // the last window holds the 5 left: a micro-batch of 3 and one of 2
  ASSERT_EQ(w.back().size(), 2u);
  EXPECT_EQ(w.back()[1].size(), 2u);
}

TEST(Loader, DropLastDropsOnlyTheShortWindow) {
  auto data = std::make_shared<Counting>(23);
  Loader l(data, {.micro_batch = 3, .accumulate = 2, .drop_last = true});
  EXPECT_EQ(l.windows_per_epoch(), 3);
  auto w = epoch_windows(l, 0);
  ASSERT_EQ(w.size(), 3u);
  for (auto& win : w) EXPECT_EQ(win.size(), 2u);
}

TEST(Loader, OrderDependsOnSeedAndEpochOnlyNotOnTheSplit) {
  auto data = std::make_shared<Counting>(40);
  auto flat = [](const std::vector<std::vector<std::vector<std::int64_t>>>& w) {
    std::vector<std::int64_t> f;
    for (auto& win : w)
      for (auto& m : win) f.insert(f.end(), m.begin(), m.end());
    return f;
  };
  Loader a(data, {.micro_batch = 2, .accumulate = 4, .seed = 9});
  Loader b(data, {.micro_batch = 8, .accumulate = 1, .seed = 9});
  Loader c(data, {.micro_batch = 8, .accumulate = 1, .seed = 10});
  EXPECT_EQ(flat(epoch_windows(a, 0)), flat(epoch_windows(b, 0)));
  EXPECT_NE(flat(epoch_windows(a, 0)), flat(epoch_windows(a, 1)));
  EXPECT_NE(flat(epoch_windows(b, 0)), flat(epoch_windows(c, 0)));
  Loader d(data, {.micro_batch = 8, .accumulate = 1, .shuffle = false});
  auto in_order = flat(epoch_windows(d, 0));
  for (std::int64_t i = 0; i < 40; ++i) EXPECT_EQ(in_order[i], i);
}

TEST(Loader, WorkersGiveTheSameBatchesInTheSameOrder) {
  auto data = std::make_shared<Counting>(101);
  Loader serial(data, {.micro_batch = 4, .accumulate = 3, .seed = 1});
  Loader threaded(data, {.micro_batch = 4, .accumulate = 3, .seed = 1, .workers = 3, .prefetch = 2});
  for (int e = 0; e < 2; ++e) EXPECT_EQ(epoch_windows(serial, e), epoch_windows(threaded, e));
}

TEST(Loader, ResumesMidEpochAtTheSameWindow) {
  auto data = std::make_shared<Counting>(50);
  Loader l(data, {.micro_batch = 2, .accumulate = 2, .seed = 3, .workers = 2});
  auto all = epoch_windows(l, 1);
  l.start_epoch(1, 5);
  auto w = l.next_window();
  ASSERT_TRUE(w);
  auto t = (*w)[0].at("i");
  EXPECT_EQ(t[0].item<std::int64_t>(), all[5][0][0]);
}

TEST(Loader, RanksGetDisjointShardsCoveringTheData) {
  auto data = std::make_shared<Counting>(30);
  std::set<std::int64_t> seen;
  for (int rank = 0; rank < 3; ++rank) {
    auto order = epoch_order(30, {.seed = 2, .rank = rank, .world_size = 3}, 0);
    EXPECT_EQ(order.size(), 10u);
    for (auto i : order) EXPECT_TRUE(seen.insert(i).second);
  }
  EXPECT_EQ(seen.size(), 30u);
}

// A data set that fails on one sample: the error reaches the consumer.
class Failing : public Counting {
 public:
  using Counting::Counting;
  Sample get(std::int64_t i) const override {
    if (i == 7) throw Error("sample 7 is broken");
    return Counting::get(i);
  }
};

TEST(Loader, AWorkerErrorIsRethrownNotLostOrHung) {
  auto data = std::make_shared<Failing>(20);
  Loader l(data, {.micro_batch = 2, .accumulate = 1, .shuffle = false, .workers = 2});
  std::string msg;
  try {
    while (l.next_window()) {
    }
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_EQ(msg, "sample 7 is broken");
}

TEST(Loader, BadConfigurationIsAnError) {
  auto data = std::make_shared<Counting>(4);
  EXPECT_THROW(Loader(data, {.micro_batch = 0}), Error);
  EXPECT_THROW(Loader(data, {.accumulate = 0}), Error);
  EXPECT_THROW(Loader(std::make_shared<Counting>(0), {}), Error);
}

}  // namespace
}  // namespace wick
