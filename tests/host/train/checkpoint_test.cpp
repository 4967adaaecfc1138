// Checkpoints a kill or a damaged disk cannot make a run trust wrongly: each
// file's size and CRC-32C recorded, pruning by the step recorded inside,
// removal by renaming first, a `last` pointer, and the newest intact one found.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

#include "../../test_util.hpp"
#include "train/loader.hpp"
#include "train/trainer.hpp"
#include "util/checksum.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

namespace fs = std::filesystem;

struct Fixture {
  std::shared_ptr<Model> model = test::make<Model>("mlp", PluginKind::Model, {{"inputs", Value(4)}, {"outputs", Value(2)}});
  std::shared_ptr<Dataset> data = test::make<Dataset>("synthetic", PluginKind::Data,
                                                      {{"size", Value(32)}, {"inputs", Value(4)}, {"classes", Value(2)}});
  Trainer trainer{model, test::make<Optimizer>("sgd", PluginKind::Optim, {}), nullptr, TrainerConfig{}};
  void steps(int n) {
    LoaderConfig c;
    c.micro_batch = 4;
    Loader l(data, c);
    l.start_epoch(0);
    for (int i = 0; i < n; ++i) trainer.step(*l.next_window());
  }
};

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(Checkpoint, KeepsTheNewestByRecordedStepAndPointsLastAtTheNewest) {
  test::TempDir dir;
  Fixture s;
  for (int i = 0; i < 4; ++i) {
    s.steps(1);
    s.trainer.save(dir.path, {}, /*keep=*/2);
  }
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"last", "step-00000003", "step-00000004"}));
  EXPECT_EQ(read(dir.path / "last"), "step-00000004\n");
}

TEST(Checkpoint, LeftoversOfAKillAreClearedAndNeverTakenForACheckpoint) {
  test::TempDir dir;
  Fixture s;
  s.steps(1);
  s.trainer.save(dir.path, {}, 3);
  // a save killed before its rename, and a removal killed after its rename
  fs::create_directories(dir.path / ".step-00000009.tmp");
  fs::create_directories(dir.path / ".trash-step-00000000");
  EXPECT_EQ(latest_checkpoint(dir.path).filename(), "step-00000001");
  s.steps(1);
  s.trainer.save(dir.path, {}, 3);
  EXPECT_FALSE(fs::exists(dir.path / ".step-00000009.tmp"));
  EXPECT_FALSE(fs::exists(dir.path / ".trash-step-00000000"));
}

TEST(Checkpoint, EachFilesSizeAndChecksumAreRecordedAndChecked) {
  test::TempDir dir;
  Fixture s;
  s.steps(1);
  const fs::path first = s.trainer.save(dir.path, {}, 3);
  s.steps(1);
  const fs::path second = s.trainer.save(dir.path, {}, 3);
  const auto state = read_checkpoint_state(second);
  std::uint64_t bytes = 0;
  const auto crc = crc32c_file(second / "model.safetensors", &bytes);
  char hex[16];
  std::snprintf(hex, sizeof hex, "%08x", crc);
  EXPECT_EQ(state["files"]["model.safetensors"]["bytes"].get<std::uint64_t>(), bytes);
  EXPECT_EQ(state["files"]["model.safetensors"]["crc32c"].get<std::string>(), hex);
  EXPECT_EQ(checkpoint_problem(second), "");
  // one flipped byte in the newest: named, and the older one is taken
  {
    std::fstream f(second / "optimizer.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  EXPECT_THAT(checkpoint_problem(second), HasSubstr("optimizer.safetensors has CRC-32C"));
  std::vector<std::string> damaged;
  EXPECT_EQ(find_checkpoint(dir.path, &damaged), first);
  ASSERT_EQ(damaged.size(), 1u);
  EXPECT_THAT(damaged[0], HasSubstr("step-00000002: optimizer.safetensors has CRC-32C"));
  fs::remove(first / "rng.safetensors");
  EXPECT_EQ(find_checkpoint(dir.path), fs::path());
  EXPECT_EQ(checkpoint_problem(first), "rng.safetensors is missing");
}

TEST(Checksum, MatchesTheCrc32cCheckValue) {
  // the CRC-32C of "123456789" (RFC 3720's check value), in one piece and in two
  EXPECT_EQ(crc32c_extend(0, "123456789", 9), 0xe3069283u);
  EXPECT_EQ(crc32c_extend(crc32c_extend(0, "1234", 4), "56789", 5), 0xe3069283u);
  const std::string big(100003, 'x');
  EXPECT_EQ(crc32c_extend(crc32c_extend(0, big.data(), 50001), big.data() + 50001, 50002),
            crc32c_extend(0, big.data(), big.size()));
}

}  // namespace
}  // namespace wick
