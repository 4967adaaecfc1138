// The BPE tokenizer's two internal promises (issue 19): its pre-tokenizer
// regex runs PCRE2's JIT-compiled matcher, and its cache of pieces stays
// bounded on text of ever new words while the ids stay what they were.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
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

std::filesystem::path write_tokenizer() {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  vocab["he"] = 256;
  vocab["ll"] = 257;
  const nlohmann::json j = {
      {"version", "1.0"},
      {"added_tokens", nlohmann::json::array()},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"fuse_unk", false},
                 {"byte_fallback", false}, {"vocab", vocab}, {"merges", {"h e", "l l"}}}}};
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
