#pragma once
// Hugging Face chat templates, rendered as transformers' apply_chat_template
// renders them: Python jinja2's language in an immutable sandbox with
// trim_blocks and lstrip_blocks, the loopcontrols extension, `{% generation %}`
// blocks, and transformers' globals (raise_exception, strftime_now, namespace,
// dict) and its tojson filter (json.dumps with ensure_ascii=False).
//
//   wick::jinja::ChatTemplate tpl(source);              // parses; throws TemplateError
//   auto r = tpl.apply(messages, {.add_generation_prompt = true,
//                                 .variables = {{"bos_token", "<s>"}}});  // throws TemplateError
//   r.text; r.generation_spans;                         // byte offsets into r.text

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace wick::jinja {

/// A template that does not parse, or fails while rendering. what() reads as
/// jinja2's message: raise_exception's message verbatim, "line N: ..." for a
/// syntax error, "'foo' is undefined" and the like for a bad lookup.
class TemplateError : public std::runtime_error {
 public:
  TemplateError(const std::string& message, int line) : std::runtime_error(message), line_(line) {}
  /// The template line where it happened (1-based), 0 when unknown.
  int line() const { return line_; }

 private:
  int line_;
};

struct RenderResult {
  std::string text;
  /// [begin, end) byte offsets into `text` of what each {% generation %}
  /// block produced, in order: the spans transformers reports (in
  /// characters) for return_assistant_tokens_mask. Like transformers', a
  /// block inside a macro or a `{% set %}` block starts where the top-level
  /// output stood when it ran, which is not where its text lands.
  std::vector<std::pair<std::size_t, std::size_t>> generation_spans;
};

/// What apply_chat_template passes besides the messages.
struct ChatOptions {
  /// JSON schemas of the tools (a list), or null.
  nlohmann::ordered_json tools = nullptr;
  nlohmann::ordered_json documents = nullptr;
  bool add_generation_prompt = false;
  /// Further variables: the tokenizer's special tokens (bos_token,
  /// eos_token, ...) and the caller's keyword arguments (enable_thinking, ...).
  nlohmann::ordered_json variables = nlohmann::ordered_json::object();
};

namespace detail {
struct Program;
}

class ChatTemplate {
 public:
  explicit ChatTemplate(const std::string& source);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  /// Renders with `context`'s keys as the template's variables (a JSON
  /// object: messages, tools, bos_token, add_generation_prompt, ...). A key
  /// that is absent is undefined, as in jinja2; transformers always passes
  /// tools and documents (null when not given), which callers should do too.
  /// Dicts keep their keys in the order the JSON holds them (tojson prints
  /// them so): parse with nlohmann::ordered_json; an nlohmann::json has
  /// already sorted them.
  RenderResult render(const nlohmann::ordered_json& context) const;
  RenderResult render(const nlohmann::json& context) const;

  /// Renders a conversation as transformers' apply_chat_template(messages,
  /// tokenize=False) does: the variables messages, tools, documents and
  /// add_generation_prompt, plus options.variables; a message's reasoning,
  /// under reasoning_content, thinking or reasoning, is given under both
  /// `thinking` and `reasoning_content` as transformers gives it.
  RenderResult apply(const nlohmann::ordered_json& messages, const ChatOptions& options = {}) const;

 private:
  std::shared_ptr<const detail::Program> program_;
};

}  // namespace wick::jinja
