#pragma once
// One line of data `text`'s JSONL file (plugins/data/text), parsed and
// checked without LibTorch (the JSONL fuzz target builds it alone): an
// object with "input_ids" (a list of token ids below the vocabulary size) and
// optionally "labels" (as many, each a token id or -100 for a token that
// does not count, as transformers' labels), "prompt" and "completion"
// (strings), or "text" (a string). "labels" beside anything but input_ids
// is refused, never ignored. Errors name the file and line.

#include <wick/kit/json_fields.hpp>
#include <wick/options.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace wick::text {

struct JsonlRecord {
  enum Kind { Blank, Ids, Text, PromptCompletion } kind = Blank;
  std::vector<std::int64_t> ids, labels;  // labels: empty, or one per id (-100: not counted)
  std::string text, prompt;
};

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
  } else if (f.has("prompt") || f.has("completion")) {
    r.kind = JsonlRecord::PromptCompletion;
    r.prompt = f.string("prompt");
    r.text = f.string("completion");
  } else if (f.has("text")) {
    r.kind = JsonlRecord::Text;
    r.text = f.string("text");
  } else {
    throw wick::Error(who + " has none of text, input_ids, or prompt and completion");
  }
  return r;
}

}  // namespace wick::text
