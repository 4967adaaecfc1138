// wick.core: JSON in and out, the command line's key=value pairs, byte sizes.

#include "lua/binding.hpp"


#include "util/memory.hpp"

namespace wick::lua {
namespace {

int core_json(lua_State* L) {
  const std::string s = to_json(L, 1).dump();
  lua_pushlstring(L, s.data(), s.size());
  return 1;
}

int core_json_decode(lua_State* L) {
  const std::string s = check_string(L, 1, "json_decode");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(s);
  } catch (const std::exception& e) {
    throw Error(std::string("invalid JSON: ") + e.what());
  }
  push_json(L, j);
  return 1;
}

int core_args(lua_State* L) {
  lua_getfield(L, LUA_REGISTRYINDEX, "wick.args");
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    lua_newtable(L);
  }
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
                                 {"parse_bytes", G(core_parse_bytes)},
                                 {nullptr, nullptr}};
  luaL_register(L, nullptr, fns);
}

}  // namespace wick::lua
