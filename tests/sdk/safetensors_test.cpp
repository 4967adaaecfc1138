#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

#include "../test_util.hpp"
#include "wick/kit/safetensors.hpp"
#include "wick/kit/weights.hpp"

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
      {header_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "12345678"), "dtype F32 need 12"},
      {header_file(R"({"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}})", "12345678"), "unsupported dtype C64"},
      {header_file(R"({"a":{"dtype":"F32"}})", ""), "tensor 'a' lacks shape"},
      // what the reference library refuses as well
      {header_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                   "12345678"), "tensor 'b': data_offsets begin at byte 0, expected 8 where 'a' ends"},
      {header_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", "12345678"), "begin at byte 4, expected 0"},
      {header_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "12345678"), "cover 4 of the file's 8 data bytes"},
      {header_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                   "12345678"), "tensor 'a' is named twice"},
      {header_file(R"({"a":{"dtype":"F32","shape":[16.5,8],"data_offsets":[0,8]}})", "12345678"), "shape[0] is 16.5, expected a non-negative integer"},
      {header_file(R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", "12345678"), "shape[0] is 2.0"},
      {header_file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", "12345678"), "shape[0] is -2"},
      {header_file(R"({"a":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,0]}})", ""), "more bytes than 64 bits can count"},
      {header_file(R"({"a":{"dtype":"F32","shape":[0,1099511627776,1099511627776],"data_offsets":[0,0]}})", ""), "more bytes than 64 bits"},
      {header_file(R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", ""), "more bytes than 64 bits"},
      {header_file(R"({"a":{"dtype":3,"shape":[2],"data_offsets":[0,8]}})", "12345678"), "tensor 'a': dtype is 3, expected a string"},
      {header_file(R"({"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", "12345678"), "tensor 'a': shape is \"2\", expected a list"},
      {header_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":["0","8"]}})", "12345678"), "data_offsets is [\"0\",\"8\"]"},
      {header_file(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", "12345678"), "end before they begin"},
      {header_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", "12345678"), "expected two non-negative integers"},
      {header_file(R"({"__metadata__":{"a":1}})", ""), "__metadata__ key 'a' is 1, expected a string"},
      {header_file(R"([1])", ""), "header is a JSON array, expected an object"},
      {header_file(std::string(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})") + std::string(2, '\0'), "12345678"),
       "NUL byte"},
  };
  for (const auto& c : cases) {
    write_raw(p, c.bytes);
    auto msg = test::error_of([&] { read_safetensors(p); });
    EXPECT_THAT(msg, HasSubstr("corrupt safetensors file " + p.string())) << c.want;
    EXPECT_THAT(msg, HasSubstr(c.want));
  }
}

TEST(Safetensors, AcceptsWhatTheReferenceAccepts) {
  test::TempDir dir;
  const auto p = dir.path / "ok.safetensors";
  // entries in any order, zero-sized tensors anywhere, null metadata, spaces around the JSON
  write_raw(p, header_file(R"(  {"__metadata__":null,"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                           R"("z":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                           R"("y":{"dtype":"I8","shape":[0],"data_offsets":[0,0],"extra":1}}   )",
                           std::string("\0\0\x80\x3f\0\0\0\x40", 8)));
  auto f = read_safetensors(p);
  ASSERT_EQ(f.tensors.size(), 4u);
  EXPECT_EQ(f.get("a")->item<float>(), 1.0f);
  EXPECT_EQ(f.get("b")->item<float>(), 2.0f);
  EXPECT_EQ(f.get("z")->sizes(), (std::vector<std::int64_t>{0, 3}));
}

TEST(Safetensors, ADirectoryIsNamedAsOne) {
  test::TempDir dir;
  auto msg = test::error_of([&] { read_safetensors(dir.path); });
  EXPECT_THAT(msg, HasSubstr(dir.path.string() + " is a directory, expected a .safetensors file"));
}

TEST(Safetensors, AShardIndexNamesOnlyFilesInsideItsFolder) {
  test::TempDir dir;
  write_safetensors(dir.path / "a.safetensors", {{"x", at::ones({2})}});
  write_safetensors(dir.path / "b.safetensors", {{"x", at::ones({2})}});
  auto index = [&](const std::string& map) {
    std::ofstream(dir.path / "model.safetensors.index.json") << R"({"metadata":{},"weight_map":)" << map << "}";
    return test::error_of([&] { read_safetensors_folder(dir.path, "m"); });
  };
  EXPECT_THAT(index(R"({"x":"/etc/passwd"})"), HasSubstr("weight_map.x names the shard \"/etc/passwd\", expected a file inside the model folder"));
  EXPECT_THAT(index(R"({"x":"../../../../etc/passwd"})"), HasSubstr("names the shard \"../../../../etc/passwd\""));
  EXPECT_THAT(index(R"({"x":"sub/../../a.safetensors"})"), HasSubstr("expected a file inside the model folder"));
  EXPECT_THAT(index(R"({"x":"c.safetensors"})"), HasSubstr("weight_map.x is in the shard \"c.safetensors\", which does not exist"));
  EXPECT_THAT(index(R"({"x":3})"), HasSubstr("weight_map.x is 3, expected the name of a .safetensors file"));
  EXPECT_THAT(index(R"([1])"), HasSubstr("weight_map is [1], expected an object"));
  EXPECT_THAT(index(R"({"x":"a.safetensors","y":"b.safetensors"})"), HasSubstr("tensor 'x' is in both"));
  std::ofstream(dir.path / "model.safetensors.index.json") << R"({"weight_map":{"x":"./a.safetensors"}})";
  EXPECT_EQ(read_safetensors_folder(dir.path, "m").size(), 1u);
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

// Lazily made tensors (a model's dequantized or merged layers, written by
// save_pretrained) are made one at a time: each is gone before the next is made.
TEST(Safetensors, LazyTensorsAreMadeOneAtATime) {
  test::TempDir dir;
  const auto p = dir.path / "w.safetensors";
  int live = 0, most = 0;
  std::vector<LazyTensor> tensors;
  for (int i = 0; i < 4; ++i)
    tensors.push_back({"t" + std::to_string(i), at::kFloat, {2, 3}, [&live, &most, i] {
                         auto* buf = new float[6];
                         for (int k = 0; k < 6; ++k) buf[k] = static_cast<float>(10 * i + k);
                         most = std::max(most, ++live);
                         return at::from_blob(buf, {2, 3}, [&live](void* q) { delete[] static_cast<float*>(q); --live; },
                                              at::kFloat);
                       }});
  write_safetensors(p, tensors);
  EXPECT_EQ(most, 1);
  EXPECT_EQ(live, 0);
  const auto f = read_safetensors(p);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(f.get("t" + std::to_string(i))->flatten()[5].item<float>(), 10.0f * i + 5);
  // a tensor made otherwise than declared: named, and no file is left
  const auto q = dir.path / "bad.safetensors";
  std::vector<LazyTensor> bad{{"w", at::kBFloat16, {2}, [] { return at::ones({2}); }}};
  try {
    write_safetensors(q, bad);
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("w was made F32 [2], declared BF16 [2]"));
  }
  EXPECT_FALSE(fs::exists(q));
}

TEST(Safetensors, AnUnwritableFolderIsAnErrorNotACrash) {
  auto msg = test::error_of([] { write_safetensors("/proc/wick-no/w.safetensors", {{"a", at::ones({1})}}); });
  EXPECT_THAT(msg, HasSubstr("cannot write"));
}

// The process's resident set (VmRSS), in bytes.
std::int64_t resident_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

TEST(Safetensors, ReadTensorsAreCopyOnWriteViewsOfTheFile) {
  test::TempDir dir;
  const auto p = dir.path / "t.safetensors";
  const at::Tensor x = at::randn({64, 64});
  write_safetensors(p, {{"x", x}, {"y", at::arange(10)}});
  {
    auto f = read_safetensors(p);
    at::Tensor t = f.get("x")->clone();
    f.tensors[0].second.add_(1.0);  // written in place: this process's copy only
    EXPECT_TRUE(at::equal(f.tensors[0].second, x + 1.0));
    auto again = read_safetensors(p);
    EXPECT_TRUE(at::equal(*again.get("x"), x));  // the file is unchanged
    EXPECT_TRUE(at::equal(*again.get("y"), at::arange(10)));
  }
  // the mapping outlives the file object as long as one tensor lives
  at::Tensor kept;
  { kept = read_safetensors(p).tensors[1].second; }
  EXPECT_TRUE(at::equal(kept, at::arange(10)));
}

TEST(Safetensors, FreedTensorsLeaveTheResidentSet) {
  test::TempDir dir;
  const auto p = dir.path / "big.safetensors";
  const std::int64_t mib = 1 << 20;
  write_safetensors(p, {{"a", at::ones({32 * mib / 4})}, {"b", at::full({32 * mib / 4}, 2.0)}});
  auto f = read_safetensors(p);
  const std::int64_t mapped = resident_bytes();
  // reading every value brings the file's pages in
  EXPECT_EQ(f.get("a")->sum().item<double>() + f.get("b")->sum().item<double>(), 3.0 * 8 * mib);
  const std::int64_t touched = resident_bytes();
  EXPECT_GT(touched - mapped, 56 * mib);
  // dropping one tensor releases its pages, while the other still reads right
  f.tensors[0].second = at::Tensor();
  const std::int64_t one = resident_bytes();
  EXPECT_LT(one, touched - 28 * mib);
  EXPECT_EQ(f.get("b")->sum().item<double>(), 2.0 * 8 * mib);
  f = TensorFile();
  EXPECT_LT(resident_bytes(), touched - 56 * mib);
}

TEST(Safetensors, UnalignedTensorsAreReadAsCopies) {
  test::TempDir dir;
  const auto p = dir.path / "odd.safetensors";
  // a 57-byte header: the data starts at byte 65, not a multiple of 4
  const std::string json = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}   )";
  ASSERT_EQ((8 + json.size()) % 4, 1u);
  write_raw(p, header_file(json, std::string("\0\0\x80\x3f\0\0\0\x40", 8)));
  auto f = read_safetensors(p);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(f.get("a")->data_ptr()) % 4, 0u);
  EXPECT_TRUE(at::equal(*f.get("a"), at::tensor({1.0f, 2.0f})));
}

TEST(Safetensors, AWriteFailingMidStreamLeavesTheOldFileAndNoTemporary) {
  test::TempDir dir;
  const auto p = dir.path / "w.safetensors";
  write_safetensors(p, {{"a", at::ones({2})}});
  // the second tensor cannot be brought to the CPU: it fails after the first is written
  auto msg = test::error_of([&] {
    write_safetensors(p, {{"a", at::zeros({1000})}, {"b", at::empty({4}, at::TensorOptions().device(at::kMeta))}});
  });
  EXPECT_FALSE(msg.empty());
  EXPECT_TRUE(at::equal(*read_safetensors(p).get("a"), at::ones({2})));
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
}

TEST(Safetensors, StreamedWritesRoundTripLargeAndStridedTensors) {
  test::TempDir dir;
  const auto p = dir.path / "s.safetensors";
  const at::Tensor big = at::randn({1024, 1024}).to(at::kBFloat16);
  const at::Tensor strided = at::randn({300, 200}).t().narrow(0, 10, 100);
  write_safetensors(p, {{"big", big}, {"strided", strided}, {"small", at::arange(3, at::kInt)}});
  auto f = read_safetensors(p);
  EXPECT_TRUE(at::equal(*f.get("big"), big));
  EXPECT_TRUE(at::equal(*f.get("strided"), strided));
  EXPECT_TRUE(at::equal(*f.get("small"), at::arange(3, at::kInt)));
}

// VmHWM (peak resident set), in bytes, after resetting it when `reset`.
std::int64_t peak_bytes(bool reset = false) {
  if (reset) std::ofstream("/proc/self/clear_refs") << "5";
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

TEST(Safetensors, LoadingAFileIntoAModuleHoldsItOnce) {
  test::TempDir dir;
  const auto p = dir.path / "w.safetensors";
  const std::int64_t mib = 1 << 20, n = 96 * mib / 4;
  write_safetensors(p, {{"w", at::arange(n, at::kFloat).reshape({-1, 1024})}});
  torch::nn::Module m;
  at::Tensor w = m.register_parameter("w", at::empty({n / 1024, 1024}));  // untouched: not resident yet
  const std::int64_t before = resident_bytes();
  peak_bytes(/*reset=*/true);
  load_state(m, read_safetensors(p).tensors, p.string());
  const std::int64_t peak = peak_bytes() - before;
  EXPECT_TRUE(at::equal(w.view({-1}), at::arange(n, at::kFloat)));
  // the model's 96 MiB, plus a slice of the file at a time (a whole copy would be 192 MiB)
  EXPECT_GT(peak, 90 * mib);
  EXPECT_LT(peak, 120 * mib);
}

}  // namespace
}  // namespace wick
