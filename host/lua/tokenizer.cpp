// wick.core: a Hugging Face tokenizer folder for Lua (wick.tokenizer): the
// tokenizer.json (plugins/lib/tokenizer), the special tokens of
// tokenizer_config.json (or special_tokens_map.json), and the chat template
// (chat_template.jinja, else tokenizer_config.json's chat_template), rendered
// by plugins/lib/jinja as transformers' apply_chat_template renders it.
//
//   local t = wick.tokenizer("model_dir")     -- or a tokenizer.json, or "bytes"
//   t:encode(text [, {add_special_tokens = true}])      -> ids
//   t:decode(ids [, {skip_special_tokens = false}])     -> text (bytes that are no UTF-8: U+FFFD)
//   t:apply_chat_template(messages [, {add_generation_prompt = false, tokenize = true, ...}])
//                                                       -> ids, or the text with tokenize = false, or with
//      return_dict = true (or return_assistant_tokens_mask = true) {input_ids, attention_mask[, assistant_masks]};
//      continue_final_message = true (or the field's name) ends the render inside the final message, as transformers
//   t:token_id(token) -> id or nil; t.eos_token, t.eos_id, t.bos_token, t.bos_id,
//   t.pad_token, t.pad_id, t.vocab_size, t.chat_template (its source or nil), t.folder

#include "lua/binding.hpp"

#include <cstdio>
#include <fstream>
#include <optional>
#include <regex>
#include <set>

#include "lib/chat/chat.hpp"
#include "lib/jinja/jinja.hpp"
#include "lib/tokenizer/tokenizer.hpp"
#include "wick/kit/json_fields.hpp"

