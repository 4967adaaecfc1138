// wick.core: TensorBoard event files for Lua code (the run writes its own),
// and PyTorch's profiler around Lua code (wick.profile: custom loops).

#include "lua/binding.hpp"

#include <algorithm>
#include <memory>

#include "observe/events.hpp"
#include "observe/profile.hpp"
#include "util/system.hpp"

namespace wick::lua {
namespace {

int core_event_writer(lua_State* L) {
  push_box<EventWriter>(L, std::make_shared<EventWriter>(check_string(L, 1, "event_writer")), kEventsMt);
  return 1;
}

double wall_time_arg(lua_State* L, int i) {
  return lua_isnoneornil(L, i) ? wall_time_now() : luaL_checknumber(L, i);
}

// writer:scalars(step, {tag = number, ...} [, wall_time]): tags in sorted order
int events_scalars(lua_State* L) {
  auto& w = check_box<EventWriter>(L, 1, kEventsMt, "scalars");
  const auto step = static_cast<std::int64_t>(luaL_checknumber(L, 2));
  luaL_checktype(L, 3, LUA_TTABLE);
  std::vector<std::pair<std::string, double>> values;
  lua_pushnil(L);
  while (lua_next(L, 3) != 0) {
    if (lua_type(L, -2) == LUA_TSTRING && lua_type(L, -1) == LUA_TNUMBER)
      values.emplace_back(lua_tostring(L, -2), lua_tonumber(L, -1));
    lua_pop(L, 1);
  }
  std::sort(values.begin(), values.end());
  w->scalars(step, values, wall_time_arg(L, 4));
  return 0;
}

int events_text(lua_State* L) {
  auto& w = check_box<EventWriter>(L, 1, kEventsMt, "text");
  w->text(static_cast<std::int64_t>(luaL_checknumber(L, 2)), check_string(L, 3, "text"), check_string(L, 4, "text"),
          wall_time_arg(L, 5));
  return 0;
}

int events_close(lua_State* L) {
  check_box<EventWriter>(L, 1, kEventsMt, "close")->close();
  return 0;
}

int events_path(lua_State* L) {
  lua_pushstring(L, check_box<EventWriter>(L, 1, kEventsMt, "path")->path().c_str());
  return 1;
}

// wick.profile's profiler: one at a time in a process, as wick.train's
std::unique_ptr<StepProfiler>& lua_profiler() {
  static std::unique_ptr<StepProfiler> p;
  return p;
}

// core.profile_start(): this thread (and the autograd engine's) recorded
// from now, the GPU's work too where CUDA is usable
int core_profile_start(lua_State* L) {
  (void)L;
  if (profiler_in_use())
    throw Error("wick.profile: PyTorch's profiler is recording already in this process (another wick.profile, or a "
                "wick.train with profile, around this one); it records one at a time: profile one of them");
  const bool cuda = cuda_available();
  if (!cuda) quiet_kineto_on_cpu();
  auto p = std::make_unique<StepProfiler>();
  p->start(cuda);
  lua_profiler() = std::move(p);
  return 0;
}

// core.profile_stop(trace or nil, steps) -> the summary (StepProfiler::stop),
// with `text`: its lines as wick.train prints them
int core_profile_stop(lua_State* L) {
  const std::string trace = lua_isnoneornil(L, 1) ? std::string() : check_string(L, 1, "profile_stop");
  const auto steps = static_cast<std::int64_t>(luaL_checknumber(L, 2));
  auto p = std::move(lua_profiler());
  if (!p || !p->active()) throw Error("wick.profile: the profiler was not started");
  nlohmann::json summary = p->stop(trace, steps);
  summary["text"] = profile_lines(summary, 8);
  push_json(L, summary);
  return 1;
}

// core.profile_abort(): the function failed; the profiler stops, its events dropped
int core_profile_abort(lua_State* L) {
  (void)L;
  lua_profiler().reset();
  return 0;
}

}  // namespace

void open_observe(lua_State* L) {
  static const luaL_Reg events_methods[] = {{"scalars", G(events_scalars)},
                                            {"text", G(events_text)},
                                            {"close", G(events_close)},
                                            {"path", G(events_path)},
                                            {nullptr, nullptr}};
  new_metatable<EventWriter>(L, kEventsMt, events_methods);
  static const luaL_Reg fns[] = {{"event_writer", G(core_event_writer)},
                                 {"profile_start", G(core_profile_start)},
                                 {"profile_stop", G(core_profile_stop)},
                                 {"profile_abort", G(core_profile_abort)},
                                 {nullptr, nullptr}};
  luaL_register(L, nullptr, fns);
}

}  // namespace wick::lua
