// wick.core: Methods of plugin objects: models (save, load, parameters, blocks, generate), data sets (size, encode, decode, apply_chat_template, window), optim objects and transforms (lora: apply, save, load, merge), and windows.

#include "lua/binding.hpp"

#include <cmath>
#include <optional>

#include "distributed/group.hpp"
#include "plugin/registry.hpp"
#include "train/freeze.hpp"
#include "train/inspect.hpp"
#include "train/pretrained.hpp"
#include "train/trainer.hpp"
#include "wick/kit/json_fields.hpp"
#include "wick/kit/safetensors.hpp"

namespace wick::lua {
namespace {

// Files of the model (model:save, lora:save) are written by rank 0 alone:
// every rank holds the same weights, and a recipe calls save on each (ranks
// writing one path at once would each write it whole). The others check
// their arguments as rank 0 does and go on: no collective, so a save that
// only rank 0 makes (if wick.is_main() then ... end) stays correct.
bool writes_files() { return dist_env().rank == 0; }

int model_save(lua_State* L) {
  auto m = check_model(L, 1, "save", /*whole=*/false);
  const std::string path = check_string(L, 2, "save");
  if (!writes_files()) return 0;
  if (is_deferred(*m)) save_deferred(*m, path);  // a value at a time: the model stays deferred
  else save_model(*m, path);
  return 0;
}

int model_load(lua_State* L) {
  auto m = check_model(L, 1, "load");
  load_model(*m, check_string(L, 2, "load"));
  return 0;
}

int model_parameters(lua_State* L) {
  auto m = check_model(L, 1, "parameters", /*whole=*/false);
  std::int64_t total = 0, trainable = 0;
  for (const auto& p : m->parameters()) {
    total += p.numel();
    if (p.requires_grad()) trainable += p.numel();
  }
  lua_pushnumber(L, static_cast<double>(total));
  lua_pushnumber(L, static_cast<double>(trainable));
  return 2;
}

// model:freeze(patterns) / model:unfreeze(patterns): a name, a module or a
// glob, or a list of them; returns the values in all parameters and in the
// trainable ones, as model:parameters() does
int set_trainable_from_lua(lua_State* L, bool trainable) {
  const char* fn = trainable ? "unfreeze" : "freeze";
  auto m = check_model(L, 1, fn, /*whole=*/false);
  std::vector<std::string> patterns;
  if (lua_type(L, 2) == LUA_TSTRING) {
    patterns.push_back(lua_tostring(L, 2));
  } else if (lua_istable(L, 2)) {
    const auto n = lua_objlen(L, 2);
    for (std::size_t k = 1; k <= n; ++k) {
      lua_rawgeti(L, 2, static_cast<int>(k));
      if (lua_type(L, -1) != LUA_TSTRING)
        throw Error("bad argument #2 to '" + std::string(fn) + "' (a list of strings expected, item " +
                    std::to_string(k) + " is a " + luaL_typename(L, -1) + ")");
      patterns.push_back(lua_tostring(L, -1));
      lua_pop(L, 1);
    }
  } else {
    throw bad_argument(L, 2, fn, "string or list of strings");
  }
  const auto c = set_trainable(*m, patterns, trainable, fn);
  lua_pushnumber(L, static_cast<double>(c.total));
  lua_pushnumber(L, static_cast<double>(c.trainable));
  return 2;
}
int model_freeze(lua_State* L) { return set_trainable_from_lua(L, false); }
int model_unfreeze(lua_State* L) { return set_trainable_from_lua(L, true); }

int model_blocks(lua_State* L) {
  auto m = check_model(L, 1, "blocks", /*whole=*/false);
  push_value(L, [&] {
    List l;
    for (auto& s : m->blocks()) l.push_back(Value(s));
    return Value(l);
  }());
  return 1;
}

int model_item_name(lua_State* L) {
  auto m = check_model(L, 1, "item_name", /*whole=*/false);
  lua_pushstring(L, m->item_name().c_str());
  return 1;
}

// model:window_coupled(): whether the model's loss couples the samples of a
// window (contrastive), so the trainer computes it over the whole window.
int model_window_coupled(lua_State* L) {
  auto m = check_model(L, 1, "window_coupled", /*whole=*/false);
  lua_pushboolean(L, coupled_windows(*m) != nullptr);
  return 1;
}

// The options of model:generate, checked here for recipes and `wick generate`
// alike, before a model sees them.
const OptionSchema& generate_schema() {
  static const OptionSchema schema = {
      opt_int("max_new_tokens", GenerateOptions{}.max_new_tokens, "tokens to add at most (within the model's context)")
          .at_least(0),
      opt_number("temperature", 0.0, "0: greedy; above 0: sample from the logits divided by it").at_least(0),
      opt_int("top_k", 0, "sample among the k likeliest tokens (0: all)").at_least(0),
      opt_number("top_p", 1.0, "sample among the likeliest tokens whose probability reaches top_p").above(0).at_most(1),
      opt_int("eos_id", -1, "stop after this token (-1: never)").at_least(-1),
      opt_int("seed", 0, "the sampling seed").at_least(0),
      opt_number("repetition_penalty", 1.0,
                "divides the logits of tokens already in the prompt or output (multiplies negative ones), as "
                "transformers' repetition_penalty; 1: none")
          .above(0),
      opt_string("eos_ids", Value(), "a list of further token ids to stop after (end-of-turn tokens)").optional(),
      opt_string("on_token", Value(),
                 "a function called with each new token as it is chosen; returning true stops there").optional(),
  };
  return schema;
}

// model:generate(prompt, {max_new_tokens, temperature, top_k, top_p, eos_id, eos_ids, seed, repetition_penalty,
// on_token}) -> ids; on_token returning true ends the generation after that token
// prompt: token ids {1, 2, ...}, or a batch whose first sample is the prompt
// (Model::generate_from): a window (data:window(i, 1)) or a safetensors file.
int model_generate(lua_State* L) {
  auto m = check_model(L, 1, "generate");
  std::optional<Batch> batch;
  std::vector<std::int64_t> prompt;
  if (auto* w = test_box<std::vector<Batch>>(L, 2, kWindowMt)) {
    if (!w->ptr || w->ptr->empty()) throw Error("generate: the window given as prompt is empty (freed?)");
    batch = w->ptr->front();
  } else if (lua_type(L, 2) == LUA_TSTRING) {
    batch = read_batch(lua_tostring(L, 2));
  } else {
    prompt = check_ids(L, 2, "generate");
  }
  GenerateOptions g;
  int on_token = LUA_NOREF;  // the callback, held in the registry while generating
  struct Unref {
    lua_State* L;
    int& ref;
    ~Unref() { luaL_unref(L, LUA_REGISTRYINDEX, ref); }
  } unref{L, on_token};
  if (!lua_isnoneornil(L, 3)) {
    check_table(L, 3, "generate");
    std::map<std::string, Value> given;
    lua_pushnil(L);
    while (lua_next(L, 3)) {
      if (lua_type(L, -2) != LUA_TSTRING) throw Error("generate: option names must be strings");
      const std::string key = lua_tostring(L, -2);
      if (key == "on_token") {
        if (!lua_isfunction(L, -1))
          throw Error(std::string("generate: option 'on_token': expected a function, got ") + luaL_typename(L, -1));
        lua_pushvalue(L, -1);
        on_token = luaL_ref(L, LUA_REGISTRYINDEX);
      } else if (key == "eos_ids") {
        std::size_t n = 0;
        if (!lua_istable(L, -1) || !is_array(L, lua_gettop(L), &n))
          throw Error(std::string("generate: option 'eos_ids': expected a list of token ids, got ") + luaL_typename(L, -1));
        for (std::size_t k = 1; k <= n; ++k) {
          lua_rawgeti(L, -1, static_cast<int>(k));
          const double v = lua_type(L, -1) == LUA_TNUMBER ? lua_tonumber(L, -1) : -1.0;
          if (v < 0 || v != std::floor(v))
            throw Error("generate: option 'eos_ids': item " + std::to_string(k) +
                        " is not a token id, expected integers >= 0");
          g.eos_ids.push_back(static_cast<std::int64_t>(v));
          lua_pop(L, 1);
        }
      } else {
        given[key] = to_value(L, -1, "generate: option '" + key + "'");
      }
      lua_pop(L, 1);
    }
    const Options o = validate_options("generate", generate_schema(), given);
    g.max_new_tokens = o.get_int("max_new_tokens");
    g.temperature = o.get_number("temperature");
    g.top_k = o.get_int("top_k");
    g.top_p = o.get_number("top_p");
    g.eos_id = o.get_int("eos_id");
    g.seed = static_cast<std::uint64_t>(o.get_int("seed"));
    g.repetition_penalty = o.get_number("repetition_penalty");
  }
  auto stop = std::make_shared<bool>(false);  // on_token returned true
  if (on_token != LUA_NOREF) {
    g.on_token = [L, ref = on_token, stop](std::int64_t id) {
      lua_rawgeti(L, LUA_REGISTRYINDEX, ref);
      lua_pushnumber(L, static_cast<lua_Number>(id));
      if (lua_pcall(L, 1, 1, 0) != 0) {
        std::string msg = lua_isstring(L, -1) ? lua_tostring(L, -1) : "an error object that is not a string";
        lua_pop(L, 1);
        throw Error("generate: on_token: " + msg);
      }
      *stop = lua_toboolean(L, -1) && lua_type(L, -1) == LUA_TBOOLEAN;
      lua_pop(L, 1);
    };
    g.stop = [stop] { return *stop; };
  }
  auto* gen = capability<Generator>(*m);
  if (!gen) throw Error("this model does not implement generate()");
  push_ids(L, batch ? gen->generate_from(*batch, g) : gen->generate(prompt, g));
  return 1;
}

// The flags of a method's options table at `i` (none: the defaults), as
// transformers names them; any other key is an error naming it.
std::map<std::string, bool> flag_options(lua_State* L, int i, const char* fn, std::map<std::string, bool> flags) {
  if (lua_isnoneornil(L, i)) return flags;
  check_table(L, i, fn);
  lua_pushnil(L);
  while (lua_next(L, i)) {
    const std::string key = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "?";
    auto it = flags.find(key);
    if (it == flags.end()) {
      std::string known;
      for (const auto& [k, v] : flags) known += (known.empty() ? "" : ", ") + k;
      throw Error(std::string(fn) + ": unknown option '" + key + "' (expected " + known + ")");
    }
    if (lua_type(L, -1) != LUA_TBOOLEAN)
      throw Error(std::string(fn) + ": option '" + key + "': expected true or false, got a " + luaL_typename(L, -1));
    it->second = lua_toboolean(L, -1);
    lua_pop(L, 1);
  }
  return flags;
}

// data:encode(text [, {add_special_tokens = true}])
int data_encode(lua_State* L) {
  auto d = check_data(L, 1, "encode");
  const std::string text = check_string(L, 2, "encode");
  const auto o = flag_options(L, 3, "encode", {{"add_special_tokens", true}});
  push_ids(L, d->encode(text, o.at("add_special_tokens")));
  return 1;
}

// data:decode(ids [, {skip_special_tokens = false}])
int data_decode(lua_State* L) {
  auto d = check_data(L, 1, "decode");
  const auto ids = check_ids(L, 2, "decode");
  const auto o = flag_options(L, 3, "decode", {{"skip_special_tokens", false}});
  const std::string s = d->decode(ids, o.at("skip_special_tokens"));
  lua_pushlstring(L, s.data(), s.size());
  return 1;
}

// data:apply_chat_template(messages [, {add_generation_prompt = false, tokenize = true, tools = ..., <variables>}]):
// the conversation rendered through the data set's chat template; its ids
// (tokenized without special tokens, as transformers tokenizes the
// rendering) or, with tokenize = false, the text
int data_apply_chat_template(lua_State* L) {
  auto d = check_data(L, 1, "apply_chat_template");
  check_table(L, 2, "apply_chat_template");
  nlohmann::json messages = to_json(L, 2);
  if (messages.is_object() && messages.empty()) messages = nlohmann::json::array();  // {} is an empty list in Lua
  bool tokenize = true;
  nlohmann::json options = nlohmann::json::object();
  if (!lua_isnoneornil(L, 3)) {
    check_table(L, 3, "apply_chat_template");
    options = to_json(L, 3);
    if (!options.is_object()) throw Error("apply_chat_template: the options must be a table of names (add_generation_prompt, tokenize, ...)");
    if (options.contains("tokenize")) {
      if (!options["tokenize"].is_boolean())
        throw Error("apply_chat_template: option 'tokenize': expected true or false, got " + json_brief(options["tokenize"]));
      tokenize = options["tokenize"].get<bool>();
      options.erase("tokenize");
    }
  }
  const std::string text = d->apply_chat_template(messages.dump(), options.dump());
  if (tokenize) push_ids(L, d->encode(text, /*add_special_tokens=*/false));
  else lua_pushlstring(L, text.data(), text.size());
  return 1;
}

int data_size(lua_State* L) {
  auto d = check_data(L, 1, "size");
  lua_pushnumber(L, static_cast<double>(d->size()));
  return 1;
}

// data:window(first, count[, micro]): samples first .. first+count-1 (0-based)
// as a window of micro-batches of `micro` (default: one micro-batch).
int data_window(lua_State* L) {
  auto d = check_data(L, 1, "window");
  const auto first = static_cast<std::int64_t>(luaL_checknumber(L, 2));
  const auto count = static_cast<std::int64_t>(luaL_checknumber(L, 3));
  const auto micro = static_cast<std::int64_t>(luaL_optnumber(L, 4, static_cast<double>(count)));
  push_box<std::vector<Batch>>(L, std::make_shared<std::vector<Batch>>(sample_window(*d, first, count, micro)), kWindowMt);
  return 1;
}

int optim_kind(lua_State* L) {
  auto& o = check_box<Object>(L, 1, kOptimMt, "kind");
  const auto k = o->object_kind();
  lua_pushstring(L, to_string(k));  // an optim plugin's object: optimizer, schedule or transform
  return 1;
}

Transform& check_transform(lua_State* L, const char* fn) {
  auto& o = check_box<Object>(L, 1, kOptimMt, fn);
  if (o->object_kind() != ObjectKind::Transform)
    throw Error(std::string(fn) + ": this optim object is not a transform (lora, ...)");
  return static_cast<Transform&>(*o);
}

// schedule:factor(step, total_steps): the lr multiplier of optimizer step `step` (0-based) in a run of total_steps
int schedule_factor(lua_State* L) {
  auto& o = check_box<Object>(L, 1, kOptimMt, "factor");
  if (o->object_kind() != ObjectKind::Schedule)
    throw Error("factor: this optim object is not a schedule (wick.schedule(...))");
  const auto step = static_cast<std::int64_t>(luaL_checknumber(L, 2));
  const auto total = static_cast<std::int64_t>(luaL_optnumber(L, 3, 0));
  lua_pushnumber(L, static_cast<Schedule&>(*o).factor(step, total));
  return 1;
}

// The transform whose adapters a model carries (set by transform:apply and
// :load, cleared by :merge), for wick.save_pretrained: a table in the
// registry, weak in its keys (the models' userdata).
constexpr const char* kAdaptersKey = "wick.adapters_of";

void push_adapters_table(lua_State* L) {
  lua_getfield(L, LUA_REGISTRYINDEX, kAdaptersKey);
  if (!lua_isnil(L, -1)) return;
  lua_pop(L, 1);
  lua_newtable(L);
  lua_newtable(L);
  lua_pushstring(L, "k");
  lua_setfield(L, -2, "__mode");
  lua_setmetatable(L, -2);
  lua_pushvalue(L, -1);
  lua_setfield(L, LUA_REGISTRYINDEX, kAdaptersKey);
}

// the model at index 2 now carries the transform at index 1 (or none)
void remember_adapters(lua_State* L, bool carries) {
  push_adapters_table(L);
  lua_pushvalue(L, 2);
  if (carries) lua_pushvalue(L, 1);
  else lua_pushnil(L);
  lua_rawset(L, -3);
  lua_pop(L, 1);
}

// core.adapters_of(model) -> the transform whose adapters it carries (or
// nil), the number of its linear layers carrying one
int core_adapters_of(lua_State* L) {
  auto m = check_model(L, 1, "adapters_of", /*whole=*/false);
  push_adapters_table(L);
  lua_pushvalue(L, 1);
  lua_rawget(L, -2);
  lua_pushnumber(L, static_cast<double>(adapted_layers(*m)));
  return 2;
}

// core.save_pretrained_weights(model, file, merge): the weights a Hugging
// Face folder holds (train/pretrained.hpp), written by rank 0
int core_save_pretrained_weights(lua_State* L) {
  // a deferred model is written as its values are made, never whole
  auto m = check_model(L, 1, "save_pretrained", /*whole=*/false);
  const std::string path = check_string(L, 2, "save_pretrained");
  save_pretrained_weights(*m, path, lua_toboolean(L, 3), writes_files());
  return 0;
}

// transform:apply(model), :save(model, dir), :load(model, dir), :merge(model)
int transform_apply(lua_State* L) {
  auto& t = check_transform(L, "apply");
  t.apply(*check_model(L, 2, "apply", /*whole=*/false));
  remember_adapters(L, true);
  return 0;
}

int transform_save(lua_State* L) {
  auto& t = check_transform(L, "save");
  auto m = check_model(L, 2, "save");
  const std::string dir = check_string(L, 3, "save");
  if (writes_files()) t.save(*m, dir);
  return 0;
}

int transform_load(lua_State* L) {
  auto& t = check_transform(L, "load");
  t.load(*check_model(L, 2, "load"), check_string(L, 3, "load"));
  remember_adapters(L, true);
  return 0;
}

int transform_merge(lua_State* L) {
  auto& t = check_transform(L, "merge");
  t.merge(*check_model(L, 2, "merge"));
  remember_adapters(L, false);
  return 0;
}

// window:free(): drops the window's tensors now rather than when Lua's
// collector gets to the (small-looking) userdata; wick.train frees each
// window after its step, so host memory stays bounded.
int window_free(lua_State* L) {
  auto& w = check_box<std::vector<Batch>>(L, 1, kWindowMt, "free");
  w->clear();
  w->shrink_to_fit();
  return 0;
}

// window:save(path): its micro-batches as safetensors "<k>.<name>" (k from 0),
// to see what the loader gives
int window_save(lua_State* L) {
  auto& w = check_box<std::vector<Batch>>(L, 1, kWindowMt, "save");
  save_window(*w, check_string(L, 2, "save"));
  return 0;
}

int window_len(lua_State* L) {
  auto& w = check_box<std::vector<Batch>>(L, 1, kWindowMt, "__len");
  lua_pushnumber(L, static_cast<double>(w->size()));
  return 1;
}

}  // namespace

void open_objects(lua_State* L) {
  static const luaL_Reg model_methods[] = {{"save", G(model_save)},
                                           {"load", G(model_load)},
                                           {"parameters", G(model_parameters)},
                                           {"freeze", G(model_freeze)},
                                           {"unfreeze", G(model_unfreeze)},
                                           {"blocks", G(model_blocks)},
                                           {"item_name", G(model_item_name)},
                                           {"window_coupled", G(model_window_coupled)},
                                           {"generate", G(model_generate)},
                                           {nullptr, nullptr}};
  static const luaL_Reg data_methods[] = {
      {"size", G(data_size)},     {"encode", G(data_encode)}, {"decode", G(data_decode)},
      {"window", G(data_window)}, {"apply_chat_template", G(data_apply_chat_template)}, {nullptr, nullptr}};
  static const luaL_Reg optim_methods[] = {{"kind", G(optim_kind)},   {"factor", G(schedule_factor)},
                                           {"apply", G(transform_apply)},
                                           {"save", G(transform_save)}, {"load", G(transform_load)},
                                           {"merge", G(transform_merge)}, {nullptr, nullptr}};
  static const luaL_Reg window_methods[] = {{"free", G(window_free)}, {"save", G(window_save)}, {nullptr, nullptr}};
  static const luaL_Reg fns[] = {{"adapters_of", G(core_adapters_of)},
                                 {"save_pretrained_weights", G(core_save_pretrained_weights)},
                                 {nullptr, nullptr}};
  luaL_register(L, nullptr, fns);
  new_metatable<Object>(L, kModelMt, model_methods, object_index);
  new_metatable<Object>(L, kDataMt, data_methods, object_index);
  new_metatable<Object>(L, kOptimMt, optim_methods, object_index);
  new_metatable<std::vector<Batch>>(L, kWindowMt, window_methods);
  luaL_getmetatable(L, kWindowMt);
  lua_pushcfunction(L, G(window_len));
  lua_setfield(L, -2, "__len");
  lua_pop(L, 1);
}

}  // namespace wick::lua
