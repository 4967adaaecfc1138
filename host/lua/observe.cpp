// wick.core: TensorBoard event files for Lua code (the run writes its own).

#include "lua/binding.hpp"

#include <algorithm>

#include "observe/events.hpp"

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

}  // namespace

void open_observe(lua_State* L) {
  static const luaL_Reg events_methods[] = {{"scalars", G(events_scalars)},
                                            {"text", G(events_text)},
                                            {"close", G(events_close)},
                                            {"path", G(events_path)},
                                            {nullptr, nullptr}};
  new_metatable<EventWriter>(L, kEventsMt, events_methods);
  static const luaL_Reg fns[] = {{"event_writer", G(core_event_writer)}, {nullptr, nullptr}};
  luaL_register(L, nullptr, fns);
}

}  // namespace wick::lua
