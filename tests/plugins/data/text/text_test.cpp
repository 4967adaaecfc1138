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

TEST(TextData, PadToMultipleOfRoundsABatchsLengthUpWithinMaxLength) {
  test::TempDir dir;
  std::ofstream(dir.path / "d.jsonl") << R"({"input_ids": [1, 2, 3, 4, 5]})" "\n"
                                      << R"({"input_ids": [6, 7]})" "\n";
  const auto file = Value((dir.path / "d.jsonl").string());
  auto d = test::make<Dataset>("text", PluginKind::Data, {{"file", file}, {"pad_to_multiple_of", Value(4)}});
  auto b = d->get_batch({0, 1});
  EXPECT_EQ(b.at("input_ids").sizes(), (std::vector<std::int64_t>{2, 8}));  // the longest, 5, rounded up to 8
  EXPECT_EQ(row(b.at("input_ids")[0]), (std::vector<std::int64_t>{1, 2, 3, 4, 5, 256, 256, 256}));
  EXPECT_EQ(row(b.at("labels")[0]), (std::vector<std::int64_t>{1, 2, 3, 4, 5, -100, -100, -100}));
  EXPECT_EQ(row(b.at("labels")[1]), (std::vector<std::int64_t>{6, 7, -100, -100, -100, -100, -100, -100}));
  EXPECT_EQ(d->get_batch({1}).at("input_ids").size(1), 4);  // 2 -> 4
  // never past max_length (a multiple beyond it stops there), never below the longest
  auto capped = test::make<Dataset>("text", PluginKind::Data,
                                    {{"file", file}, {"pad_to_multiple_of", Value(4)}, {"max_length", Value(6)}});
  EXPECT_EQ(capped->get_batch({0, 1}).at("input_ids").size(1), 6);
  auto plain = test::make<Dataset>("text", PluginKind::Data, {{"file", file}});
  EXPECT_EQ(plain->get_batch({0, 1}).at("input_ids").size(1), 5);
  for (const auto& bad : {Value(0), Value(-8), Value(2.5), Value("8")}) {
    try {
      test::make<Dataset>("text", PluginKind::Data, {{"file", file}, {"pad_to_multiple_of", bad}});
      ADD_FAILURE() << "pad_to_multiple_of accepted";
    } catch (const std::exception& e) {
      EXPECT_THAT(e.what(), HasSubstr("pad_to_multiple_of"));
    }
  }
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

TEST(TextData, PackAttentionDocumentRestartsPositionsAndMasksEachDocumentsFirstTarget) {
  test::TempDir dir;
  std::ofstream(dir.path / "a.txt") << "abcdefg";
  std::ofstream(dir.path / "b.txt") << "xyz";
  const List files{Value((dir.path / "a.txt").string()), Value((dir.path / "b.txt").string())};
  auto d = test::make<Dataset>("text", PluginKind::Data,
                               {{"files", Value(files)}, {"max_length", Value(5)}, {"pack", Value(true)},
                                {"pack_attention", Value("document")}, {"cache_dir", Value("none")}});
  // "abcdefg<eos>xyz<eos>": chunks "abcde", "fg<eos>xy", "z<eos>"
  ASSERT_EQ(d->size(), 3);
  auto s0 = d->get(0), s1 = d->get(1), s2 = d->get(2);
  EXPECT_EQ(row(s0.at("position_ids")), (std::vector<std::int64_t>{0, 1, 2, 3, 4}));
  // a document cut by the chunk's start begins anew at 0; "xyz" restarts too
  EXPECT_EQ(row(s1.at("position_ids")), (std::vector<std::int64_t>{0, 1, 2, 0, 1}));
  EXPECT_EQ(row(s1.at("labels")), (std::vector<std::int64_t>{'f', 'g', 256, -100, 'y'}));
  EXPECT_EQ(row(s2.at("position_ids")), (std::vector<std::int64_t>{0, 1}));
  // a batch pads position_ids on, continuing the row's last document
  auto b = d->get_batch({2, 0});
  EXPECT_EQ(row(b.at("position_ids")[0]), (std::vector<std::int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(row(b.at("labels")[0]), (std::vector<std::int64_t>{'z', 256, -100, -100, -100}));
  // the default, "row", is today's: no position_ids, every label kept
  auto r = test::make<Dataset>("text", PluginKind::Data,
                               {{"files", Value(files)}, {"max_length", Value(5)}, {"pack", Value(true)},
                                {"cache_dir", Value("none")}});
  EXPECT_EQ(r->get(1).count("position_ids"), 0u);
  EXPECT_EQ(row(r->get(1).at("labels")), (std::vector<std::int64_t>{'f', 'g', 256, 'x', 'y'}));
  EXPECT_EQ(r->get_batch({0, 1}).count("position_ids"), 0u);
}

TEST(TextData, FilesTakePatternsExpandedSortedAndJsonlByName) {
  test::TempDir dir;
  std::filesystem::create_directories(dir.path / "data");
  std::ofstream(dir.path / "data" / "b.jsonl") << R"({"text": "b1"})" "\n" << R"({"text": "b2"})" "\n";
  std::ofstream(dir.path / "data" / "a.jsonl") << R"({"text": "a1"})" "\n";
  std::ofstream(dir.path / "data" / "c.txt") << R"({"text": "not json here"})";
  std::ofstream(dir.path / "more.txt") << "more";
  auto d = test::make<Dataset>("text", PluginKind::Data,
                               {{"files", Value(List{Value((dir.path / "data" / "*.jsonl").string()),
                                                     Value((dir.path / "more.txt").string())})},
                                {"cache_dir", Value("none")}});
  ASSERT_EQ(d->size(), 4);  // a1, then b1, b2 (sorted), then more.txt
  EXPECT_EQ(row(d->get(0).at("input_ids")), (std::vector<std::int64_t>{'a', '1', 256}));
  EXPECT_EQ(row(d->get(2).at("input_ids")), (std::vector<std::int64_t>{'b', '2', 256}));
  EXPECT_EQ(row(d->get(3).at("input_ids")), (std::vector<std::int64_t>{'m', 'o', 'r', 'e', 256}));
  // a .txt file is plain text, whatever it holds
  auto t = test::make<Dataset>("text", PluginKind::Data,
                               {{"files", Value(List{Value((dir.path / "data" / "c.*").string())})}, {"cache_dir", Value("none")}});
  ASSERT_EQ(t->size(), 1);
  EXPECT_EQ(t->get(0).at("input_ids").size(0), 26);  // its 25 bytes and the end of text
  // a file whose name looks like a pattern is itself
  std::ofstream(dir.path / "odd[1].txt") << "odd";
  std::ofstream(dir.path / "odd1.txt") << "not this one";
  auto odd = test::make<Dataset>("text", PluginKind::Data,
                                 {{"files", Value(List{Value((dir.path / "odd[1].txt").string())})}, {"cache_dir", Value("none")}});
  ASSERT_EQ(odd->size(), 1);
  EXPECT_EQ(row(odd->get(0).at("input_ids")), (std::vector<std::int64_t>{'o', 'd', 'd', 256}));
  const auto none = (dir.path / "data" / "*.parquet").string();
  auto msg = test::error_of([&] {
    test::make<Dataset>("text", PluginKind::Data, {{"files", Value(List{Value(none)})}, {"cache_dir", Value("none")}});
  });
  EXPECT_THAT(msg, HasSubstr("data 'text': files[1] '" + none + "' matches no file"));
  msg = test::error_of([&] {
    test::make<Dataset>("text", PluginKind::Data,
                        {{"files", Value(List{Value((dir.path / "more.txt").string()), Value((dir.path / "data").string())})}});
  });
  EXPECT_THAT(msg, HasSubstr("files[2] '" + (dir.path / "data").string() + "' is a folder"));
}

std::vector<std::vector<std::int64_t>> all_rows(const Dataset& d) {
  std::vector<std::vector<std::int64_t>> out;
  for (std::int64_t i = 0; i < d.size(); ++i) out.push_back(row(d.get(i).at("input_ids")));
  return out;
}

TEST(TextData, EvalFractionHoldsOutWholeDocumentsDrawnBySeed) {
  test::TempDir dir;
  {
    std::ofstream f(dir.path / "d.jsonl");
    for (int i = 0; i < 40; ++i) f << R"({"text": "document )" << i << R"( with some words"})" "\n";
  }
  auto make = [&](const std::string& split, double fraction, std::int64_t seed, bool pack) {
    return test::make<Dataset>("text", PluginKind::Data,
                               {{"file", Value((dir.path / "d.jsonl").string())}, {"split", Value(split)},
                                {"eval_fraction", Value(fraction)}, {"split_seed", Value(seed)},
                                {"pack", Value(pack)}, {"max_length", Value(64)}});
  };
  auto train = make("train", 0.05, 0, false), eval = make("eval", 0.05, 0, false);
  EXPECT_EQ(eval->size(), 2);  // ceil(0.05 * 40)
  EXPECT_EQ(train->size(), 38);
  EXPECT_EQ(eval->attributes().at("documents").as_int(), 2);
  auto tr = all_rows(*train), ev = all_rows(*eval);
  for (const auto& e : ev) EXPECT_EQ(std::count(tr.begin(), tr.end(), e), 0);
  EXPECT_EQ(all_rows(*make("eval", 0.05, 0, false)), ev);  // the same draw every time
  EXPECT_NE(all_rows(*make("eval", 0.05, 1, false)), ev);  // another seed, other documents
  EXPECT_EQ(make("eval", 0.001, 0, false)->size(), 1);    // never empty when > 0
  // documents, not chunks: the packed eval half is the held-out documents' tokens
  std::int64_t tokens = 0;
  for (const auto& e : ev) tokens += static_cast<std::int64_t>(e.size());
  auto packed = make("eval", 0.05, 0, true);
  EXPECT_EQ(packed->attributes().at("tokens").as_int(), tokens);
  EXPECT_EQ(packed->attributes().at("documents").as_int(), 2);
  const auto msg = test::error_of([&] { make("train", 0.99, 0, false); });
  EXPECT_THAT(msg, HasSubstr("eval_fraction 0.99 holds out 40 of the 40 documents, leaving none to train on"));
}

TEST(TextData, EvalFilesAreTheEvalSplitAndLeftOutOfTraining) {
  test::TempDir dir;
  std::filesystem::create_directories(dir.path / "data");
  std::ofstream(dir.path / "data" / "a.jsonl") << R"({"text": "train"})" "\n";
  std::ofstream(dir.path / "data" / "val.jsonl") << R"({"text": "held"})" "\n" << R"({"text": "out"})" "\n";
  auto make = [&](const std::string& split) {
    return test::make<Dataset>("text", PluginKind::Data,
                               {{"files", Value(List{Value((dir.path / "data" / "*.jsonl").string())})},
                                {"eval_files", Value(List{Value((dir.path / "data" / "val.jsonl").string())})},
                                {"split", Value(split)}, {"cache_dir", Value("none")}});
  };
  auto train = make("train"), eval = make("eval");
  ASSERT_EQ(train->size(), 1);
  EXPECT_EQ(row(train->get(0).at("input_ids")).size(), 6u);  // "train" + end of text
  ASSERT_EQ(eval->size(), 2);
  EXPECT_EQ(row(eval->get(1).at("input_ids")), (std::vector<std::int64_t>{'o', 'u', 't', 256}));
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
