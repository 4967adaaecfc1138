// wick.core: the engine bound to Lua, one table assembled from the binding
// files, each adding the functions and metatables of its concern.

#include "lua/binding.hpp"

namespace wick {
namespace {

int luaopen_wick_core(lua_State* L) {
  lua_newtable(L);
  lua::open_values(L);
  lua::open_objects(L);
  lua::open_plugins(L);
  lua::open_train(L);
  lua::open_observe(L);
  lua::open_sys(L);
  lua::open_tokenizer(L);
  return 1;
}

}  // namespace

void open_wick_core(lua_State* L) {
  lua_pushstring(L, lua::fs::weakly_canonical(LuaRuntime::package_dir()).string().c_str());
  lua_setfield(L, LUA_REGISTRYINDEX, lua::kPackageDirKey);
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, luaopen_wick_core);
  lua_setfield(L, -2, "wick.core");
  lua_pop(L, 2);
}

}  // namespace wick
