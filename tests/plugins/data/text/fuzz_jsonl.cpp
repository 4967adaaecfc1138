// libFuzzer target for data `text`'s JSONL reader (plugins/data/text/jsonl.hpp):
// the input is a file of lines. A wick::Error is a clean refusal of a line;
// a crash, a sanitizer report or an id accepted outside the vocabulary is a bug.
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include "lib/tokenizer/jsonl.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(data), size));
  std::string line;
  constexpr std::int64_t kVocab = 300;
  for (int n = 1; std::getline(in, line); ++n) {
    try {
      const auto r = wick::text::parse_jsonl_line(line, "fuzz.jsonl:" + std::to_string(n), kVocab);
      for (auto id : r.ids)
        if (id < 0 || id >= kVocab) std::abort();
    } catch (const wick::Error&) {
    }
  }
  return 0;
}
