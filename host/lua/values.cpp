// wick.core: JSON in and out, the command line's key=value pairs, byte sizes.

#include "lua/binding.hpp"
#include "wick/kit/json_fields.hpp"


#include "train/run_options.hpp"
#include "util/memory.hpp"

namespace wick::lua {
namespace {

int core_json(lua_State* L) {
  const std::string s = to_json(L, 1).dump();
  lua_pushlstring(L, s.data(), s.size());
  return 1;
}

// core.json_decode(text [, where]): `where` (a file, "file:line") names the
// text in the error, which says what is wrong without nlohmann's tag.
int core_json_decode(lua_State* L) {
  const std::string s = check_string(L, 1, "json_decode");
  const std::string where = lua_isnoneornil(L, 2) ? std::string() : check_string(L, 2, "json_decode");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(s);
  } catch (const nlohmann::json::exception& e) {
    throw Error((where.empty() ? std::string("invalid JSON: ") : where + " is not valid JSON: ") + json_error_text(e));
  }
  push_json(L, j);
  return 1;
}

// The command line's pairs as Lua values (init.lua's wick.args reads them).
int core_args(lua_State* L) {
  lua_getfield(L, LUA_REGISTRYINDEX, "wick.args");
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    lua_newtable(L);
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, "wick.args");
  }
  return 1;
}

// core.arg_read(key): the recipe read `key` from wick.args (the run context
// notes it, so the key is not named as unused).
int core_arg_read(lua_State* L) {
  const std::string key = check_string(L, 1, "arg_read");
  if (RunContext* context = run_context(L)) context->read(key, RunContext::Reader::Recipe);
  return 0;
}

// core.run_option_arg(key): the command line's value for `key` read as the
// wick.train option of that name declares (the last one given), or nil.
int core_run_option_arg(lua_State* L) {
  const std::string key = check_string(L, 1, "run_option_arg");
  const RunContext* context = run_context(L);
  const auto text = context ? context->value(key) : std::nullopt;
  if (!text) return 0;
  push_value(L, parse_run_option(key, *text));
  return 1;
}

int core_parse_bytes(lua_State* L) {
  lua_pushnumber(L, static_cast<double>(parse_bytes(check_string(L, 1, "parse_bytes"), "size")));
  return 1;
}

}  // namespace

void open_values(lua_State* L) {
  static const luaL_Reg fns[] = {{"json", G(core_json)},
                                 {"json_decode", G(core_json_decode)},
                                 {"args", G(core_args)},
                                 {"arg_read", G(core_arg_read)},
                                 {"run_option_arg", G(core_run_option_arg)},
                                 {"parse_bytes", G(core_parse_bytes)},
                                 {nullptr, nullptr}};
  luaL_register(L, nullptr, fns);
}

}  // namespace wick::lua