namespace wick::lua {
namespace {

inline constexpr const char* kTokenizerMt = "wick.Tokenizer";

// transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES), which
// apply_chat_template passes to the template
constexpr const char* kSpecialNames[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                         "pad_token", "cls_token", "mask_token"};

std::string read_text(const fs::path& p) {
  std::error_code ec;
  if (fs::is_directory(p, ec)) throw Error(p.string() + " is a directory, expected a file");
  std::ifstream in(p, std::ios::binary);
  if (!in) throw Error("cannot open " + p.string() + ": " + std::strerror(errno));
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

struct HfTokenizer {
  std::string where;  // the tokenizer.json, or "bytes"
  fs::path folder;    // where tokenizer_config.json and the chat template are looked for ("" for bytes)
  std::unique_ptr<text::Tokenizer> tok;
  std::set<std::int64_t> special_ids;                // added tokens marked special (skip_special_tokens)
  std::map<std::string, std::string> special;        // bos_token -> "<s>", ...
  std::optional<std::string> chat_source;            // the template's text
  std::string chat_file;                             // where it came from
  std::optional<std::string> chat_refused;           // several templates, none the default
  mutable std::unique_ptr<jinja::ChatTemplate> chat;  // parsed at first use

  explicit HfTokenizer(const std::string& path) {
    if (path == "bytes") {
      where = "bytes";
      tok = text::byte_tokenizer();
      special_ids.insert(256);
      special["eos_token"] = "<eos>";
      return;
    }
    std::error_code ec;
    fs::path file = path;
    if (fs::is_directory(file, ec) && file.filename() != "tokenizer.json") {  // a folder named so: the reader says
      folder = file;
      file = file / "tokenizer.json";
      if (!fs::exists(file, ec))
        throw Error("tokenizer: the folder " + path + " has no tokenizer.json, expected a folder holding the "
                    "tokenizer.json that Hugging Face's tokenizers library saves, or that file itself");
    } else if (!fs::exists(file, ec)) {
      throw Error("tokenizer: " + path + ": no such file or folder, expected a tokenizer.json or a folder holding one");
    } else {
      folder = file.parent_path();
      if (folder.empty()) folder = ".";
    }
    where = file.string();
    tok = text::bpe_tokenizer(where);
    // the added tokens' special flags (tokenizers' decode skips these)
    const nlohmann::json j = read_json_file(file);
    if (auto it = j.find("added_tokens"); it != j.end() && it->is_array())
      for (const auto& a : *it)
        if (a.is_object() && a.value("special", false) && a.contains("id") && a["id"].is_number_integer())
          special_ids.insert(a["id"].get<std::int64_t>());
    read_config();
  }

  // tokenizer_config.json's special tokens (a string, or an AddedToken's
  // {"content": ...}), special_tokens_map.json's where it says none, and the
  // chat template
  void read_config() {
    std::error_code ec;
    nlohmann::json cfg = nlohmann::json::object(), map = nlohmann::json::object();
    const fs::path cfg_file = folder / "tokenizer_config.json", map_file = folder / "special_tokens_map.json";
    if (fs::exists(cfg_file, ec)) {
      cfg = read_json_file(cfg_file);
      if (!cfg.is_object()) throw Error(cfg_file.string() + " is " + json_brief(cfg) + ", expected a JSON object");
    }
    if (fs::exists(map_file, ec)) {
      map = read_json_file(map_file);
      if (!map.is_object()) throw Error(map_file.string() + " is " + json_brief(map) + ", expected a JSON object");
    }
    auto token_text = [](const nlohmann::json& v) -> std::optional<std::string> {
      if (v.is_string()) return v.get<std::string>();
      if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
      return std::nullopt;
    };
    for (const char* name : kSpecialNames) {
      std::optional<std::string> t;
      if (auto it = cfg.find(name); it != cfg.end()) t = token_text(*it);
      if (!t)
        if (auto it = map.find(name); it != map.end()) t = token_text(*it);
      if (t) special[name] = *t;
    }
    // chat_template.jinja first, as transformers reads it
    if (const fs::path jinja = folder / "chat_template.jinja"; fs::exists(jinja, ec)) {
      chat_source = read_text(jinja);
      chat_file = jinja.string();
    } else if (auto it = cfg.find("chat_template"); it != cfg.end() && !it->is_null()) {
      chat_file = cfg_file.string();
      if (it->is_string()) {
        chat_source = it->get<std::string>();
      } else if (it->is_array()) {  // [{name, template}, ...]: the one named default
        for (const auto& t : *it)
          if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string())
            chat_source = t["template"].get<std::string>();
        if (!chat_source)
          chat_refused = cfg_file.string() + " holds several chat templates and none named default";
      } else {
        throw Error(cfg_file.string() + ": chat_template is " + json_brief(*it) +
                    ", expected a string or a list of {name, template}");
      }
    }
  }

  std::optional<std::int64_t> id_of(const std::string& token) const {
    const auto id = tok->token_id(token);
    if (id >= 0) return id;
    return std::nullopt;
  }

  const jinja::ChatTemplate& chat_template() const {
    if (chat_refused) throw Error("apply_chat_template: " + *chat_refused + ", expected one template");
    if (!chat_source)
      throw Error("apply_chat_template: the tokenizer " + where + " has no chat template (no chat_template.jinja, "
                  "and no chat_template in tokenizer_config.json" + (folder.empty() ? "" : " in " + folder.string()) +
                  "), expected a chat model's tokenizer folder");
    if (!chat) {
      try {
        chat = std::make_unique<jinja::ChatTemplate>(*chat_source);
      } catch (const jinja::TemplateError& e) {
        throw Error("apply_chat_template: the chat template of " + chat_file + " does not parse: " + e.what());
      }
    }
    return *chat;
  }
};

// Bytes that are no UTF-8 become U+FFFD, one per maximal ill-formed
// subsequence, as the tokenizers library's decode gives them (Rust's
// from_utf8_lossy; Python's errors="replace" agrees)
std::string utf8_lossy(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  std::size_t i = 0;
  while (i < s.size()) {
    const unsigned char b = byte(i);
    if (b < 0x80) {
      out += static_cast<char>(b);
      ++i;
      continue;
    }
    std::size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
    if (b >= 0xC2 && b <= 0xDF) len = 2;
    else if (b == 0xE0) len = 3, lo = 0xA0;
    else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) len = 3;
    else if (b == 0xED) len = 3, hi = 0x9F;
    else if (b == 0xF0) len = 4, lo = 0x90;
    else if (b >= 0xF1 && b <= 0xF3) len = 4;
    else if (b == 0xF4) len = 4, hi = 0x8F;
    std::size_t k = 1;
    while (len > 0 && k < len && i + k < s.size()) {
      const unsigned char c = byte(i + k);
      if (k == 1 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) break;
      ++k;
    }
    if (len > 0 && k == len) {
      out.append(s, i, len);
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += k;
  }
  return out;
}

using Ptr = std::shared_ptr<HfTokenizer>;

std::string kind_of(const nlohmann::ordered_json& j) {
  if (j.is_string()) return "a string";
  if (j.is_array()) return "a list";
  if (j.is_object()) return "an object";
  if (j.is_boolean()) return "a boolean";
  if (j.is_number()) return "a number";
  return "null";
}

// A conversation as transformers takes it: a list of messages, each an object
// with a string role and a content (a string, a list of parts, or null or
// absent beside tool_calls). {"messages": [...]} (a row of chat data) gives its list.
nlohmann::ordered_json check_messages(nlohmann::ordered_json m) {
  if (m.is_object() && m.contains("messages")) m = m["messages"];
  if (!m.is_array())
    throw Error("apply_chat_template: messages: expected a list of {\"role\", \"content\"} messages, got " + kind_of(m));
  if (m.empty()) throw Error("apply_chat_template: messages: the list is empty, expected at least one {\"role\", \"content\"} message");
  for (std::size_t i = 0; i < m.size(); ++i) {
    const auto& msg = m[i];
    const std::string at = "apply_chat_template: messages[" + std::to_string(i) + "]";
    if (!msg.is_object())
      throw Error(at + ": expected an object with role and content, got " + kind_of(msg));
    if (!msg.contains("role") || !msg["role"].is_string())
      throw Error(at + ".role: expected a string (system, user, assistant, ...), got " +
                  (msg.contains("role") ? kind_of(msg["role"]) : std::string("nothing")));
    const bool tools = msg.contains("tool_calls");
    if (!msg.contains("content")) {
      if (!tools) throw Error(at + ".content: missing, expected a string or a list of parts");
    } else if (!msg["content"].is_string() && !msg["content"].is_array() && !(msg["content"].is_null() && tools)) {
      throw Error(at + ".content: expected a string or a list of parts, got " + kind_of(msg["content"]));
    }
  }
  return m;
}

int core_tokenizer(lua_State* L) {
  push_box<HfTokenizer>(L, std::make_shared<HfTokenizer>(check_string(L, 1, "tokenizer")), kTokenizerMt);
  return 1;
}

// The one flag `key` of method `fn`'s options table at `i` (none: `def`);
// another key is an error naming it, as a misspelt flag must not pass unseen.
bool opt_flag(lua_State* L, int i, const char* fn, const char* key, bool def) {
  if (lua_isnoneornil(L, i)) return def;
  check_table(L, i, fn);
  lua_pushnil(L);
  while (lua_next(L, i)) {
    const std::string k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : std::string(luaL_typename(L, -2));
    lua_pop(L, 1);
    if (k != key) {
      lua_pop(L, 1);
      throw Error(std::string(fn) + ": unknown option '" + k + "' (expected " + key + ")");
    }
  }
  return field<bool>(L, i, key, def);
}

int tok_encode(lua_State* L) {
  auto& t = check_box<HfTokenizer>(L, 1, kTokenizerMt, "encode");
  push_ids(L, t->tok->encode(check_string(L, 2, "encode"), opt_flag(L, 3, "encode", "add_special_tokens", true)));
  return 1;
}

int tok_decode(lua_State* L) {
  auto& t = check_box<HfTokenizer>(L, 1, kTokenizerMt, "decode");
  std::vector<std::int64_t> ids = check_ids(L, 2, "decode");
  if (opt_flag(L, 3, "decode", "skip_special_tokens", false))
    std::erase_if(ids, [&](std::int64_t id) { return t->special_ids.count(id) > 0; });
  const std::string s = utf8_lossy(t->tok->decode(ids));
  lua_pushlstring(L, s.data(), s.size());
  return 1;
}

int tok_token_id(lua_State* L) {
  auto& t = check_box<HfTokenizer>(L, 1, kTokenizerMt, "token_id");
  if (auto id = t->id_of(check_string(L, 2, "token_id"))) lua_pushnumber(L, static_cast<double>(*id));
  else lua_pushnil(L);
  return 1;
}

int tok_special_ids(lua_State* L) {
  auto& t = check_box<HfTokenizer>(L, 1, kTokenizerMt, "special_ids");
  push_ids(L, std::vector<std::int64_t>(t->special_ids.begin(), t->special_ids.end()));
  return 1;
}

// t:apply_chat_template(messages, {add_generation_prompt, tokenize, continue_final_message,
// return_dict, return_assistant_tokens_mask, tools, documents, <variables>}):
// messages a list of tables, or JSON text (its keys keep their order)
int tok_apply_chat_template(lua_State* L) {
  auto& t = check_box<HfTokenizer>(L, 1, kTokenizerMt, "apply_chat_template");
  nlohmann::ordered_json messages;
  if (lua_type(L, 2) == LUA_TSTRING) {
    try {
      messages = nlohmann::ordered_json::parse(lua_tostring(L, 2));
    } catch (const nlohmann::json::exception& e) {
      throw Error("apply_chat_template: messages: not valid JSON: " + json_error_text(e));
    }
  } else if (lua_istable(L, 2)) {
    messages = nlohmann::ordered_json::parse(to_json(L, 2).dump());
  } else {
    throw bad_argument(L, 2, "apply_chat_template", "a list of messages or JSON text");
  }
  messages = check_messages(std::move(messages));
  jinja::ChatOptions o;
  for (const auto& [k, v] : t->special) o.variables[k] = v;
  bool tokenize = true;  // transformers' default
  bool mask = false;     // return_assistant_tokens_mask
  std::optional<bool> return_dict;  // default: the ids alone, or a table with the mask
  std::string continue_field;       // continue_final_message: the field continued ("" when not)
  if (!lua_isnoneornil(L, 3)) {
    check_table(L, 3, "apply_chat_template");
    const nlohmann::json opts = to_json(L, 3);
    for (const auto& [k, v] : opts.items()) {
      if (k == "add_generation_prompt" || k == "tokenize" || k == "return_dict" || k == "return_assistant_tokens_mask") {
        if (!v.is_boolean())
          throw Error("apply_chat_template: option '" + k + "': expected a boolean, got " + json_brief(v));
        if (k == "return_dict") return_dict = v.get<bool>();
        else (k == "tokenize" ? tokenize : k == "add_generation_prompt" ? o.add_generation_prompt : mask) = v.get<bool>();
      } else if (k == "continue_final_message") {
        if (v.is_boolean()) continue_field = v.get<bool>() ? "content" : "";
        else if (v.is_string() && !v.get<std::string>().empty()) continue_field = v.get<std::string>();
        else throw Error("apply_chat_template: option 'continue_final_message': expected a boolean or the name of the "
                         "final message's field to continue (content, reasoning_content, ...), got " + json_brief(v));
      } else if (k == "tools" || k == "documents") {
        (k == "tools" ? o.tools : o.documents) = nlohmann::ordered_json::parse(v.dump());
      } else {
        o.variables[k] = nlohmann::ordered_json::parse(v.dump());
      }
    }
  }
  if (mask && (!tokenize || return_dict == false))
    throw Error("apply_chat_template: return_assistant_tokens_mask = true needs tokenize = true and return_dict = true "
                "(a table of input_ids, attention_mask and assistant_masks), got " +
                std::string(!tokenize ? "tokenize = false" : "return_dict = false"));
  if (!continue_field.empty() && o.add_generation_prompt)
    throw Error("apply_chat_template: continue_final_message and add_generation_prompt are both set, expected one: "
                "continue_final_message continues the final message, add_generation_prompt starts a new assistant message");
  if (!continue_field.empty() && mask)
    throw Error("apply_chat_template: continue_final_message and return_assistant_tokens_mask are both set, expected "
                "one (as transformers, which refuses them together)");
  const auto& tpl = t->chat_template();
  std::string final_text;
  if (!continue_field.empty())
    final_text = text::tag_final_message(messages, continue_field, *t->chat_source, "apply_chat_template");
  jinja::RenderResult r;
  try {
    r = tpl.apply(messages, o);
  } catch (const jinja::TemplateError& e) {
    throw Error("apply_chat_template: the chat template of " + t->chat_file +
                (e.line() > 0 ? " (line " + std::to_string(e.line()) + ")" : std::string()) + " failed: " + e.what());
  }
  std::string& text = r.text;
  if (!continue_field.empty())
    text = text::continued_text(text, final_text, continue_field, "apply_chat_template", t->chat_file);
  if (!tokenize) {
    lua_pushlstring(L, text.data(), text.size());
    return 1;
  }
  // the template wrote the special tokens itself, as transformers encodes it
  if (!return_dict.value_or(mask)) {
    push_ids(L, t->tok->encode(text, /*add_special_tokens=*/false));
    return 1;
  }
  lua_createtable(L, 0, 3);
  std::vector<std::int64_t> ids;
  if (mask) {
    // transformers' return_assistant_tokens_mask: the tokens of the template's
    // {% generation %} blocks, through the tokens' offsets (its char_to_token)
    const text::Encoding enc = t->tok->encode_with_offsets(text);
    static const std::regex generation(R"(\{%-?\s*generation\s*-?%\})");
    if (!std::regex_search(*t->chat_source, generation))
      std::fprintf(stderr, "wick: note: apply_chat_template: return_assistant_tokens_mask, but the chat template of %s "
                   "has no {%% generation %%} block: no token is marked (as transformers warns)\n", t->chat_file.c_str());
    const auto m = text::span_mask(enc, r.generation_spans, text);
    push_ids(L, std::vector<std::int64_t>(m.begin(), m.end()));
    lua_setfield(L, -2, "assistant_masks");
    ids = enc.ids;
  } else {
    ids = t->tok->encode(text, /*add_special_tokens=*/false);
  }
  push_ids(L, std::vector<std::int64_t>(ids.size(), 1));
  lua_setfield(L, -2, "attention_mask");
  push_ids(L, ids);
  lua_setfield(L, -2, "input_ids");
  return 1;
}

int tok_index(lua_State* L) {
  lua_getmetatable(L, 1);
  lua_getfield(L, -1, "methods");
  lua_pushvalue(L, 2);
  lua_rawget(L, -2);
  if (!lua_isnil(L, -1)) return 1;
  lua_pop(L, 3);
  auto* b = test_box<HfTokenizer>(L, 1, kTokenizerMt);
  if (lua_type(L, 2) != LUA_TSTRING || !b || !b->ptr) return 0;
  const HfTokenizer& t = *b->ptr;
  const std::string key = lua_tostring(L, 2);
  if (key == "vocab_size") {
    lua_pushnumber(L, static_cast<double>(t.tok->vocab_size()));
  } else if (key == "chat_template") {
    if (t.chat_source) lua_pushlstring(L, t.chat_source->data(), t.chat_source->size());
    else lua_pushnil(L);
  } else if (key == "folder") {
    if (t.folder.empty()) lua_pushnil(L);
    else lua_pushstring(L, t.folder.c_str());
  } else if (key == "path") {
    lua_pushstring(L, t.where.c_str());
  } else if (auto it = t.special.find(key); it != t.special.end()) {
    lua_pushlstring(L, it->second.data(), it->second.size());
  } else if (key.size() > 3 && key.compare(key.size() - 3, 3, "_id") == 0) {
    auto s = t.special.find(key.substr(0, key.size() - 3) + "_token");
    std::optional<std::int64_t> id;
    if (s != t.special.end()) id = t.id_of(s->second);
    if (id) lua_pushnumber(L, static_cast<double>(*id));
    else lua_pushnil(L);
  } else {
    lua_pushnil(L);
  }
  return 1;
}

}  // namespace

void open_tokenizer(lua_State* L) {
  static const luaL_Reg methods[] = {{"encode", G(tok_encode)},
                                     {"decode", G(tok_decode)},
                                     {"token_id", G(tok_token_id)},
                                     {"special_ids", G(tok_special_ids)},
                                     {"apply_chat_template", G(tok_apply_chat_template)},
                                     {nullptr, nullptr}};
  new_metatable<HfTokenizer>(L, kTokenizerMt, methods, tok_index);
  static const luaL_Reg fns[] = {{"tokenizer", G(core_tokenizer)}, {nullptr, nullptr}};
  luaL_register(L, nullptr, fns);
}

}  // namespace wick::lua
