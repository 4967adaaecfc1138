#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iterator>

#include "../../../test_util.hpp"
#include "wick/data.hpp"

using ::testing::HasSubstr;

namespace wick {
namespace {

std::vector<std::int64_t> row(const at::Tensor& t) { return {t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel()}; }

TEST(TextData, PromptsAreMaskedAndBatchesPaddedWithIgnoredLabels) {
  test::TempDir dir;
  std::ofstream(dir.path / "d.jsonl") << R"({"prompt": "Q:", "completion": "ab"})" "\n"
                                      << R"({"text": "hello"})" "\n\n"
                                      << R"({"input_ids": [1, 2, 3]})" "\n";
  auto d = test::make<Dataset>("text", PluginKind::Data, {{"file", Value((dir.path / "d.jsonl").string())}});
  ASSERT_EQ(d->size(), 3);
  auto s0 = d->get(0);
  EXPECT_EQ(row(s0.at("input_ids")), (std::vector<std::int64_t>{'Q', ':', 'a', 'b', 256}));
  EXPECT_EQ(row(s0.at("labels")), (std::vector<std::int64_t>{-100, -100, 'a', 'b', 256}));
  auto b = d->get_batch({0, 1, 2});
  EXPECT_EQ(b.at("input_ids").sizes(), (std::vector<std::int64_t>{3, 6}));  // "hello" + end of text
  EXPECT_EQ(row(b.at("labels")[2]), (std::vector<std::int64_t>{1, 2, 3, -100, -100, -100}));
  EXPECT_EQ(row(b.at("input_ids")[2]), (std::vector<std::int64_t>{1, 2, 3, 256, 256, 256}));
  EXPECT_EQ(d->decode(d->encode("grüße")), "grüße");
}

TEST(TextData, TokenizedDocumentsAreCachedOnDiskUntilTheSourceChanges) {
  test::TempDir dir;
  const auto file = dir.path / "d.jsonl";
  std::ofstream(file) << R"({"prompt": "Q:", "completion": "ab"})" "\n" << R"({"text": "hello"})" "\n";
  const std::map<std::string, Value> opts{{"file", Value(file.string())}, {"cache_dir", Value((dir.path / "cache").string())}};
  auto first = test::make<Dataset>("text", PluginKind::Data, opts);
  EXPECT_FALSE(first->attributes().at("cached").as_bool());
  const std::string cache = first->attributes().at("cache_file").as_string();
  EXPECT_TRUE(std::filesystem::exists(cache)) << cache;
  auto second = test::make<Dataset>("text", PluginKind::Data, opts);
  EXPECT_TRUE(second->attributes().at("cached").as_bool());
  for (std::int64_t i = 0; i < 2; ++i) {  // the same samples, prompt masks included
    EXPECT_EQ(row(first->get(i).at("input_ids")), row(second->get(i).at("input_ids")));
    EXPECT_EQ(row(first->get(i).at("labels")), row(second->get(i).at("labels")));
  }
  // another max_length reuses the tokens; a changed source does not
  auto shorter = opts;
  shorter["max_length"] = Value(3);
  EXPECT_TRUE(test::make<Dataset>("text", PluginKind::Data, shorter)->attributes().at("cached").as_bool());
  std::ofstream(file, std::ios::app) << R"({"text": "more"})" "\n";
  auto changed = test::make<Dataset>("text", PluginKind::Data, opts);
  EXPECT_FALSE(changed->attributes().at("cached").as_bool());
  EXPECT_EQ(changed->size(), 3);
  // a corrupt cache file is tokenized again, not an error
  std::ofstream(changed->attributes().at("cache_file").as_string(), std::ios::trunc) << "garbage";
  auto again = test::make<Dataset>("text", PluginKind::Data, opts);
  EXPECT_FALSE(again->attributes().at("cached").as_bool());
  EXPECT_EQ(again->size(), 3);
  auto off = opts;
  off["cache_dir"] = Value("none");
  EXPECT_FALSE(test::make<Dataset>("text", PluginKind::Data, off)->attributes().at("cached").as_bool());
}

TEST(TextData, ACacheWithAFlippedByteIsTokenizedAgainToTheSameIds) {
  test::TempDir dir;
  const auto file = dir.path / "d.jsonl";
  std::ofstream(file) << R"({"prompt": "Q:", "completion": "ab"})" "\n" << R"({"text": "hello"})" "\n";
  const std::map<std::string, Value> opts{{"file", Value(file.string())}, {"cache_dir", Value((dir.path / "cache").string())}};
  auto fresh = test::make<Dataset>("text", PluginKind::Data, opts);
  const std::string cache = fresh->attributes().at("cache_file").as_string();
  // the first id's low byte, 8 + the header's length into the file: 'Q' becomes 'P', a valid id, the labels unchanged
  std::string bytes;
  {
    std::ifstream in(cache, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  ASSERT_GT(bytes.size(), 8u);
  std::uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = (header << 8) | static_cast<unsigned char>(bytes[static_cast<std::size_t>(i)]);
  ASSERT_NE(bytes.find("\"ids\""), std::string::npos);
  ASSERT_EQ(bytes[8 + header], 'Q');
  bytes[8 + header] ^= 0x01;
  std::ofstream(cache, std::ios::binary | std::ios::trunc) << bytes;
  testing::internal::CaptureStderr();
  auto again = test::make<Dataset>("text", PluginKind::Data, opts);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(again->attributes().at("cached").as_bool());
  EXPECT_THAT(err, HasSubstr("wick: data 'text': the token cache " + cache + " is damaged (its CRC-32C is "));
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  ASSERT_EQ(again->size(), fresh->size());
  for (std::int64_t i = 0; i < fresh->size(); ++i) {
    EXPECT_EQ(row(again->get(i).at("input_ids")), row(fresh->get(i).at("input_ids")));
    EXPECT_EQ(row(again->get(i).at("labels")), row(fresh->get(i).at("labels")));
  }
  // and rewritten whole: the next run reads it
  auto third = test::make<Dataset>("text", PluginKind::Data, opts);
  EXPECT_TRUE(third->attributes().at("cached").as_bool());
  EXPECT_EQ(row(third->get(0).at("input_ids")), row(fresh->get(0).at("input_ids")));
}

TEST(TextData, PackingCutsTheConcatenatedDocumentsIntoChunks) {
  test::TempDir dir;
  std::ofstream(dir.path / "a.txt") << "abcdefg";
  std::ofstream(dir.path / "b.txt") << "xyz";
  auto d = test::make<Dataset>("text", PluginKind::Data,
                               {{"files", Value(List{Value((dir.path / "a.txt").string()), Value((dir.path / "b.txt").string())})},
                                {"max_length", Value(4)},
                                {"pack", Value(true)}});
  // "abcdefg<eos>xyz<eos>": 12 tokens, 3 chunks of 4
  ASSERT_EQ(d->size(), 3);
  EXPECT_EQ(row(d->get(1).at("input_ids")), (std::vector<std::int64_t>{'e', 'f', 'g', 256}));
  EXPECT_EQ(row(d->get(2).at("input_ids")), (std::vector<std::int64_t>{'x', 'y', 'z', 256}));
  auto trunc = test::make<Dataset>("text", PluginKind::Data,
                                   {{"files", Value(List{Value((dir.path / "a.txt").string())})}, {"max_length", Value(3)}});
  EXPECT_EQ(row(trunc->get(0).at("input_ids")), (std::vector<std::int64_t>{'a', 'b', 'c'}));
}

TEST(TextData, BadLinesAreNamedWithFileAndLine) {
  test::TempDir dir;
  std::ofstream(dir.path / "d.jsonl") << R"({"text": "ok"})" "\n" << "{oops\n";
  auto msg = test::error_of([&] {
    test::make<Dataset>("text", PluginKind::Data, {{"file", Value((dir.path / "d.jsonl").string())}});
  });
  EXPECT_THAT(msg, HasSubstr((dir.path / "d.jsonl").string() + ":2 is not valid JSON"));
  std::ofstream(dir.path / "e.jsonl") << R"({"body": "x"})" "\n";
  msg = test::error_of([&] { test::make<Dataset>("text", PluginKind::Data, {{"file", Value((dir.path / "e.jsonl").string())}}); });
  EXPECT_THAT(msg, HasSubstr("e.jsonl:1 has none of text, input_ids, messages, or prompt and completion"));
}

TEST(TextData, ADocumentWithNothingToLearnFromIsSkippedCountedAndNamed) {
  test::TempDir dir;
  const auto file = dir.path / "d.jsonl";
  // line 2: one token (the end of text), nothing after it to predict; line 4:
  // a prompt that fills max_length, every label masked
  std::ofstream(file) << R"({"text": "ab"})" "\n" << R"({"text": ""})" "\n" << R"({"text": "cd"})" "\n"
                      << R"({"prompt": "a long prompt", "completion": "x"})" "\n";
  const std::map<std::string, Value> opts{{"file", Value(file.string())}, {"max_length", Value(4)},
                                          {"cache_dir", Value((dir.path / "cache").string())}};
  for (int pass = 0; pass < 2; ++pass) {  // tokenized, then read from the cache: the same names
    testing::internal::CaptureStderr();
    auto d = test::make<Dataset>("text", PluginKind::Data, opts);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_EQ(d->attributes().at("cached").as_bool(), pass == 1);
    EXPECT_EQ(d->size(), 2);
    EXPECT_EQ(d->attributes().at("skipped_items").as_int(), 2);
    EXPECT_EQ(row(d->get(1).at("input_ids")), (std::vector<std::int64_t>{'c', 'd', 256}));
    EXPECT_THAT(err, HasSubstr(file.string() + ":2: 1 token, and a sample needs 2"));
    EXPECT_THAT(err, HasSubstr(file.string() + ":4: every label after the first token is masked"));
  }
  // nothing left at all: an error naming the first
  std::ofstream(dir.path / "e.jsonl") << R"({"text": ""})" "\n";
  testing::internal::CaptureStderr();
  const auto msg = test::error_of([&] {
    test::make<Dataset>("text", PluginKind::Data, {{"file", Value((dir.path / "e.jsonl").string())}, {"cache_dir", Value("none")}});
  });
  testing::internal::GetCapturedStderr();
  EXPECT_THAT(msg, HasSubstr("no sample has anything to learn from (1 skipped; the first: " + (dir.path / "e.jsonl").string() + ":1"));
}

}  // namespace
}  // namespace wick
