#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

#include "../test_util.hpp"
#include "wick/kit/safetensors.hpp"

using ::testing::HasSubstr;
namespace fs = std::filesystem;

namespace wick {
namespace {

void write_raw(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary) << bytes;
}

std::string header_file(const std::string& json, const std::string& data) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((json.size() >> (8 * i)) & 0xff));
  return s + json + data;
}

TEST(Safetensors, RoundTripsEveryDtypeShapeAndMetadata) {
  test::TempDir dir;
  std::vector<std::pair<std::string, at::Tensor>> in = {
      {"f32", at::randn({3, 4})},
      {"f16", at::randn({5}).to(at::kHalf)},
      {"bf16", at::randn({2, 2, 2}).to(at::kBFloat16)},
      {"i64", at::arange(7)},
      {"i32", at::arange(6, at::kInt).reshape({2, 3})},
      {"u8", at::randint(0, 255, {4}, at::kByte)},
      {"bool", at::randn({6}).gt(0)},
      {"scalar", at::scalar_tensor(3.5)},
      {"empty", at::zeros({0, 3})},
      {"strided", at::randn({4, 4}).t()},
  };
  write_safetensors(dir.path / "t.safetensors", in, {{"format", "pt"}, {"note", "x"}});
  auto out = read_safetensors(dir.path / "t.safetensors");
  ASSERT_EQ(out.tensors.size(), in.size());
  for (const auto& [name, t] : in) {
    const at::Tensor* got = out.get(name);
    ASSERT_NE(got, nullptr) << name;
    EXPECT_EQ(got->scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(got->sizes(), t.sizes()) << name;
    EXPECT_TRUE(at::equal(*got, t)) << name;
  }
  EXPECT_EQ(out.metadata.at("note"), "x");
  // the data start is 8-byte aligned, as the reference writer makes it
  std::ifstream f(dir.path / "t.safetensors", std::ios::binary);
  std::uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ((n + 8) % 8, 0u);
}

TEST(Safetensors, MissingFileIsNamed) {
  auto msg = test::error_of([] { read_safetensors("/nonexistent/w.safetensors"); });
  EXPECT_THAT(msg, HasSubstr("cannot open safetensors file /nonexistent/w.safetensors"));
}

TEST(Safetensors, CorruptFilesAreNamedWithTheProblem) {
  test::TempDir dir;
  const auto p = dir.path / "bad.safetensors";
  struct Case {
    std::string bytes, want;
  } cases[] = {
      {"abc", "shorter than its 8-byte header length"},
      {std::string("\xe8\x03\0\0\0\0\0\0", 8) + "{}", "exceeds the file size"},
      {header_file("{not json}", ""), "not valid JSON"},
      {header_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "1234"), "outside the file"},
      {header_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "12345678"), "its shape and dtype need 12"},
      {header_file(R"({"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}})", "12345678"), "unsupported dtype C64"},
      {header_file(R"({"a":{"dtype":"F32"}})", ""), "lacks dtype, shape or data_offsets"},
  };
  for (const auto& c : cases) {
    write_raw(p, c.bytes);
    auto msg = test::error_of([&] { read_safetensors(p); });
    EXPECT_THAT(msg, HasSubstr("corrupt safetensors file " + p.string())) << c.want;
    EXPECT_THAT(msg, HasSubstr(c.want));
  }
}

TEST(Safetensors, WritesAtomicallyLeavingNoTemporaryFiles) {
  test::TempDir dir;
  const auto p = dir.path / "w.safetensors";
  write_safetensors(p, {{"a", at::ones({2})}});
  write_safetensors(p, {{"a", at::zeros({3})}});  // replaces the old file whole
  EXPECT_EQ(read_safetensors(p).get("a")->numel(), 3);
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
}

TEST(Safetensors, AnUnwritableFolderIsAnErrorNotACrash) {
  auto msg = test::error_of([] { write_safetensors("/proc/wick-no/w.safetensors", {{"a", at::ones({1})}}); });
  EXPECT_THAT(msg, HasSubstr("cannot write"));
}

}  // namespace
}  // namespace wick
