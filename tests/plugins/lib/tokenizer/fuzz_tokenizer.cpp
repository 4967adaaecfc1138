// libFuzzer target for the tokenizer.json loader (plugins/lib/tokenizer/):
// the input is the file's text; a tokenizer that loads then encodes and
// decodes a multilingual text and the input's last bytes, and encodes them
// with offsets (the same ids, each range inside the text). A wick::Error is a
// clean refusal; a crash, a hang, a sanitizer report or an id outside the
// vocabulary is a bug.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unistd.h>

#include <wick/options.hpp>

#include "lib/tokenizer/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = "/tmp/wick-fuzz-tokenizer-" + std::to_string(::getpid()) + ".json";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  std::unique_ptr<wick::text::Tokenizer> tok;
  try {
    tok = wick::text::bpe_tokenizer(path);
  } catch (const wick::Error&) {
    return 0;
  }
  const std::string tail(reinterpret_cast<const char*>(data) + (size > 48 ? size - 48 : 0), size > 48 ? 48 : size);
  for (const std::string& text : {std::string("hello world, Grüße 中文 🙂 <|endoftext|> 3.14\n\n  x"), tail}) {
    try {
      const auto ids = tok->encode(text);
      for (auto id : ids)
        if (id < 0 || id >= tok->vocab_size()) std::abort();
      (void)tok->decode(ids);
      (void)tok->decode(ids, /*skip_special_tokens=*/true);
      // the offsets path: the same ids as encode without special tokens, one range each, inside the text
      const auto enc = tok->encode_with_offsets(text);
      if (enc.ids != tok->encode(text, false) || enc.offsets.size() != enc.ids.size()) std::abort();
      for (const auto& [b, e] : enc.offsets)
        if (b > e || e > text.size()) std::abort();
    } catch (const wick::Error&) {
    }
  }
  return 0;
}
