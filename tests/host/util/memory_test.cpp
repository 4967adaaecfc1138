// util/memory: the byte sizes that WICK_CPU_MEMORY_LIMIT and --device-memory
// take, and the message of an allocation the cap refuses.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>

#include "util/memory.hpp"
#include "wick/options.hpp"

namespace wick {
namespace {

TEST(ParseBytes, ReadsPlainNumbersAndUnits) {
  EXPECT_EQ(parse_bytes("0", "X"), 0);
  EXPECT_EQ(parse_bytes("1e9", "X"), 1000000000);
  EXPECT_EQ(parse_bytes("512MiB", "X"), 512LL << 20);
  EXPECT_EQ(parse_bytes("8GiB", "X"), 8LL << 30);
  EXPECT_EQ(parse_bytes("2GB", "X"), 2000000000);
  EXPECT_EQ(parse_bytes("1.5 KiB", "X"), 1536);
}

TEST(ParseBytes, RefusesWhatIsNotASizeNamingTheVariable) {
  for (const char* bad : {"abc", "-1", "", " 1", "0x10", "inf", "nan", "-0.5GiB", "1e30", "1e19", "9e9GiB", "5 parsecs"}) {
    try {
      parse_bytes(bad, "WICK_CPU_MEMORY_LIMIT");
      ADD_FAILURE() << "'" << bad << "' was taken";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("WICK_CPU_MEMORY_LIMIT: expected a size"), std::string::npos) << e.what();
    }
  }
}

TEST(CpuMemoryCap, ARefusedAllocationIsOneLineWithReadableSizes) {
  install_memory_tracking();
  set_cpu_memory_limit(1000);
  std::string what;
  try {
    at::empty({4096}, at::kFloat);
  } catch (const c10::OutOfMemoryError& e) {
    what = e.what();
  }
  set_cpu_memory_limit(0);
  ASSERT_FALSE(what.empty()) << "the cap refused nothing";
  EXPECT_EQ(what.find('\n'), std::string::npos) << what;  // no C++ frames, not even in what()
  EXPECT_NE(what.find(" held + 16.0 KiB more), over the cap of 1000 B"), std::string::npos) << what;
}

TEST(CpuMemoryCap, ACollectivesBuffersAreCountedButNotRefused) {
  install_memory_tracking();
  const std::int64_t before = cpu_tensor_memory().allocated;
  set_cpu_memory_limit(before + 1000);
  at::Tensor held;
  {
    CollectiveAllocations uncapped;
    held = at::empty({4096}, at::kFloat);  // over the cap: a collective's own buffer
  }
  const std::int64_t counted = cpu_tensor_memory().allocated - before;
  bool refused = false;
  try {
    at::empty({4096}, at::kFloat);  // the same, outside the scope
  } catch (const c10::OutOfMemoryError&) {
    refused = true;
  }
  set_cpu_memory_limit(0);
  EXPECT_GE(counted, 4096 * 4);
  EXPECT_TRUE(refused) << "the scope's end did not bring the cap back";
}

}  // namespace
}  // namespace wick
