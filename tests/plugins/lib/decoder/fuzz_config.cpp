// libFuzzer target for the config.json reader (plugins/lib/decoder/config.cpp):
// the input is the file's text. A wick::Error is a clean refusal; a crash, a
// sanitizer report, or a config accepted with sizes the decoder cannot be
// built from is a bug.
#include <cstdint>
#include <cstdlib>
#include <string>

#include <wick/kit/json_fields.hpp>

#include "lib/decoder/config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const auto j = wick::parse_json_text(text, "fuzz/config.json");
    const auto c = wick::decoder::config_from_hf(j, "fuzz/config.json");
    if (c.vocab < 1 || c.hidden < 1 || c.intermediate < 1 || c.layers < 1 || c.heads < 1 || c.kv_heads < 1 ||
        c.head_dim < 2 || c.head_dim % 2 || c.heads % c.kv_heads || !(c.rope_theta > 0) || !(c.eps >= 0))
      std::abort();
    (void)wick::decoder::hf_config(c).dump();
  } catch (const wick::Error&) {
  }
  return 0;
}
