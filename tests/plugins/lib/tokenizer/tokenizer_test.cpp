// The BPE tokenizer's internal promises: its pre-tokenizer regex runs
// PCRE2's JIT-compiled matcher, and its cache of pieces stays bounded on text
// of ever new words while the ids stay what they were (issue 19); it encodes
// in time linear in a line's length, and refuses a normalizer that
// multiplies the text (issue 33). The long lines below take well under a
// second each; encoded in quadratic time, as before, each took hours, past
// ctest's timeout: the tests assert no time, the timeout does.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "lib/tokenizer/tokenizer.hpp"

namespace {

// GPT-2's byte-level alphabet: byte b as one printable code point, in UTF-8.
std::string byte_char(int b) {
  int cp = b;
  const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
  if (!printable) {
    int n = 0;
    for (int c = 0; c < b; ++c)
      if (!((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF))) ++n;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

std::filesystem::path write_tokenizer(const std::function<void(nlohmann::json&)>& edit = {}) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  vocab["he"] = 256;
  vocab["ll"] = 257;
  nlohmann::json j = {
      {"version", "1.0"},
      {"added_tokens", nlohmann::json::array()},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"fuse_unk", false},
                 {"byte_fallback", false}, {"vocab", vocab}, {"merges", {"h e", "l l"}}}}};
  if (edit) edit(j);
  const auto dir = std::filesystem::temp_directory_path() / ("wick_tokenizer_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << j.dump();
  return dir / "tokenizer.json";
}

}  // namespace

TEST(BpeTokenizer, RunsItsRegexThroughPcre2sJit) {
  const auto path = write_tokenizer();
  auto tok = wick::text::bpe_tokenizer(path.string());
  EXPECT_TRUE(tok->regex_jit());
  std::filesystem::remove_all(path.parent_path());
}

TEST(BpeTokenizer, KeepsItsPieceCacheBoundedOnEverNewWords) {
  const auto path = write_tokenizer();
  auto tok = wick::text::bpe_tokenizer(path.string());
  const auto hello = tok->encode(" hello", false);
  std::size_t most = 0;
  // 200,000 words never seen before, a thousand to a text
  for (int k = 0; k < 200; ++k) {
    std::string text;
    for (int i = 0; i < 1000; ++i) text += " w" + std::to_string(k * 1000 + i) + "x";
    tok->encode(text, false);
    most = std::max(most, tok->cached_pieces());
  }
  EXPECT_GT(most, 1000u);
  EXPECT_LE(most, std::size_t{1} << 16);  // not 200,000
  EXPECT_EQ(tok->encode(" hello", false), hello);  // after the cache was emptied, the same ids
  std::filesystem::remove_all(path.parent_path());
}

namespace {

// n bytes of `unit` repeated.
std::string line_of(const std::string& unit, std::size_t n) {
  std::string s;
  s.reserve(n + unit.size());
  while (s.size() < n) s += unit;
  return s;
}

}  // namespace

TEST(BpeTokenizer, EncodesAMultiMegabyteLineInLinearTime) {
  // PCRE2 checked the UTF-8 of the rest of the line at each match: 7 s for
  // 512 KB, hours for 16 MB
  const auto path = write_tokenizer();
  auto tok = wick::text::bpe_tokenizer(path.string());
  const auto one = tok->encode(" hello", false);
  ASSERT_EQ(one.size(), 4u);  // " ", "he", "ll", "o"
  const std::size_t words = (16u << 20) / 6;
  const auto ids = tok->encode(line_of(" hello", words * 6), false);
  ASSERT_EQ(ids.size(), words * one.size());
  for (std::size_t i = 0; i < ids.size(); i += 997 * one.size())
    EXPECT_EQ(std::vector<std::int64_t>(ids.begin() + i, ids.begin() + i + one.size()), one) << i;
  std::filesystem::remove_all(path.parent_path());
}

