// TFRecord framing of TensorBoard event files: CRC-32C against its published
// check values, and a written file walked record by record; metrics.jsonl's
// groups of records.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <algorithm>
#include <sstream>

#include <nlohmann/json.hpp>

#include "observe/events.hpp"
#include "observe/runlog.hpp"

namespace fs = std::filesystem;

TEST(Crc32c, KnownValues) {
  // RFC 3720 (iSCSI) B.4 and the CRC catalogue's check value
  EXPECT_EQ(wick::crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(wick::crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(wick::crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string inc;
  for (int i = 0; i < 32; ++i) inc.push_back(static_cast<char>(i));
  EXPECT_EQ(wick::crc32c(inc), 0x46DD794Eu);
  EXPECT_EQ(wick::crc32c(""), 0u);
  // the mask TFRecord applies: rotate right by 15, add a constant
  const std::uint32_t c = wick::crc32c("123456789");
  EXPECT_EQ(wick::masked_crc32c("123456789"), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(EventWriter, WritesWholeFramedRecords) {
  const auto dir = fs::temp_directory_path() / ("wick-events-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()));
  fs::remove_all(dir);
  std::string path;
  {
    wick::EventWriter w(dir.string());
    path = w.path();
    EXPECT_NE(fs::path(path).filename().string().find("events.out.tfevents."), std::string::npos);
    w.scalars(1, {{"train/loss", 0.5}, {"train/lr", 1e-3}}, 100.0);
    w.text(0, "recipe", "hello", 100.0);
    w.scalars(2, {}, 101.0);  // nothing: no record
    w.close();
    EXPECT_THROW(w.scalars(3, {{"x", 1.0}}, 102.0), std::runtime_error);
  }
  std::ifstream f(path, std::ios::binary);
  const std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::size_t pos = 0;
  int records = 0;
  auto u32 = [&](std::size_t at) {
    std::uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(data[at + i]);
    return v;
  };
  while (pos < data.size()) {
    ASSERT_LE(pos + 12, data.size());
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(data[pos + i]);
    EXPECT_EQ(u32(pos + 8), wick::masked_crc32c(std::string_view(data).substr(pos, 8)));
    ASSERT_LE(pos + 16 + n, data.size());
    EXPECT_EQ(u32(pos + 12 + n), wick::masked_crc32c(std::string_view(data).substr(pos + 12, n)));
    pos += 16 + n;
    ++records;
  }
  EXPECT_EQ(records, 3);  // file version, scalars of step 1, text
  EXPECT_NE(data.find("brain.Event:2"), std::string::npos);
  EXPECT_NE(data.find("train/loss"), std::string::npos);
  // train/loss = 0.5 as Summary.Value.simple_value: field 2, wire type 5
  // (key 0x15), then 0.5f little-endian; as torch.utils.tensorboard writes it
  EXPECT_NE(data.find(std::string("\x0atrain/loss\x15\x00\x00\x00\x3f", 16)), std::string::npos);
  EXPECT_EQ(data.find("scalars"), std::string::npos);  // no tensor summary under the scalars plugin
  fs::remove_all(dir);
}

TEST(EventWriter, UnwritableFolderIsAnError) {
  try {
    wick::EventWriter w("/proc/wick-cannot-write-here");
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("wick-cannot-write-here"), std::string::npos) << e.what();
  }
}

// metrics.jsonl: a group of records reaches the file whole, in one write, when
// the group is delivered; none of it before (a buffer that flushes when full,
// as stdio's 4 KiB one did, left part of a group on disk, its last line torn,
// for a kill to keep), and a second group is appended after the first.
TEST(RunLogObserver, MetricsGroupsReachTheFileWhole) {
  const fs::path dir = fs::path(::testing::TempDir()) / "wick_runlog_groups";
  fs::remove_all(dir);
  auto read = [&] {
    std::ifstream in(dir / "metrics.jsonl", std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  {
    wick::RunLogObserver obs(dir.string());
    wick::RunStart start;
    start.total_steps = 200;
    obs.on_start(start);
    auto rec = [](int step) {
      return nlohmann::json{{"step", step}, {"loss", 1.0 / step}, {"note", std::string(200, 'x')}};
    };
    for (int s = 1; s <= 50; ++s) obs.on_step(rec(s));
    EXPECT_EQ(read(), "") << "records reached the file before their group was delivered";
    obs.on_steps_delivered();
    const std::string first = read();
    EXPECT_GT(first.size(), 2u * 4096u);
    ASSERT_EQ(std::count(first.begin(), first.end(), '\n'), 50);
    for (int s = 51; s <= 100; ++s) obs.on_step(rec(s));
    EXPECT_EQ(read(), first);
    obs.on_steps_delivered();
    const std::string both = read();
    ASSERT_EQ(std::count(both.begin(), both.end(), '\n'), 100);
    std::istringstream lines(both);
    std::string line;
    for (int s = 1; std::getline(lines, line); ++s) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      ASSERT_TRUE(j.is_object()) << "line " << s;
      EXPECT_EQ(j["step"], s);
    }
    obs.on_end({{"status", "finished"}, {"steps", 100}});
  }
  fs::remove_all(dir);
}

// A metrics.jsonl that cannot be written (a full disk: /dev/full) is said once
// on stderr, naming the file and why, and the run's other records go on.
TEST(RunLogObserver, UnwritableMetricsAreSaidOnce) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  const fs::path dir = fs::path(::testing::TempDir()) / "wick_runlog_full";
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink("/dev/full", dir / "metrics.jsonl");
  {
    wick::RunLogObserver obs(dir.string());
    wick::RunStart start;
    start.total_steps = 4;
    obs.on_start(start);
    ::testing::internal::CaptureStderr();
    for (int s = 1; s <= 4; ++s) {
      obs.on_step({{"step", s}, {"loss", 1.0}});
      obs.on_steps_delivered();
    }
    obs.on_end({{"status", "finished"}, {"steps", 4}});
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("cannot write " + (dir / "metrics.jsonl").string()), std::string::npos) << err;
    EXPECT_NE(err.find("No space left"), std::string::npos) << err;
    EXPECT_EQ(err.find("cannot write"), err.rfind("cannot write")) << "said more than once: " << err;
  }
  std::ifstream in(dir / "run.json");
  const auto meta = nlohmann::json::parse(in, nullptr, false);
  ASSERT_TRUE(meta.is_object());
  EXPECT_EQ(meta["status"], "finished");
  fs::remove_all(dir);
}
