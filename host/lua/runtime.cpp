#include "lua/runtime.hpp"

#include <lua.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "util/args.hpp"
#include "util/layout.hpp"
#include "util/system.hpp"
#include "wick/options.hpp"

namespace fs = std::filesystem;

namespace wick {
namespace {

// Values on the command line read as Lua values: numbers, booleans, strings.
void push_arg(lua_State* L, const std::string& v) {
  const Value value = parse_arg_value(v);  // the one rule, util/args.hpp
  if (value.is_bool()) lua_pushboolean(L, value.as_bool());
  else if (value.is_number()) lua_pushnumber(L, static_cast<lua_Number>(value.as_number()));
  else lua_pushlstring(L, v.data(), v.size());
}

int traceback(lua_State* L) {
  if (lua_touserdata(L, 1) == plan_done_sentinel()) return 1;
  if (!lua_isstring(L, 1)) {
    // error objects that are not strings: their __tostring, or what they are
    // and where they were raised (the innermost Lua function: error() is C)
    if (luaL_callmeta(L, 1, "__tostring") && lua_isstring(L, -1)) return 1;
    std::string where;
    lua_Debug ar;
    for (int level = 1; lua_getstack(L, level, &ar); ++level) {
      if (lua_getinfo(L, "Sl", &ar) && ar.currentline > 0) {
        where = std::string(ar.short_src) + ":" + std::to_string(ar.currentline) + ": ";
        break;
      }
    }
    const char* type = luaL_typename(L, 1);
    if (lua_istable(L, 1) || lua_isuserdata(L, 1))
      lua_pushfstring(L, "%serror object is a %s (no __tostring to describe it)", where.c_str(), type);
    else
      lua_pushfstring(L, "%serror object is a %s value", where.c_str(), type);
    return 1;
  }
  if (std::getenv("WICK_TRACEBACK")) {
    lua_getglobal(L, "debug");
    lua_getfield(L, -1, "traceback");
    lua_pushvalue(L, 1);
    lua_pushinteger(L, 2);
    lua_call(L, 2, 1);
  }
  return 1;
}

// The state the first SIGINT or SIGTERM interrupts (lua.c's way): the handler
// arms a count hook, and the hook raises "interrupted by SIG..." in whatever
// Lua code runs, once the loop or the recipe that owns the signal had its grace.
lua_State* g_interruptible = nullptr;

void on_interrupt_hook(lua_State* L, lua_Debug*) {
  if (!interrupted()) return;
  if (interrupt_due()) {
    lua_sethook(L, nullptr, 0, 0);
    luaL_error(L, "interrupted by %s", signal_name(interrupt_signal()).c_str());
  }
}

void arm_interrupt(int) {
  // lua_sethook is safe to call from a signal handler (lua.c and luajit.c do)
  if (lua_State* L = g_interruptible) lua_sethook(L, on_interrupt_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1000);
}

}  // namespace

fs::path LuaRuntime::package_dir() {
  if (const char* env = std::getenv("WICK_LUA_DIR")) return env;
  return layout::data_dir() / "lua";
}

LuaRuntime::LuaRuntime(RunContext context) : context_(std::move(context)), L_(luaL_newstate()) {
  if (!L_) throw Error("cannot create a Lua state (out of memory)");
  luaL_openlibs(L_);
  // require "wick" from any directory: the package folder goes first on package.path.
  const std::string dir = package_dir().string();
  lua_getglobal(L_, "package");
  lua_getfield(L_, -1, "path");
  std::string path = dir + "/?.lua;" + dir + "/?/init.lua;" + lua_tostring(L_, -1);
  lua_pop(L_, 1);
  lua_pushstring(L_, path.c_str());
  lua_setfield(L_, -2, "path");
  lua_pop(L_, 1);
  open_wick_core(L_);
  // print() lines interleave with the progress on stderr in order, also through a pipe
  luaL_dostring(L_, "io.stdout:setvbuf('line')");
  // the context itself, for the bindings (wick.args reads, core.train)
  lua_pushlightuserdata(L_, &context_);
  lua_setfield(L_, LUA_REGISTRYINDEX, "wick.context");
  // wick.args's values as Lua values; init.lua notes the reads in the context
  lua_newtable(L_);
  for (const auto& [k, v] : context_.args()) {
    push_arg(L_, v);
    lua_setfield(L_, -2, k.c_str());
  }
  lua_setfield(L_, LUA_REGISTRYINDEX, "wick.args");
  g_interruptible = L_;
  set_interrupt_hook(arm_interrupt);
  if (interrupted()) arm_interrupt(interrupt_signal());
}

RunContext* run_context(lua_State* L) {
  lua_getfield(L, LUA_REGISTRYINDEX, "wick.context");
  auto* context = static_cast<RunContext*>(lua_touserdata(L, -1));
  lua_pop(L, 1);
  return context;
}

void* plan_done_sentinel() {
  static char sentinel;
  return &sentinel;
}

void LuaRuntime::set_plan(std::int64_t device_memory) {
  lua_pushnumber(L_, static_cast<lua_Number>(device_memory));
  lua_setfield(L_, LUA_REGISTRYINDEX, "wick.plan");
}

LuaRuntime::~LuaRuntime() {
  if (g_interruptible == L_) {
    set_interrupt_hook(nullptr);
    g_interruptible = nullptr;
  }
  lua_close(L_);
}

void LuaRuntime::run_string(const std::string& code, const std::string& chunk_name) {
  lua_pushcfunction(L_, traceback);
  const int handler = lua_gettop(L_);
  if (luaL_loadbuffer(L_, code.data(), code.size(), chunk_name.c_str()) || lua_pcall(L_, 0, 0, handler)) {
    std::string msg = lua_tostring(L_, -1) ? lua_tostring(L_, -1) : "unknown Lua error";
    lua_settop(L_, handler - 1);
    throw Error(msg);
  }
  lua_settop(L_, handler - 1);
}

void LuaRuntime::call(const std::string& module, const std::string& fn, const std::vector<std::string>& args) {
  lua_pushcfunction(L_, traceback);
  const int handler = lua_gettop(L_);
  lua_getglobal(L_, "require");
  lua_pushstring(L_, module.c_str());
  if (lua_pcall(L_, 1, 1, handler) == 0) {
    lua_getfield(L_, -1, fn.c_str());
    for (const auto& a : args) lua_pushlstring(L_, a.data(), a.size());
    if (lua_pcall(L_, static_cast<int>(args.size()), 0, handler) == 0) {
      lua_settop(L_, handler - 1);
      return;
    }
  }
  std::string msg = lua_tostring(L_, -1) ? lua_tostring(L_, -1) : "unknown Lua error";
  lua_settop(L_, handler - 1);
  throw Error(msg);
}

int LuaRuntime::run_file(const fs::path& recipe) {
  std::error_code ec;
  if (fs::is_directory(recipe, ec)) {
    std::fprintf(stderr, "wick: error: recipe %s is a directory, expected a Lua file\n", recipe.c_str());
    return 1;
  }
  if (!fs::is_regular_file(recipe, ec)) {
    std::fprintf(stderr, "wick: error: recipe %s does not exist (expected a Lua file)\n", recipe.c_str());
    return 1;
  }
  lua_pushcfunction(L_, traceback);
  const int handler = lua_gettop(L_);
  // arg[0] is the recipe, as in the standalone interpreter.
  lua_newtable(L_);
  lua_pushstring(L_, recipe.c_str());
  lua_rawseti(L_, -2, 0);
  lua_setglobal(L_, "arg");
  int rc = luaL_loadfile(L_, recipe.c_str());
  if (rc == 0) rc = lua_pcall(L_, 0, 0, handler);
  if (rc != 0 && lua_touserdata(L_, -1) == plan_done_sentinel()) {
    planned_ = true;
    rc = 0;
  }
  if (rc != 0) {
    const char* msg = lua_tostring(L_, -1);
    std::fprintf(stderr, "wick: error: %s\n", msg ? msg : "unknown Lua error");
    lua_settop(L_, handler - 1);
    return 1;
  }
  lua_settop(L_, handler - 1);
  return 0;
}

}  // namespace wick