TEST(BpeTokenizer, SplitsOutAddedTokensOfALongLineInLinearTime) {
  // each match searched the rest of the line for every other added token: 29 s for 1 MB
  const auto path = write_tokenizer([](nlohmann::json& j) {
    for (auto [id, content] : {std::pair{258, "<|im_start|>"}, {259, "<|im_end|>"}, {260, "<|endoftext|>"}})
      j["added_tokens"].push_back({{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
                                   {"rstrip", false}, {"normalized", false}, {"special", true}});
  });
  auto tok = wick::text::bpe_tokenizer(path.string());
  const std::string turn = "<|im_start|>hello<|im_end|>";
  const auto one = tok->encode(turn, false);
  ASSERT_EQ(one, (std::vector<std::int64_t>{258, 256, 257, 'o', 259}));
  const std::size_t turns = (16u << 20) / turn.size();
  const auto ids = tok->encode(line_of(turn, turns * turn.size()), false);
  ASSERT_EQ(ids.size(), turns * one.size());
  EXPECT_EQ(std::vector<std::int64_t>(ids.end() - 5, ids.end()), one);
  std::filesystem::remove_all(path.parent_path());
}

TEST(BpeTokenizer, ReplacesThroughALongLineInLinearTime) {
  // Replace and Metaspace replaced in place, moving the rest of the line at
  // each occurrence: 41 s and 73 s for 2 MB of spaces; here 12 MB holding
  // 11 million tabs or spaces, in runs of 50 that each make one cached piece
  const std::string run(50, '\t');
  const std::size_t units = (12u << 20) / (run.size() + 5);
  // byte-level: tabs become U+2581, runs of which merge (bytes, then 2, 4, ..., 32 of them)
  const auto replace = write_tokenizer([](nlohmann::json& j) {
    j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"String", "\t"}}}, {"content", "\u2581"}};
    const std::string e2 = byte_char(0xE2), e296 = e2 + byte_char(0x96), bar = e296 + byte_char(0x81);
    j["model"]["vocab"][e296] = 258;
    j["model"]["vocab"][bar] = 259;
    j["model"]["merges"].push_back(e2 + " " + byte_char(0x96));
    j["model"]["merges"].push_back(e296 + " " + byte_char(0x81));
    std::string bars = bar;
    for (int k = 0; k < 5; ++k, bars += bars) {
      j["model"]["vocab"][bars + bars] = 260 + k;
      j["model"]["merges"].push_back(bars + " " + bars);
    }
  });
  auto tok = wick::text::bpe_tokenizer(replace.string());
  const std::vector<std::int64_t> unit{256, 257, 'o', 264, 263, 260};  // "he", "ll", "o", 32, 16 and 2 of U+2581
  EXPECT_EQ(tok->encode("hello" + run, false), unit);
  auto ids = tok->encode(line_of("hello" + run, units * (run.size() + 5)), false);
  ASSERT_EQ(ids.size(), units * unit.size());
  EXPECT_EQ(std::vector<std::int64_t>(ids.end() - 6, ids.end()), unit);
  std::filesystem::remove_all(replace.parent_path());

  // Metaspace (not split), then runs of its U+2581 split out
  const auto metaspace = write_tokenizer([](nlohmann::json& j) {
    j["model"]["vocab"] = {{"<unk>", 0}, {"h", 1}, {"i", 2}, {"hi", 3}, {"\u2581", 4}};
    j["model"]["merges"] = {"h i"};
    std::string bars = "\u2581";
    for (int k = 0; k < 5; ++k, bars += bars) {
      j["model"]["vocab"][bars + bars] = 5 + k;
      j["model"]["merges"].push_back(bars + " " + bars);
    }
    j["model"]["unk_token"] = "<unk>";
    j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {
        {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}, {"split", false}},
        {{"type", "Split"}, {"pattern", {{"Regex", "\u2581+"}}}, {"behavior", "Isolated"}, {"invert", false}}}}};
    j["decoder"] = nullptr;
  });
  tok = wick::text::bpe_tokenizer(metaspace.string());
  const std::string spaces(50, ' ');
  ids = tok->encode(line_of("hi" + spaces, units * (spaces.size() + 2)), false);
  // "\u2581" prepended, then "hi" and 32, 16, 2 of U+2581 for each
  ASSERT_EQ(ids.size(), 1 + units * 4);
  EXPECT_EQ(std::vector<std::int64_t>(ids.begin(), ids.begin() + 5), (std::vector<std::int64_t>{4, 3, 9, 8, 5}));
  EXPECT_EQ(std::vector<std::int64_t>(ids.end() - 4, ids.end()), (std::vector<std::int64_t>{3, 9, 8, 5}));
  std::filesystem::remove_all(metaspace.parent_path());
}

