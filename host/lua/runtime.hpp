#pragma once
// The LuaJIT host: a Lua state with the `wick` package on its path and the
// engine bound as `wick.core`. This folder is the only one that knows Lua.

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "train/run_context.hpp"

struct lua_State;

namespace wick {

class LuaRuntime {
 public:
  /// `context`: the key=value pairs after the recipe (wick.args), which the
  /// runtime owns; reads of wick.args and each wick.train call note theirs in it.
  explicit LuaRuntime(RunContext context = RunContext{});
  ~LuaRuntime();
  LuaRuntime(const LuaRuntime&) = delete;
  LuaRuntime& operator=(const LuaRuntime&) = delete;

  /// Runs a recipe file. Returns 0, or prints the error (file, line, message)
  /// to stderr and returns 1.
  int run_file(const std::filesystem::path& recipe);
  /// Runs a chunk of Lua; throws wick::Error with Lua's message on failure.
  void run_string(const std::string& code, const std::string& chunk_name = "=(wick)");

  /// require(module)[fn](args...); throws wick::Error with Lua's message.
  void call(const std::string& module, const std::string& fn, const std::vector<std::string>& args);

  lua_State* state() { return L_; }

  /// The command line's pairs and which were read, by whom and when.
  RunContext& context() { return context_; }

  /// `wick plan`: the recipe's wick.train call measures memory for each knob
  /// (device_memory bytes to fit; 0: the device's own) and ends the recipe.
  void set_plan(std::int64_t device_memory);
  /// Whether a wick.train call ran the plan (after run_file).
  bool planned() const { return planned_; }

  /// The folder holding the `wick` Lua package (<exe>/../share/wick/lua).
  static std::filesystem::path package_dir();

 private:
  RunContext context_;  // before L_: the state's bindings point at it
  lua_State* L_;
  bool planned_ = false;
};

/// The error object core.train raises after a plan: the recipe ends there, successfully.
void* plan_done_sentinel();

/// The run context of the runtime that owns `L` (wick.args, the keys read);
/// null for a state that no LuaRuntime made.
RunContext* run_context(lua_State* L);

/// Registers the engine bindings as package.preload["wick.core"].
void open_wick_core(lua_State* L);

}  // namespace wick
