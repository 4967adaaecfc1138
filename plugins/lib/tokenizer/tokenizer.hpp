#pragma once
// Tokenizers for the text data plugin: UTF-8 bytes, or BPE read from a
// Hugging Face tokenizer.json: byte-level (GPT-2, Qwen2, LLaMA-3: NFC, a Split
// pre-tokenizer with its regex, ByteLevel) or with byte fallback (LLaMA-2,
// Mistral, LLaVA-1.5: Prepend and Replace normalizers or Metaspace, <0xXX>
// tokens, an unknown token), merges, added tokens with their flags, and the
// post-processor's template (a BOS token).

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace wick::text {

/// Ids with the bytes of the text each token came from: offsets[k] is
/// [begin, end) in the text given, widened to whole UTF-8 characters, as the
/// tokenizers library's offsets (in characters) are; what transformers'
/// char_to_token reads for return_assistant_tokens_mask.
struct Encoding {
  std::vector<std::int64_t> ids;
  std::vector<std::pair<std::size_t, std::size_t>> offsets;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  /// The ids of `text`; add_special_tokens applies the post-processor's
  /// template (LLaMA's BOS), as the tokenizers library's encode() does.
  virtual std::vector<std::int64_t> encode(const std::string& text, bool add_special_tokens) const = 0;
  std::vector<std::int64_t> encode(const std::string& text) const { return encode(text, true); }
  /// skip_special_tokens leaves out the added tokens marked special (and
  /// the bytes tokenizer's end of text and specials), as transformers'
  /// decode(ids, skip_special_tokens=True) does.
  virtual std::string decode(const std::vector<std::int64_t>& ids, bool skip_special_tokens) const = 0;
  std::string decode(const std::vector<std::int64_t>& ids) const { return decode(ids, false); }
  /// encode(text, add_special_tokens=false) with each token's offsets.
  virtual Encoding encode_with_offsets(const std::string& text) const = 0;
  virtual std::int64_t vocab_size() const = 0;
  /// The id of `token` (an added or special token), or -1.
  virtual std::int64_t token_id(const std::string& token) const = 0;
  /// Pieces whose ids are cached now (bounded, whatever the text), and
  /// whether every pre-tokenizer regex runs PCRE2's JIT-compiled matcher.
  virtual std::size_t cached_pieces() const { return 0; }
  virtual bool regex_jit() const { return false; }
};

/// UTF-8 bytes 0-255, and 256 for the end of a text ("<eos>"). `specials`
/// (such as "<image>") get the ids 257, 258, ... in order, and encode() gives
/// their id where the text holds them; vocab_size() is 257 + their number.
std::unique_ptr<Tokenizer> byte_tokenizer(const std::vector<std::string>& specials = {});

/// The end-of-text token a data set appends when the recipe names none: the
/// first of <|endoftext|> (GPT-2, Qwen2), </s> (LLaMA-2, Mistral, LLaVA-1.5),
/// <|end_of_text|> (LLaMA-3) and <eos> (bytes) the tokenizer knows, else
/// <|endoftext|> (which the caller then reports missing).
std::string default_eos(const Tokenizer& t);

/// BPE from a tokenizer.json; errors name the file and what it holds that is
/// not supported.
std::unique_ptr<Tokenizer> bpe_tokenizer(const std::string& tokenizer_json);

}  // namespace wick::text