TEST(BpeTokenizer, RefusesANormalizerThatMultipliesTheText) {
  // 16 doublings: 65536 times the text, which the tokenizers library builds for as long as it takes
  const auto path = write_tokenizer([](nlohmann::json& j) {
    j["normalizer"] = {{"type", "Sequence"}, {"normalizers", nlohmann::json::array()}};
    for (int i = 0; i < 16; ++i)
      j["normalizer"]["normalizers"].push_back({{"type", "Replace"}, {"pattern", {{"String", "a"}}}, {"content", "aa"}});
  });
  auto tok = wick::text::bpe_tokenizer(path.string());
  std::string msg;
  try {
    tok->encode(std::string(10000, 'a'), false);
  } catch (const std::exception& e) {
    msg = e.what();
  }
  // 10,000 x 2^7 is the first past 64 x 10,000 + 4096
  EXPECT_NE(msg.find("tokenizer " + path.string() + ": normalizer.normalizers[6] (Replace \"a\" with \"aa\") makes a text "
                     "of 10000 bytes longer than 644096 bytes, the limit on normalized text (64 times the text's size "
                     "plus 4096 bytes)"),
            std::string::npos)
      << msg;
  EXPECT_EQ(tok->encode("hello", false).size(), 3u);  // a text it leaves alone is encoded
  std::filesystem::remove_all(path.parent_path());
}

TEST(BpeTokenizer, AReplaceDecoderWithAnEmptyPatternFillsEveryBoundaryOfEachToken) {
  // as the tokenizers library's: decoders.Replace("", "X").decode(["ab", "c"]) is "XaXbXXcX"
  const auto path = write_tokenizer([](nlohmann::json& j) {
    j["model"]["vocab"] = {{"<unk>", 0}, {"h", 1}, {"i", 2}, {"hi", 3}};
    j["model"]["merges"] = {"h i"};
    j["model"]["unk_token"] = "<unk>";
    j["pre_tokenizer"] = nullptr;
    j["decoder"] = {{"type", "Replace"}, {"pattern", {{"String", ""}}}, {"content", "X"}};
  });
  auto tok = wick::text::bpe_tokenizer(path.string());
  EXPECT_EQ(tok->decode({3, 1}), "XhXiXXhX");
  std::filesystem::remove_all(path.parent_path());
}

using Offsets = std::vector<std::pair<std::size_t, std::size_t>>;

TEST(BpeTokenizer, GivesEachByteLevelTokenTheCharactersItCameFrom) {
  const auto path = write_tokenizer([](nlohmann::json& j) {
    j["added_tokens"] = {{{"id", 258}, {"content", "<|x|>"}, {"special", true}, {"normalized", false}, {"lstrip", false},
                          {"rstrip", false}, {"single_word", false}}};
  });
  auto tok = wick::text::bpe_tokenizer(path.string());
  const std::string text = "hello <|x|>\xC3\xA9";  // é: two byte tokens, each holding the whole character
  const auto enc = tok->encode_with_offsets(text);
  EXPECT_EQ(enc.ids, tok->encode(text, false));
  EXPECT_EQ(enc.offsets, (Offsets{{0, 2}, {2, 4}, {4, 5}, {5, 6}, {6, 11}, {11, 13}, {11, 13}}));
  EXPECT_EQ(tok->decode(enc.ids, /*skip_special_tokens=*/true), "hello \xC3\xA9");
  EXPECT_EQ(tok->decode(enc.ids), text);
  std::filesystem::remove_all(path.parent_path());
}

