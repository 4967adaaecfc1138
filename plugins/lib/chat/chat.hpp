#pragma once
// Chat data for data `text`: a model folder's chat template (its
// chat_template.jinja, or tokenizer_config.json's chat_template) with the
// special tokens transformers passes it, and the tokens and labels of TRL's
// conversational rows: {"messages": [...]} with the loss on the assistant's
// turns, and {"prompt": [...], "completion": [...]} with the loss on the
// completion.

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lib/jinja/jinja.hpp"
#include "lib/tokenizer/tokenizer.hpp"

namespace wick::text {

using Spans = std::vector<std::pair<std::size_t, std::size_t>>;

class ChatFormat {
 public:
  /// The template of `folder` (chat_template.jinja first, as transformers
  /// reads it, then tokenizer_config.json's chat_template: a string, or a
  /// list of named templates of which "default" is taken) and the special
  /// tokens of tokenizer_config.json (bos_token, eos_token, ...). A folder
  /// without one is no error until a conversation needs it.
  explicit ChatFormat(std::string folder);

  bool has_template() const { return tpl_.has_value(); }
  /// The file the template came from ("" when none), and its text for cache keys.
  const std::string& file() const { return file_; }
  const std::string& source() const { return source_; }
  /// "the chat template of <folder>" ... : the error for a conversation
  /// without a template, `what` naming what needed it.
  [[noreturn]] void missing(const std::string& what) const;

  /// apply_chat_template(messages, tokenize=False): the template's message
  /// (raise_exception's, verbatim) is thrown as a wick::Error after `where`
  /// and the template's file. `extra`: tools, documents and further variables.
  jinja::RenderResult render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                             const std::string& where,
                             const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

  /// Whether the template marks the assistant's turns with {% generation %}.
  bool has_generation() const { return has_generation_; }

 private:
  std::string folder_, file_, source_;
  std::optional<jinja::ChatTemplate> tpl_;
  nlohmann::ordered_json specials_ = nlohmann::ordered_json::object();
  bool has_generation_ = false;
};

/// The special token `key` (eos_token, ...) of `folder`'s
/// tokenizer_config.json, or "" when it has none (or no such file).
std::string config_token(const std::string& folder, const std::string& key);

/// The conversation `messages` checked as a chat template expects it: a
/// list of objects with a string "role" and a "content" that is a string, a
/// list of parts ({"type": "text", ...}), or null beside tool_calls. Errors
/// name `where` and the message ("messages[2].content").
void check_messages(const nlohmann::ordered_json& messages, const std::string& where, const std::string& key);

struct ChatTokens {
  std::vector<std::int64_t> ids, labels;  // labels: the id, or -100 where it does not count
  /// Set when the prompt's tokens do not begin the whole row's (TRL warns
  /// of it too): the first as many tokens are masked all the same.
  bool prompt_not_prefix = false;
};

/// A {"messages"} row: rendered whole, tokenized without special tokens (as
/// apply_chat_template(tokenize=True) does), its labels those of the
/// assistant's turns (with assistant_only_loss; else every token): the
/// {% generation %} spans where the template has them, else each assistant
/// message's rendered turn (assistant_spans).
/// `extra`: the row's tools and chat_template_kwargs, as render() takes them.
ChatTokens messages_tokens(const ChatFormat& chat, const Tokenizer& tok, const nlohmann::ordered_json& messages,
                           bool assistant_only_loss, const std::string& where,
                           const nlohmann::ordered_json& extra = nlohmann::ordered_json::object());

/// A conversational {"prompt", "completion"} row, as TRL's SFTTrainer
/// tokenizes it: the prompt rendered with the generation prompt, the prompt
/// and completion rendered together; with completion_only_loss the first
/// tokens (as many as the prompt's) do not count.
ChatTokens prompt_completion_tokens(const ChatFormat& chat, const Tokenizer& tok, const nlohmann::ordered_json& prompt,
                                    const nlohmann::ordered_json& completion, bool completion_only_loss,
                                    const std::string& where,
                                    const nlohmann::ordered_json& extra = nlohmann::ordered_json::object());

/// Each assistant message's turn in `text` (the render of all `messages`),
/// for templates without {% generation %}: from the end of the render of the
/// messages before it with the generation prompt to the end of the render
/// of the messages up to it, where both are beginnings of `text`; else the
/// message's content found in `text` after the previous turn, with the
/// eos_token right after it. Byte offsets.
Spans assistant_spans(const ChatFormat& chat, const nlohmann::ordered_json& messages, const std::string& text,
                      const std::string& where, const std::string& eos_token,
                      const nlohmann::ordered_json& extra = nlohmann::ordered_json::object());

/// transformers' continue_final_message (render_jinja_template): the final
/// message's `field` ("content", or a reasoning field), or its last text
/// part when a list of parts, gets a tag after its text; after the render,
/// continued_text() cuts the text at the tag, so it ends inside the final
/// message. Returns the field's text before the tag. Errors (`where`
/// first) as transformers raises them: no such field, a field the template
/// (`source`) never names, no text part, content of another type.
std::string tag_final_message(nlohmann::ordered_json& messages, const std::string& field, const std::string& source,
                              const std::string& where);
/// The render `text` cut at the tag (trailing whitespace trimmed where the
/// template trimmed the message); an error naming `template_file` when the
/// render lost the final message (`final_text`) or the tag.
std::string continued_text(const std::string& text, const std::string& final_text, const std::string& field,
                           const std::string& where, const std::string& template_file);

/// transformers' return_assistant_tokens_mask: for each span, the tokens
/// from the one holding its first character to the one holding its last
/// (to the end when that is token 0 or none); a span whose first character
/// no token holds ends the marking.
std::vector<bool> span_mask(const Encoding& enc, const Spans& spans, const std::string& text);

}  // namespace wick::text
