// The run context: the command line's pairs, which keys were read, by whom
// and when, and the warnings' rule that names each unread key once.
#include "train/run_context.hpp"

#include <gtest/gtest.h>

namespace wick {
namespace {

using Pairs = std::vector<RunContext::Pair>;

TEST(RunContext, ValueIsTheLastOneGivenForAKey) {
  RunContext c(Pairs{{"lr", "0.1"}, {"tag", "a"}, {"lr", "0.2"}});
  EXPECT_EQ(c.value("lr"), "0.2");
  EXPECT_EQ(c.value("tag"), "a");
  EXPECT_FALSE(c.value("epochs").has_value());
}

TEST(RunContext, KeepsTheFirstReadWithItsReaderAndTheRunsBeforeIt) {
  RunContext c(Pairs{{"lr", "0.1"}, {"epochs", "2"}});
  c.read("epochs", RunContext::Reader::Run);
  c.start_run();
  c.read("lr", RunContext::Reader::Recipe);
  c.read("epochs", RunContext::Reader::Recipe);  // a later read changes nothing
  ASSERT_TRUE(c.first_read("epochs"));
  EXPECT_EQ(c.first_read("epochs")->by, RunContext::Reader::Run);
  EXPECT_EQ(c.first_read("epochs")->runs_before, 0);
  ASSERT_TRUE(c.first_read("lr"));
  EXPECT_EQ(c.first_read("lr")->by, RunContext::Reader::Recipe);
  EXPECT_EQ(c.first_read("lr")->runs_before, 1);
}

TEST(RunContext, AKeyNotGivenIsNeverRead) {
  RunContext c(Pairs{{"lr", "0.1"}});
  c.read("seed", RunContext::Reader::Recipe);
  EXPECT_FALSE(c.first_read("seed"));
  EXPECT_EQ(c.report_unread(), (Pairs{{"lr", "0.1"}}));
}

TEST(RunContext, ReportsEachUnreadKeyOnceInCommandLineOrder) {
  RunContext c(Pairs{{"b", "1"}, {"a", "2"}, {"c", "3"}, {"b", "4"}});
  c.read("c", RunContext::Reader::Recipe);
  // only keys for which the filter holds now; the others wait
  EXPECT_EQ(c.report_unread([](const std::string& k) { return k == "a"; }), (Pairs{{"a", "2"}}));
  EXPECT_EQ(c.report_unread(), (Pairs{{"b", "1"}, {"b", "4"}}));
  EXPECT_TRUE(c.report_unread().empty());
}

TEST(RunContext, AKeyReadBeforeTheReportIsNotNamed) {
  RunContext c(Pairs{{"lr", "0.1"}, {"tag", "x"}});
  c.start_run();
  c.read("tag", RunContext::Reader::Recipe);  // after the run: still a read
  EXPECT_EQ(c.report_unread(), (Pairs{{"lr", "0.1"}}));
  EXPECT_EQ(join_pairs(Pairs{{"lr", "0.1"}, {"tag", "x"}}), "lr=0.1 tag=x");
}

}  // namespace
}  // namespace wick