TEST(BpeTokenizer, CarriesOffsetsThroughPrependAndReplaceNormalizersAndFusedUnknowns) {
  // LLaMA-2's kind: "hi zz" is normalized to "▁hi▁zz"; the prepended ▁ comes from the first character, the
  // replaced one from the space
  const auto path = write_tokenizer([](nlohmann::json& j) {
    j["model"]["vocab"] = {{"<unk>", 0}, {"\u2581", 1}, {"h", 2}, {"i", 3}, {"\u2581h", 4}};
    j["model"]["merges"] = {"\u2581 h"};
    j["model"]["unk_token"] = "<unk>";
    j["model"]["fuse_unk"] = true;
    j["normalizer"] = {{"type", "Sequence"},
                       {"normalizers", {{{"type", "Prepend"}, {"prepend", "\u2581"}},
                                        {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}};
    j["pre_tokenizer"] = nullptr;
    j["decoder"] = nullptr;
  });
  auto tok = wick::text::bpe_tokenizer(path.string());
  const auto enc = tok->encode_with_offsets("hi hi zz");
  EXPECT_EQ(enc.ids, (std::vector<std::int64_t>{4, 3, 4, 3, 1, 0}));
  EXPECT_EQ(enc.offsets, (Offsets{{0, 1}, {1, 2}, {2, 4}, {4, 5}, {5, 6}, {6, 8}}));
  std::filesystem::remove_all(path.parent_path());
}

TEST(BpeTokenizer, TrimsByteLevelOffsetsAsThePostProcessorSays) {
  // the tokenizers library's offsets for these (its ByteLevel post-processor, with or without special tokens;
  // the pre-tokenizer's trim_offsets does nothing)
  for (const bool prefix : {false, true}) {
    const auto path = write_tokenizer([&](nlohmann::json& j) {
      j["added_tokens"] = {{{"id", 258}, {"content", "<|x|>"}, {"special", true}, {"normalized", false},
                            {"lstrip", false}, {"rstrip", false}, {"single_word", false}}};
      j["model"]["vocab"]["\u0120w"] = 259;
      j["model"]["vocab"]["\u0120wo"] = 260;
      j["model"]["merges"] = {"h e", "l l", "\u0120 w", "\u0120w o"};
      j["post_processor"] = {{"type", "ByteLevel"}, {"add_prefix_space", prefix}, {"trim_offsets", true}, {"use_regex", true}};
    });
    auto tok = wick::text::bpe_tokenizer(path.string());
    // "he", "ll", "o", "Ġ", "Ġwo", "Ġ", "<|x|>", é's two bytes, "Ġ", "Ġ"
    auto enc = tok->encode_with_offsets("hello  wo <|x|>\xC3\xA9  ");
    EXPECT_EQ(enc.offsets, (Offsets{{0, 2}, {2, 4}, {4, 5}, {6, 6}, {7, 9}, {10, 10}, {10, 15}, {15, 17}, {15, 17},
                                    {18, 18}, {19, 19}}));
    // a first token's one leading space stays with add_prefix_space
    enc = tok->encode_with_offsets(" wo");
    EXPECT_EQ(enc.offsets, (Offsets{{prefix ? 0u : 1u, 3}}));
    enc = tok->encode_with_offsets("a \n wo");
    EXPECT_EQ(enc.offsets, (Offsets{{0, 1}, {2, 2}, {2, 3}, {4, 6}}));
    std::filesystem::remove_all(path.parent_path());
  }
}
