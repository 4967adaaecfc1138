// wick.core: What CLI tools written in Lua need from the system: time, terminals, files and folders, processes.

#include "lua/binding.hpp"

#include <sys/ioctl.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>

#include "wick/kit/safetensors.hpp"

namespace wick::lua {
namespace {

int core_now(lua_State* L) {
  lua_pushnumber(L, std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count());
  return 1;
}

int core_isatty(lua_State* L) {
  lua_pushboolean(L, ::isatty(static_cast<int>(luaL_checknumber(L, 1))));
  return 1;
}

int core_where(lua_State* L) {
  lua_pushstring(L, user_location(L).c_str());
  return 1;
}

int core_mkdirs(lua_State* L) {
  const std::string p = check_string(L, 1, "mkdirs");
  std::error_code ec;
  fs::create_directories(p, ec);
  if (ec) throw Error("cannot create folder " + p + ": " + ec.message());
  return 0;
}

int core_write_file(lua_State* L) {
  size_t n = 0;
  const std::string p = check_string(L, 1, "write_file");
  const char* s = luaL_checklstring(L, 2, &n);
  write_file_atomic(p, std::string(s, n));
  return 0;
}

// ---- run folders: TensorBoard events, listing, processes, terminals ----

// core.list_dir(path) -> { {name=, dir=bool, size=, mtime=}, ... } sorted by
// name, or nil and the reason
int core_list_dir(lua_State* L) {
  const std::string p = check_string(L, 1, "list_dir");
  std::error_code ec;
  std::vector<fs::directory_entry> entries;
  for (fs::directory_iterator it(p, ec), end; !ec && it != end; it.increment(ec)) entries.push_back(*it);
  if (ec) {
    lua_pushnil(L);
    lua_pushstring(L, (p + ": " + ec.message()).c_str());
    return 2;
  }
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.path().filename() < b.path().filename(); });
  lua_createtable(L, static_cast<int>(entries.size()), 0);
  int i = 0;
  for (const auto& e : entries) {
    lua_createtable(L, 0, 4);
    lua_pushstring(L, e.path().filename().c_str());
    lua_setfield(L, -2, "name");
    lua_pushboolean(L, e.is_directory(ec));
    lua_setfield(L, -2, "dir");
    const auto size = e.is_regular_file(ec) ? e.file_size(ec) : 0;
    set_number(L, "size", static_cast<double>(ec ? 0 : size));
    const auto mt = e.last_write_time(ec);
    // file_clock is system time shifted by a fixed offset (libstdc++: 2174 - 1970)
    const auto secs = std::chrono::duration<double>(std::chrono::file_clock::to_sys(mt).time_since_epoch()).count();
    set_number(L, "mtime", ec ? 0.0 : secs);
    lua_rawseti(L, -2, ++i);
  }
  return 1;
}

// core.process() -> { pid =, host = }
int core_process(lua_State* L) {
  lua_createtable(L, 0, 2);
  set_number(L, "pid", static_cast<double>(::getpid()));
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  lua_pushstring(L, host);
  lua_setfield(L, -2, "host");
  return 1;
}

// core.pid_alive(pid): a process with this id exists on this machine
int core_pid_alive(lua_State* L) {
  const auto pid = static_cast<pid_t>(luaL_checknumber(L, 1));
  lua_pushboolean(L, pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM));
  return 1;
}

// core.term_width(fd): the terminal's columns, or 0 when fd is not a terminal
int core_term_width(lua_State* L) {
  winsize ws{};
  const int fd = static_cast<int>(luaL_checknumber(L, 1));
  lua_pushnumber(L, ::ioctl(fd, TIOCGWINSZ, &ws) == 0 ? ws.ws_col : 0);
  return 1;
}

}  // namespace

void open_sys(lua_State* L) {
  static const luaL_Reg fns[] = {{"now", G(core_now)},
                                 {"isatty", G(core_isatty)},
                                 {"where", G(core_where)},
                                 {"mkdirs", G(core_mkdirs)},
                                 {"write_file", G(core_write_file)},
                                 {"list_dir", G(core_list_dir)},
                                 {"process", G(core_process)},
                                 {"pid_alive", G(core_pid_alive)},
                                 {"term_width", G(core_term_width)},
                                 {nullptr, nullptr}};
  luaL_register(L, nullptr, fns);
}

}  // namespace wick::lua
