#pragma once
// Tokenizers for the text data plugin: UTF-8 bytes, or byte-level BPE read
// from a Hugging Face tokenizer.json (GPT-2 and Qwen2 style: NFC, a Split
// pre-tokenizer with its regex, ByteLevel, merges, added and special tokens).

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace wick::text {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<std::int64_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<std::int64_t>& ids) const = 0;
  virtual std::int64_t vocab_size() const = 0;
  /// The id of `token` (an added or special token), or -1.
  virtual std::int64_t token_id(const std::string& token) const = 0;
};

/// UTF-8 bytes 0-255, and 256 for the end of a text ("<eos>"). `specials`
/// (such as "<image>") get the ids 257, 258, ... in order, and encode() gives
/// their id where the text holds them; vocab_size() is 257 + their number.
std::unique_ptr<Tokenizer> byte_tokenizer(const std::vector<std::string>& specials = {});

/// Byte-level BPE from a tokenizer.json; errors name the file and what it
/// holds that is not supported.
std::unique_ptr<Tokenizer> bpe_tokenizer(const std::string& tokenizer_json);

}  // namespace wick::text
