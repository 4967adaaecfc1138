#pragma once
// Shared by the binding files (host/lua/*.cpp): errors that carry the
// recipe's file and line, Lua values <-> wick Values and JSON, userdata boxes
// with named metatables (wick.Model, wick.Data, wick.Optim, wick.Loader,
// wick.Window, wick.Trainer, wick.EventWriter) and their check_<type>
// helpers. Every bound function runs inside guarded(): a C++ exception
// becomes a Lua error prefixed with the recipe's file and line.

#include <lua.hpp>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lua/runtime.hpp"
#include "train/deferred.hpp"
#include "train/partition.hpp"
#include "wick/data.hpp"
#include "wick/model.hpp"
#include "wick/optim.hpp"

namespace wick::lua {

namespace fs = std::filesystem;

inline constexpr const char* kModelMt = "wick.Model";
inline constexpr const char* kDataMt = "wick.Data";
inline constexpr const char* kOptimMt = "wick.Optim";
inline constexpr const char* kLoaderMt = "wick.Loader";
inline constexpr const char* kWindowMt = "wick.Window";
inline constexpr const char* kTrainerMt = "wick.Trainer";
inline constexpr const char* kEventsMt = "wick.EventWriter";
inline constexpr const char* kPackageDirKey = "wick.package_dir";

// "recipe.lua:12: " for the innermost Lua frame outside the wick package, so
// an error inside wick.train points at the recipe line that called it.
inline std::string user_location(lua_State* L) {
  lua_getfield(L, LUA_REGISTRYINDEX, kPackageDirKey);
  std::string pkg = lua_isstring(L, -1) ? lua_tostring(L, -1) : "";
  lua_pop(L, 1);
  lua_Debug ar;
  for (int level = 1; lua_getstack(L, level, &ar); ++level) {
    if (!lua_getinfo(L, "Sl", &ar) || ar.currentline <= 0 || ar.source[0] != '@') continue;
    std::string src = ar.source + 1;
    std::error_code ec;
    const auto abs = fs::weakly_canonical(src, ec).string();
    if (!pkg.empty() && abs.rfind(pkg, 0) == 0) continue;
    return src + ":" + std::to_string(ar.currentline) + ": ";
  }
  return "";
}

template <lua_CFunction F>
int guarded(lua_State* L) {
  std::string msg;
  try {
    return F(L);
  } catch (const c10::Error& e) {  // LibTorch's errors: the message, not its C++ frames
    msg = e.what_without_backtrace();
  } catch (const std::exception& e) {  // never catch(...): LuaJIT's own errors unwind through here
    msg = e.what();
  }
  msg = user_location(L) + msg;
  lua_pushlstring(L, msg.data(), msg.size());
  return lua_error(L);
}

inline const char* type_of(lua_State* L, int i) {
  return lua_isnone(L, i) ? "no value" : luaL_typename(L, i);
}

inline Error bad_argument(lua_State* L, int i, const char* fn, const std::string& expected) {
  return Error("bad argument #" + std::to_string(i) + " to '" + fn + "' (" + expected + " expected, got " +
               type_of(L, i) + ")");
}

inline std::string check_string(lua_State* L, int i, const char* fn) {
  if (lua_type(L, i) != LUA_TSTRING) throw bad_argument(L, i, fn, "string");
  return lua_tostring(L, i);
}

inline void check_table(lua_State* L, int i, const char* fn) {
  if (!lua_istable(L, i)) throw bad_argument(L, i, fn, "table");
}

// ---- values ----

inline Value to_value(lua_State* L, int i, const std::string& where);

inline bool is_array(lua_State* L, int i, std::size_t* n) {
  *n = lua_objlen(L, i);
  std::size_t count = 0;
  lua_pushnil(L);
  while (lua_next(L, i)) {
    ++count;
    lua_pop(L, 1);
  }
  return count == *n;
}

inline Value to_value(lua_State* L, int i, const std::string& where) {
  i = i < 0 ? lua_gettop(L) + i + 1 : i;
  switch (lua_type(L, i)) {
    case LUA_TNIL: return Value();
    case LUA_TBOOLEAN: return Value(static_cast<bool>(lua_toboolean(L, i)));
    case LUA_TNUMBER: {
      const double d = lua_tonumber(L, i);
      if (std::floor(d) == d && std::fabs(d) < 9.007199254740992e15) return Value(static_cast<std::int64_t>(d));
      return Value(d);
    }
    case LUA_TSTRING: return Value(std::string(lua_tostring(L, i)));
    case LUA_TTABLE: {
      std::size_t n = 0;
      if (!is_array(L, i, &n)) throw Error(where + ": expected a list, got a table with named keys");
      List l;
      for (std::size_t k = 1; k <= n; ++k) {
        lua_rawgeti(L, i, static_cast<int>(k));
        l.push_back(to_value(L, -1, where));
        lua_pop(L, 1);
      }
      return Value(std::move(l));
    }
    default:
      throw Error(where + ": a " + std::string(luaL_typename(L, i)) + " cannot be an option value");
  }
}

// The option table at i as values; keys in `skip` are left to the caller.
inline std::map<std::string, Value> to_options(lua_State* L, int i, const std::string& plugin,
                                               std::initializer_list<const char*> skip = {}) {
  std::map<std::string, Value> out;
  if (lua_isnoneornil(L, i)) return out;
  i = i < 0 ? lua_gettop(L) + i + 1 : i;
  lua_pushnil(L);
  while (lua_next(L, i)) {
    if (lua_type(L, -2) != LUA_TSTRING) throw Error(plugin + ": option names must be strings");
    std::string key = lua_tostring(L, -2);
    if (std::find_if(skip.begin(), skip.end(), [&](const char* k) { return key == k; }) != skip.end()) {
      lua_pop(L, 1);
      continue;
    }
    out[key] = to_value(L, -1, plugin + ": option '" + key + "'");
    lua_pop(L, 1);
  }
  return out;
}

inline void push_value(lua_State* L, const Value& v) {
  switch (v.v.index()) {
    case 0: lua_pushnil(L); break;
    case 1: lua_pushboolean(L, v.as_bool()); break;
    case 2: lua_pushnumber(L, static_cast<lua_Number>(v.as_int())); break;
    case 3: lua_pushnumber(L, v.as_number()); break;
    case 4: lua_pushstring(L, v.as_string().c_str()); break;
    default: {
      const auto& l = v.as_list();
      lua_createtable(L, static_cast<int>(l.size()), 0);
      for (std::size_t k = 0; k < l.size(); ++k) {
        push_value(L, l[k]);
        lua_rawseti(L, -2, static_cast<int>(k + 1));
      }
    }
  }
}

inline nlohmann::json to_json(lua_State* L, int i, int depth = 0) {
  i = i < 0 ? lua_gettop(L) + i + 1 : i;
  if (depth > 32) throw Error("table nested too deeply to write as JSON");
  switch (lua_type(L, i)) {
    case LUA_TNIL: return nullptr;
    case LUA_TBOOLEAN: return static_cast<bool>(lua_toboolean(L, i));
    case LUA_TNUMBER: {
      const double d = lua_tonumber(L, i);
      if (std::floor(d) == d && std::fabs(d) < 9.007199254740992e15) return static_cast<std::int64_t>(d);
      if (!std::isfinite(d)) return nullptr;
      return d;
    }
    case LUA_TSTRING: return std::string(lua_tostring(L, i));
    case LUA_TTABLE: {
      std::size_t n = 0;
      if (is_array(L, i, &n) && n > 0) {
        auto arr = nlohmann::json::array();
        for (std::size_t k = 1; k <= n; ++k) {
          lua_rawgeti(L, i, static_cast<int>(k));
          arr.push_back(to_json(L, -1, depth + 1));
          lua_pop(L, 1);
        }
        return arr;
      }
      auto obj = nlohmann::json::object();
      lua_pushnil(L);
      while (lua_next(L, i)) {
        lua_pushvalue(L, -2);
        std::string key = lua_tostring(L, -1);
        lua_pop(L, 1);
        if (lua_type(L, -1) != LUA_TFUNCTION && lua_type(L, -1) != LUA_TUSERDATA)
          obj[key] = to_json(L, -1, depth + 1);
        lua_pop(L, 1);
      }
      return obj;
    }
    default: return std::string(luaL_typename(L, i));
  }
}

inline void push_json(lua_State* L, const nlohmann::json& j) {
  if (j.is_null()) lua_pushnil(L);
  else if (j.is_boolean()) lua_pushboolean(L, j.get<bool>());
  else if (j.is_number()) lua_pushnumber(L, j.get<double>());
  else if (j.is_string()) lua_pushstring(L, j.get<std::string>().c_str());
  else if (j.is_array()) {
    lua_createtable(L, static_cast<int>(j.size()), 0);
    int k = 1;
    for (const auto& x : j) {
      push_json(L, x);
      lua_rawseti(L, -2, k++);
    }
  } else {
    lua_createtable(L, 0, static_cast<int>(j.size()));
    for (auto it = j.begin(); it != j.end(); ++it) {
      push_json(L, it.value());
      lua_setfield(L, -2, it.key().c_str());
    }
  }
}

inline void set_number(lua_State* L, const char* k, double v) {
  lua_pushnumber(L, v);
  lua_setfield(L, -2, k);
}

// ---- userdata ----

template <class T>
struct Box {
  std::shared_ptr<T> ptr;
};

template <class T>
void push_box(lua_State* L, std::shared_ptr<T> p, const char* mt) {
  void* mem = lua_newuserdata(L, sizeof(Box<T>));
  new (mem) Box<T>{std::move(p)};
  luaL_getmetatable(L, mt);
  lua_setmetatable(L, -2);
}

template <class T>
Box<T>* test_box(lua_State* L, int i, const char* mt) {
  void* p = lua_touserdata(L, i);
  if (!p || !lua_getmetatable(L, i)) return nullptr;
  luaL_getmetatable(L, mt);
  const bool ok = lua_rawequal(L, -1, -2);
  lua_pop(L, 2);
  return ok ? static_cast<Box<T>*>(p) : nullptr;
}

template <class T>
std::shared_ptr<T>& check_box(lua_State* L, int i, const char* mt, const char* fn) {
  auto* b = test_box<T>(L, i, mt);
  if (!b || !b->ptr) throw bad_argument(L, i, fn, mt);
  return b->ptr;
}

template <class T>
int box_gc(lua_State* L) {
  auto* b = static_cast<Box<T>*>(lua_touserdata(L, 1));
  if (b) b->~Box<T>();
  return 0;
}

/// `whole`: the method reads or changes the weights, so a deferred model
/// (built without them) is made whole first; false for what needs only the
/// model's structure (its blocks, a transform adding adapters).
inline std::shared_ptr<Model> check_model(lua_State* L, int i, const char* fn, bool whole = true) {
  auto m = std::static_pointer_cast<Model>(check_box<Object>(L, i, kModelMt, fn));
  // shard = "parameters": a callback reading a model whose weights are divided
  if (const std::string why = weights_partitioned(*m); !why.empty())
    throw Error(std::string(fn) + ": the model cannot be used now: " + why);
  if (whole) materialize_whole(*m, std::string("model:") + fn);
  return m;
}

inline std::shared_ptr<Dataset> check_data(lua_State* L, int i, const char* fn) {
  return std::static_pointer_cast<Dataset>(check_box<Object>(L, i, kDataMt, fn));
}

// Methods first, then the object's attributes (data.num_classes).
inline int object_index(lua_State* L) {
  auto* b = static_cast<Box<Object>*>(lua_touserdata(L, 1));
  lua_getmetatable(L, 1);
  lua_getfield(L, -1, "methods");
  lua_pushvalue(L, 2);
  lua_rawget(L, -2);
  if (!lua_isnil(L, -1)) return 1;
  lua_pop(L, 3);
  if (lua_type(L, 2) != LUA_TSTRING || !b || !b->ptr) return 0;
  const std::string key = lua_tostring(L, 2);
  const auto attrs = b->ptr->attributes();
  auto it = attrs.find(key);
  if (it == attrs.end()) {
    lua_pushnil(L);
    return 1;
  }
  push_value(L, it->second);
  return 1;
}

// ---- wick.core functions ----

// Reads an optional field of the table at index t.
template <class T>
T field(lua_State* L, int t, const char* key, T def) {
  lua_getfield(L, t, key);
  T out = def;
  if (!lua_isnil(L, -1)) {
    if constexpr (std::is_same_v<T, bool>) {
      if (!lua_isboolean(L, -1)) throw Error(std::string("'") + key + "' must be a boolean, got " + luaL_typename(L, -1));
      out = lua_toboolean(L, -1);
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (lua_type(L, -1) != LUA_TSTRING) throw Error(std::string("'") + key + "' must be a string, got " + luaL_typename(L, -1));
      out = lua_tostring(L, -1);
    } else {
      if (lua_type(L, -1) != LUA_TNUMBER) throw Error(std::string("'") + key + "' must be a number, got " + luaL_typename(L, -1));
      out = static_cast<T>(lua_tonumber(L, -1));
    }
  }
  lua_pop(L, 1);
  return out;
}

inline std::vector<std::int64_t> check_ids(lua_State* L, int i, const char* fn) {
  check_table(L, i, fn);
  std::vector<std::int64_t> ids;
  const auto n = lua_objlen(L, i);
  for (std::size_t k = 1; k <= n; ++k) {
    lua_rawgeti(L, i, static_cast<int>(k));
    if (lua_type(L, -1) != LUA_TNUMBER) throw Error(std::string(fn) + ": token ids must be numbers");
    ids.push_back(static_cast<std::int64_t>(lua_tonumber(L, -1)));
    lua_pop(L, 1);
  }
  return ids;
}

inline void push_ids(lua_State* L, const std::vector<std::int64_t>& ids) {
  lua_createtable(L, static_cast<int>(ids.size()), 0);
  for (std::size_t k = 0; k < ids.size(); ++k) {
    lua_pushnumber(L, static_cast<double>(ids[k]));
    lua_rawseti(L, -2, static_cast<int>(k + 1));
  }
}

inline void push_metrics(lua_State* L, const std::map<std::string, double>& m) {
  for (const auto& [k, v] : m) set_number(L, k.c_str(), v);
}

template <class T>
void new_metatable(lua_State* L, const char* name, const luaL_Reg* methods, lua_CFunction index = nullptr) {
  luaL_newmetatable(L, name);
  lua_pushcfunction(L, box_gc<T>);
  lua_setfield(L, -2, "__gc");
  lua_pushstring(L, name);
  lua_setfield(L, -2, "__name");
  lua_newtable(L);
  if (methods) luaL_register(L, nullptr, methods);
  if (index) {
    lua_setfield(L, -2, "methods");
    lua_pushcfunction(L, index);
    lua_setfield(L, -2, "__index");
  } else {
    lua_setfield(L, -2, "__index");
  }
  lua_pushfstring(L, "%s", name);
  lua_pushcclosure(L, [](lua_State* L) -> int {
    lua_pushfstring(L, "%s: %p", lua_tostring(L, lua_upvalueindex(1)), lua_touserdata(L, 1));
    return 1;
  }, 1);
  lua_setfield(L, -2, "__tostring");
  lua_pop(L, 1);
}

#define G(f) ::wick::lua::guarded<f>

// Each file of the binding adds its functions to the wick.core table on top
// of the stack, and registers the metatables of the objects it binds.
void open_values(lua_State* L);
void open_objects(lua_State* L);
void open_plugins(lua_State* L);
void open_train(lua_State* L);
void open_observe(lua_State* L);
void open_sys(lua_State* L);
void open_tokenizer(lua_State* L);

}  // namespace wick::lua
