#pragma once
// One line of data `text`'s JSONL file (plugins/data/text), parsed and
// checked without LibTorch (the JSONL fuzz target builds it alone): an
// object with "input_ids" (a list of token ids below the vocabulary size) and
// optionally "labels" (as many, each a token id or -100 for a token that
// does not count, as transformers' labels), "prompt" and "completion"
// (strings, or for chat data lists of messages), "messages" (a list of
// messages, for a chat template), or "text" (a string). "labels" beside
// anything but input_ids is refused, never ignored. Errors name the file
// and line.

#include <wick/kit/json_fields.hpp>
#include <wick/options.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace wick::text {

struct JsonlRecord {
  enum Kind { Blank, Ids, Text, PromptCompletion, Messages, ChatPromptCompletion } kind = Blank;
  std::vector<std::int64_t> ids, labels;  // labels: empty, or one per id (-100: not counted)
  std::string text, prompt;
  // Messages: the conversation; ChatPromptCompletion: the prompt's and the
  // completion's messages (keys in the order the line holds them: tojson prints them so)
  nlohmann::ordered_json messages, completion;
  // chat rows' "tools" and "chat_template_kwargs" (TRL's columns), as template variables
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
};

/// A chat row's "tools" (a list, or null) and "chat_template_kwargs" (an
/// object: variables for the template, as TRL passes them).
inline void chat_extra(const wick::JsonFields& f, const nlohmann::ordered_json& row, JsonlRecord& r) {
  if (f.has("tools")) {
    if (!row["tools"].is_array()) f.bad("tools", "a list of tool schemas (or null)");
    r.extra["tools"] = row["tools"];
  }
  if (f.has("chat_template_kwargs")) {
    if (!row["chat_template_kwargs"].is_object()) f.bad("chat_template_kwargs", "an object of template variables");
    for (auto it = row["chat_template_kwargs"].begin(); it != row["chat_template_kwargs"].end(); ++it)
      r.extra[it.key()] = it.value();
  }
}

/// `where` is "file:line"; `vocab` bounds input_ids.
inline JsonlRecord parse_jsonl_line(const std::string& line, const std::string& where, std::int64_t vocab) {
  JsonlRecord r;
  if (line.find_first_not_of(" \t\r") == std::string::npos) return r;
  const std::string who = "data 'text': " + where;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& e) {
    throw wick::Error(who + " is not valid JSON (" + wick::json_error_text(e) + ")");
  }
  if (!j.is_object()) throw wick::Error(who + " is " + wick::json_brief(j) + ", expected a JSON object");
  const wick::JsonFields f(j, who);
  if (f.has("input_ids")) {
    const auto& list = f.array("input_ids");
    r.kind = JsonlRecord::Ids;
    for (std::size_t i = 0; i < list.size(); ++i) {
      const auto& x = list[i];
      if (!x.is_number_integer() || x.get<std::int64_t>() < 0 || x.get<std::int64_t>() >= vocab ||
          (x.is_number_unsigned() && x.get<std::uint64_t>() >= static_cast<std::uint64_t>(vocab)))
        throw wick::Error(who + ": input_ids[" + std::to_string(i) + "] is " + wick::json_brief(x) +
                          ", expected an integer in [0, " + std::to_string(vocab) + ")");
      r.ids.push_back(x.get<std::int64_t>());
    }
    if (f.has("labels")) {
      const auto& lab = f.array("labels");
      if (lab.size() != list.size())
        throw wick::Error(who + ": labels holds " + std::to_string(lab.size()) + " values, expected one per input_ids (" +
                          std::to_string(list.size()) + ")");
      for (std::size_t i = 0; i < lab.size(); ++i) {
        const auto& x = lab[i];
        const bool ok = x.is_number_integer() && !(x.is_number_unsigned() && x.get<std::uint64_t>() >= static_cast<std::uint64_t>(vocab)) &&
                        (x.get<std::int64_t>() == -100 || (x.get<std::int64_t>() >= 0 && x.get<std::int64_t>() < vocab));
        if (!ok)
          throw wick::Error(who + ": labels[" + std::to_string(i) + "] is " + wick::json_brief(x) +
                            ", expected -100 or an integer in [0, " + std::to_string(vocab) + ")");
        r.labels.push_back(x.get<std::int64_t>());
      }
    }
  } else if (f.has("labels")) {
    throw wick::Error(who + ": labels without input_ids: labels are read only beside input_ids (text and "
                      "prompt/completion records make their own labels)");
  } else if (f.has("messages")) {
    r.kind = JsonlRecord::Messages;
    const auto ordered = nlohmann::ordered_json::parse(line);
    r.messages = ordered["messages"];
    chat_extra(f, ordered, r);
  } else if ((f.has("prompt") && j["prompt"].is_array()) || (f.has("completion") && j["completion"].is_array())) {
    // TRL's conversational prompt-completion: both lists of messages
    for (const char* k : {"prompt", "completion"})
      if (!f.has(k) || !j[k].is_array())
        f.bad(k, std::string("a list of messages, as the ") + (k[0] == 'p' ? "completion" : "prompt") +
                     " is one (conversational prompt-completion), or both strings");
    r.kind = JsonlRecord::ChatPromptCompletion;
    const auto ordered = nlohmann::ordered_json::parse(line);
    r.messages = ordered["prompt"];
    r.completion = ordered["completion"];
    chat_extra(f, ordered, r);
  } else if (f.has("prompt") || f.has("completion")) {
    r.kind = JsonlRecord::PromptCompletion;
    r.prompt = f.string("prompt");
    r.text = f.string("completion");
  } else if (f.has("text")) {
    r.kind = JsonlRecord::Text;
    r.text = f.string("text");
  } else {
    throw wick::Error(who + " has none of text, input_ids, messages, or prompt and completion");
  }
  return r;
}

}  // namespace wick::text
