// wick.core: Building plugin objects (wick.model, wick.data, wick.optim) and listing the plugins found.

#include "lua/binding.hpp"


#include "plugin/registry.hpp"

namespace wick::lua {
namespace {

template <PluginKind K>
int make_plugin(lua_State* L) {
  const char* fn = K == PluginKind::Model ? "model" : K == PluginKind::Data ? "data" : "optim";
  const std::string name = check_string(L, 1, fn);
  if (!lua_isnoneornil(L, 2)) check_table(L, 2, fn);
  auto opts = to_options(L, 2, std::string(fn) + " '" + name + "'");
  auto obj = registry().create(name, K, opts);
  const char* mt = K == PluginKind::Model ? kModelMt : K == PluginKind::Data ? kDataMt : kOptimMt;
  push_box<Object>(L, obj, mt);
  return 1;
}

int core_plugins(lua_State* L) {
  const auto& entries = registry().entries();
  lua_createtable(L, static_cast<int>(entries.size()), 0);
  int k = 1;
  for (const auto& e : entries) {
    lua_createtable(L, 0, 4);
    lua_pushstring(L, e.name.c_str());
    lua_setfield(L, -2, "name");
    lua_pushstring(L, e.file.string().c_str());
    lua_setfield(L, -2, "file");
    if (e.descriptor) {
      lua_pushstring(L, to_string(e.descriptor->kind));
      lua_setfield(L, -2, "kind");
      lua_pushstring(L, e.descriptor->summary);
      lua_setfield(L, -2, "summary");
    } else {
      lua_pushstring(L, e.error.c_str());
      lua_setfield(L, -2, "error");
    }
    lua_rawseti(L, -2, k++);
  }
  return 1;
}

}  // namespace

void open_plugins(lua_State* L) {
  static const luaL_Reg fns[] = {{"model", G(make_plugin<PluginKind::Model>)},
                                 {"data", G(make_plugin<PluginKind::Data>)},
                                 {"optim", G(make_plugin<PluginKind::Optim>)},
                                 {"plugins", G(core_plugins)},
                                 {nullptr, nullptr}};
  luaL_register(L, nullptr, fns);
}

}  // namespace wick::lua
