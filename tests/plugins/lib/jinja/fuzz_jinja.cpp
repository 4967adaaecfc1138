// libFuzzer target for the Jinja engine (plugins/lib/jinja/): the input is a
// chat template's source, rendered on a conversation with tools. A
// TemplateError is a clean refusal; a crash, a hang or a sanitizer report is
// a bug (templates come from model folders, so they are untrusted input).
#include <cstdint>
#include <string>

#include "lib/jinja/jinja.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const auto context = nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, Grüße 🙂"},
                 {"role": "assistant", "content": "<think>x</think>Hello", "tool_calls": [
                   {"id": "call12345", "type": "function", "function": {"name": "f", "arguments": {"a": 1.5}}}]},
                 {"role": "tool", "content": "{\"ok\": true}"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "documents": null, "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"})");
  try {
    wick::jinja::ChatTemplate tpl(std::string(reinterpret_cast<const char*>(data), size));
    auto r = tpl.render(context);
    for (auto& [b, e] : r.generation_spans)
      if (b > e || e > r.text.size()) __builtin_trap();
  } catch (const wick::jinja::TemplateError&) {
  }
  return 0;
}
