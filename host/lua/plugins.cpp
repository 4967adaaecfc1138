// wick.core: Building plugin objects (wick.model, wick.data, wick.optim) and listing the plugins found.

#include "lua/binding.hpp"


#include "plugin/registry.hpp"
#include "train/param_groups.hpp"

namespace wick::lua {
namespace {

// The patterns of a group's `params`: one string or a list of strings.
std::vector<std::string> group_patterns(lua_State* L, int i, const std::string& where) {
  std::vector<std::string> out;
  if (lua_type(L, i) == LUA_TSTRING) {
    out.emplace_back(lua_tostring(L, i));
  } else if (lua_istable(L, i)) {
    const int n = static_cast<int>(lua_objlen(L, i));
    for (int k = 1; k <= n; ++k) {
      lua_rawgeti(L, i, k);
      if (lua_type(L, -1) != LUA_TSTRING)
        throw Error(where + ": params[" + std::to_string(k) + "]: expected a pattern (a string), got a " +
                    luaL_typename(L, -1));
      out.emplace_back(lua_tostring(L, -1));
      lua_pop(L, 1);
    }
  }
  if (out.empty())
    throw Error(where + ": expected params = a pattern or a list of patterns (\"bias\", \"*norm*\", "
                "\"multi_modal_projector\", \"re:...\"), got " +
                (lua_isnil(L, i) ? std::string("none") : std::string("a ") + luaL_typename(L, i)));
  return out;
}

// wick.optim(name, {..., groups = {{params = patterns, name = "...", <options>}, ...}}):
// one optimizer per group with the group's options over the others
// (train/param_groups.hpp).
std::shared_ptr<Object> make_grouped(lua_State* L, const std::string& name, const std::map<std::string, Value>& base,
                                     std::shared_ptr<Object> rest) {
  const std::string label = "optim '" + name + "'";
  if (rest->object_kind() != ObjectKind::Optimizer)
    throw Error(label + ": groups: only an optimizer has parameter groups; this makes a " +
                to_string(rest->object_kind()));
  lua_getfield(L, 2, "groups");
  const int t = lua_gettop(L);
  std::size_t n = 0;
  if (!lua_istable(L, t) || !is_array(L, t, &n) || n == 0)
    throw Error(label + ": groups: expected a list of tables {params = patterns, <options>}, got " +
                (lua_istable(L, t) ? std::string("a table that is not a list") : std::string("a ") + luaL_typename(L, t)));
  std::vector<ParamGroup> groups;
  for (std::size_t k = 1; k <= n; ++k) {
    lua_rawgeti(L, t, static_cast<int>(k));
    const int g = lua_gettop(L);
    std::string where = label + ": groups[" + std::to_string(k) + "]";
    if (!lua_istable(L, g)) throw Error(where + ": expected a table {params = patterns, <options>}, got a " +
                                        std::string(luaL_typename(L, g)));
    ParamGroup pg;
    lua_getfield(L, g, "name");
    if (!lua_isnil(L, -1)) {
      if (lua_type(L, -1) != LUA_TSTRING) throw Error(where + ": name: expected a string");
      pg.name = lua_tostring(L, -1);
      where = label + ": group '" + pg.name + "'";
    }
    lua_pop(L, 1);
    lua_getfield(L, g, "params");
    pg.patterns = group_patterns(L, lua_gettop(L), where);
    lua_pop(L, 1);
    auto opts = base;
    for (auto& [key, v] : to_options(L, g, where, {"params", "name"})) opts[key] = v;
    std::shared_ptr<Object> obj;
    try {
      obj = registry().create(name, PluginKind::Optim, opts);
    } catch (const Error& e) {
      throw Error(where + ": " + e.what());
    }
    pg.optim = std::static_pointer_cast<Optimizer>(obj);
    groups.push_back(std::move(pg));
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  return std::make_shared<ParamGroups>(label, std::static_pointer_cast<Optimizer>(rest), std::move(groups));
}

template <PluginKind K>
int make_plugin(lua_State* L) {
  const char* fn = to_string(K);  // the recipe function: wick.model, wick.data, wick.optim
  const std::string name = check_string(L, 1, fn);
  if (!lua_isnoneornil(L, 2)) check_table(L, 2, fn);
  bool grouped = false;
  if (K == PluginKind::Optim && lua_istable(L, 2)) {
    lua_getfield(L, 2, "groups");
    grouped = !lua_isnil(L, -1);
    lua_pop(L, 1);
  }
  auto opts = grouped ? to_options(L, 2, std::string(fn) + " '" + name + "'", {"groups"})
                      : to_options(L, 2, std::string(fn) + " '" + name + "'");
  auto obj = registry().create(name, K, opts);
  if (grouped) obj = make_grouped(L, name, opts, obj);
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
