#include "lib/chat/chat.hpp"

#include <wick/kit/json_fields.hpp>
#include <wick/options.hpp>

#include <filesystem>
#include <fstream>
#include <algorithm>
#include <regex>
#include <sstream>

namespace fs = std::filesystem;
using nlohmann::ordered_json;

namespace wick::text {
namespace {

constexpr std::int64_t kIgnore = -100;

std::string brief(const ordered_json& v) { return wick::json_brief(nlohmann::json(v)); }

// A special token of tokenizer_config.json: a string, or an AddedToken ({"content": ...}).
std::optional<std::string> token_text(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return std::nullopt;
}

// The messages as apply_chat_template hands them to the template: keys
// whose value is null dropped (transformers 5 drops them: many templates
// render a null content as "None").
ordered_json without_nulls(const ordered_json& messages) {
  ordered_json out = ordered_json::array();
  for (const auto& m : messages) {
    ordered_json kept = ordered_json::object();
    for (auto it = m.begin(); it != m.end(); ++it)
      if (!it.value().is_null()) kept[it.key()] = it.value();
    out.push_back(std::move(kept));
  }
  return out;
}

}  // namespace

ChatFormat::ChatFormat(std::string folder) : folder_(std::move(folder)) {
  const fs::path dir(folder_);
  const fs::path jinja = dir / "chat_template.jinja", config = dir / "tokenizer_config.json";
  std::error_code ec;
  nlohmann::json cfg;
  if (fs::is_regular_file(config, ec)) {
    cfg = wick::read_json_file(config);
    if (!cfg.is_object()) throw Error(config.string() + " is " + wick::json_brief(cfg) + ", expected a JSON object");
  }
  if (fs::is_regular_file(jinja, ec)) {
    std::ifstream in(jinja, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    source_ = ss.str();
    file_ = jinja.string();
  } else if (cfg.is_object() && cfg.contains("chat_template") && !cfg["chat_template"].is_null()) {
    const auto& t = cfg["chat_template"];
    file_ = config.string();
    if (t.is_string()) {
      source_ = t.get<std::string>();
    } else if (t.is_array()) {  // named templates: [{"name": "default", "template": "..."}, ...]
      for (const auto& named : t)
        if (named.is_object() && named.value("name", "") == "default" && named.contains("template") &&
            named["template"].is_string())
          source_ = named["template"].get<std::string>();
      if (source_.empty())
        throw Error(config.string() + ": chat_template is a list without a template named \"default\", expected "
                    "a string or a list of {\"name\", \"template\"} holding \"default\"");
    } else {
      throw Error(config.string() + ": chat_template is " + wick::json_brief(t) +
                  ", expected a string (a Jinja template) or a list of {\"name\", \"template\"}");
    }
  }
  if (!file_.empty()) {
    try {
      tpl_.emplace(source_);
    } catch (const jinja::TemplateError& e) {
      throw Error("the chat template " + file_ + " does not parse: " + e.what());
    }
    has_generation_ = std::regex_search(source_, std::regex(R"(\{%-?\s*generation\s*-?%\})"));
  }
  // the named special tokens transformers passes the template (its special_tokens_map)
  for (const char* k : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"})
    if (cfg.is_object() && cfg.contains(k))
      if (auto s = token_text(cfg[k])) specials_[k] = *s;
}

std::string config_token(const std::string& folder, const std::string& key) {
  const fs::path config = fs::path(folder) / "tokenizer_config.json";
  std::error_code ec;
  if (!fs::is_regular_file(config, ec)) return "";
  const auto cfg = wick::read_json_file(config);
  if (!cfg.is_object() || !cfg.contains(key)) return "";
  return token_text(cfg[key]).value_or("");
}

void ChatFormat::missing(const std::string& what) const {
  throw Error(what + " needs a chat template, and the tokenizer folder " + folder_ +
              " has none: expected chat_template.jinja or a \"chat_template\" in tokenizer_config.json there (as "
              "transformers saves them beside tokenizer.json)");
}

jinja::RenderResult ChatFormat::render(const ordered_json& messages, bool add_generation_prompt, const std::string& where,
                                       const ordered_json& extra) const {
  if (!tpl_) missing(where);
  jinja::ChatOptions o;
  o.add_generation_prompt = add_generation_prompt;
  o.variables = specials_;
  for (auto it = extra.begin(); it != extra.end(); ++it) {
    if (it.key() == "tools") o.tools = it.value();
    else if (it.key() == "documents") o.documents = it.value();
    else o.variables[it.key()] = it.value();  // keyword arguments over the special tokens, as transformers
  }
  try {
    return tpl_->apply(without_nulls(messages), o);
  } catch (const jinja::TemplateError& e) {
    throw Error(where + ": the chat template " + file_ + (e.line() > 0 ? " (line " + std::to_string(e.line()) + ")" : "") +
                " failed: " + e.what());
  }
}

void check_messages(const ordered_json& messages, const std::string& where, const std::string& key) {
  if (!messages.is_array())
    throw Error(where + ": " + key + " is " + brief(messages) +
                ", expected a list of messages ({\"role\": ..., \"content\": ...})");
  if (messages.empty()) throw Error(where + ": " + key + " is an empty list, expected at least one message");
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const auto& m = messages[i];
    const std::string at = key + "[" + std::to_string(i) + "]";
    if (!m.is_object())
      throw Error(where + ": " + at + " is " + brief(m) + ", expected a message ({\"role\": ..., \"content\": ...})");
    if (!m.contains("role") || !m["role"].is_string())
      throw Error(where + ": " + at + ".role is " + (m.contains("role") ? brief(m["role"]) : std::string("missing")) +
                  ", expected a string (\"system\", \"user\", \"assistant\", ...)");
    const bool calls = m.contains("tool_calls") && !m["tool_calls"].is_null();
    const auto c = m.find("content");
    const bool ok = c != m.end() ? (c->is_string() || c->is_array() || (c->is_null() && calls)) : calls;
    if (!ok)
      throw Error(where + ": " + at + ".content is " + (c != m.end() ? brief(*c) : std::string("missing")) +
                  ", expected a string (or a list of parts such as {\"type\": \"text\", \"text\": ...}; null only "
                  "beside tool_calls)");
  }
}

namespace {
// Python's str.strip() (rstrip with left false) of the ASCII whitespace
std::string py_strip(const std::string& s, bool left = true) {
  static const char* ws = " \t\n\r\v\f\x1c\x1d\x1e\x1f";
  const auto e = s.find_last_not_of(ws);
  if (e == std::string::npos) return "";
  const auto b = left ? s.find_first_not_of(ws) : 0;
  return s.substr(b, e + 1 - b);
}

// the tag transformers writes after the final message's text, where the render is cut
constexpr const char* kContinueTag = "CONTINUE_FINAL_MESSAGE_TAG ";
}  // namespace

std::string tag_final_message(ordered_json& messages, const std::string& field, const std::string& source,
                              const std::string& where) {
  const std::string at = where + ": continue_final_message";
  if (!messages.is_array() || messages.empty() || !messages.back().is_object())
    throw Error(at + ": expected a conversation whose last message is the one to continue");
  auto& last = messages.back();
  if (!last.contains(field) || last[field].is_null())
    throw Error(at + ": the final message has no \"" + field + "\" to continue, expected the message to continue last");
  if (source.find(field) == std::string::npos)
    throw Error(at + " is \"" + field + "\", which the chat template does not read, expected a field it renders "
                "(content, or the reasoning its template shows)");
  auto& v = last[field];
  if (v.is_array()) {
    for (auto it = v.rbegin(); it != v.rend(); ++it)
      if (it->is_object() && it->contains("text") && (*it)["text"].is_string()) {
        const std::string text = (*it)["text"].get<std::string>();
        (*it)["text"] = text + kContinueTag;
        return text;
      }
    throw Error(at + ": the final message's " + field +
                " has no part with text, expected a {\"type\": \"text\", \"text\": ...} part to continue");
  }
  if (!v.is_string())
    throw Error(at + ": the final message's " + field + " is " + brief(v) + ", expected a string or a list of parts");
  const std::string text = v.get<std::string>();
  v = text + kContinueTag;
  return text;
}

std::string continued_text(const std::string& text, const std::string& final_text, const std::string& field,
                           const std::string& where, const std::string& template_file) {
  const std::string tag = kContinueTag, bare = py_strip(tag);
  if (text.find(py_strip(final_text)) == std::string::npos || text.find(bare) == std::string::npos)
    throw Error(where + ": continue_final_message, but the final message does not appear in the render of the chat "
                "template of " + template_file + " (the template leaves out part of it), expected a template that "
                "renders the final message's " + field);
  const auto at = text.rfind(bare);
  return text.compare(at, tag.size(), tag) == 0 ? text.substr(0, at) : py_strip(text.substr(0, at), false);
}

std::vector<bool> span_mask(const Encoding& enc, const Spans& spans, const std::string& text) {
  const std::size_t n = enc.ids.size();
  std::vector<bool> mask(n, false);
  // the first token whose (character-wide) offsets hold byte b, as the tokenizers library's char_to_token
  auto token_at = [&](std::size_t b) -> std::optional<std::size_t> {
    for (std::size_t t = 0; t < n; ++t)
      if (enc.offsets[t].first <= b && b < enc.offsets[t].second) return t;
    return std::nullopt;
  };
  for (const auto& [b, e] : spans) {
    const auto start = b < text.size() ? token_at(b) : std::nullopt;
    if (!start) break;  // as transformers: nothing after it is marked
    std::optional<std::size_t> end;
    if (e > 0 && e <= text.size()) {
      std::size_t last = e - 1;
      while (last > 0 && (static_cast<unsigned char>(text[last]) & 0xC0) == 0x80) --last;
      end = token_at(last);
    }
    const std::size_t stop = end && *end > 0 ? *end + 1 : n;
    for (std::size_t t = *start; t < stop; ++t) mask[t] = true;
  }
  return mask;
}

Spans assistant_spans(const ChatFormat& chat, const ordered_json& messages, const std::string& text,
                      const std::string& where, const std::string& eos_token, const ordered_json& extra) {
  Spans spans;
  std::size_t cursor = 0;
  for (std::size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].value("role", "") != "assistant") continue;
    std::optional<std::pair<std::size_t, std::size_t>> span;
    try {
      const ordered_json before(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(i));
      const ordered_json upto(messages.begin(), messages.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      const std::string head = i > 0 ? chat.render(before, true, where, extra).text : std::string();
      const std::string turn = chat.render(upto, false, where, extra).text;
      if (i > 0 && head.size() >= cursor && head.size() < turn.size() && turn.starts_with(head) && text.starts_with(turn))
        span.emplace(head.size(), turn.size());
    } catch (const Error&) {
      // a template that refuses the shorter conversation: find the content instead
    }
    if (!span) {
      const auto& c = messages[i].find("content");
      if (c == messages[i].end() || !c->is_string() || c->get<std::string>().empty())
        throw Error(where + ": messages[" + std::to_string(i) +
                    "] (the assistant's) cannot be found in the rendered conversation: its content is not a "
                    "non-empty string, and rendering the conversation up to it does not give the beginning of the "
                    "whole; set assistant_only_loss = false, or use a template with {% generation %}");
      const std::string content = c->get<std::string>();
      std::size_t at = text.find(content, cursor);
      std::string trimmed = content;
      if (at == std::string::npos) {  // templates that strip the content (LLaMA-2's content.strip(), Gemma's | trim)
        const auto first = content.find_first_not_of(" \t\r\n"), last = content.find_last_not_of(" \t\r\n");
        if (first != std::string::npos) trimmed = content.substr(first, last - first + 1);
        at = text.find(trimmed, cursor);
      }
      if (at == std::string::npos)
        throw Error(where + ": messages[" + std::to_string(i) +
                    "] (the assistant's) is not in the conversation the chat template renders, so its tokens cannot be "
                    "told apart; set assistant_only_loss = false, or use a template with {% generation %}");
      std::size_t end = at + trimmed.size();
      if (!eos_token.empty() && text.compare(end, eos_token.size(), eos_token) == 0) end += eos_token.size();
      span.emplace(at, end);
    }
    spans.push_back(*span);
    cursor = span->second;
  }
  return spans;
}

ChatTokens messages_tokens(const ChatFormat& chat, const Tokenizer& tok, const ordered_json& messages,
                           bool assistant_only_loss, const std::string& where, const ordered_json& extra) {
  check_messages(messages, where, "messages");
  const auto r = chat.render(messages, false, where, extra);
  const Encoding enc = tok.encode_with_offsets(r.text);
  ChatTokens out{enc.ids, enc.ids};
  if (!assistant_only_loss) return out;
  std::string eos;
  for (const char* e : {"<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>"})
    if (tok.token_id(e) >= 0 && r.text.find(e) != std::string::npos) {
      eos = e;
      break;
    }
  const Spans spans = chat.has_generation() ? Spans(r.generation_spans.begin(), r.generation_spans.end())
                                            : assistant_spans(chat, messages, r.text, where, eos, extra);
  const auto mask = span_mask(enc, spans, r.text);
  for (std::size_t t = 0; t < mask.size(); ++t)
    if (!mask[t]) out.labels[t] = kIgnore;
  return out;
}

ChatTokens prompt_completion_tokens(const ChatFormat& chat, const Tokenizer& tok, const ordered_json& prompt,
                                    const ordered_json& completion, bool completion_only_loss, const std::string& where,
                                    const ordered_json& extra) {
  check_messages(prompt, where, "prompt");
  check_messages(completion, where, "completion");
  ordered_json all = prompt;
  for (const auto& m : completion) all.push_back(m);
  const auto ids = tok.encode(chat.render(all, false, where, extra).text, false);
  ChatTokens out{ids, ids};
  if (!completion_only_loss) return out;
  const auto head = tok.encode(chat.render(prompt, true, where, extra).text, false);
  for (std::size_t t = 0; t < head.size() && t < out.labels.size(); ++t) out.labels[t] = kIgnore;
  out.prompt_not_prefix = head.size() > ids.size() || !std::equal(head.begin(), head.end(), ids.begin());
  return out;
}

}  // namespace wick::text
