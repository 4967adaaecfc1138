#pragma once
// Shared helpers for the GoogleTest suite: plugins come from the build tree.
#include <ATen/ATen.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <future>

#include "distributed/group.hpp"
#include "plugin/registry.hpp"

namespace wick::test {

// Two ranks as two threads of one process (two_ranks below) share c10d's
// process-wide flight recorder, whose bookkeeping is not safe for two process
// groups enqueueing at once (a crash inside it, now and then); separate
// processes, as real ranks are, never share it. Off before any group exists.
inline const bool kFlightRecorderOff = [] {
  ::setenv("TORCH_FR_BUFFER_SIZE", "0", 1);
  ::setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0", 1);
  return true;
}();

inline std::filesystem::path test_plugin_dir() {
  return Registry::default_search_path().back().parent_path() / "test-plugins";
}

template <class T>
std::shared_ptr<T> make(const std::string& name, PluginKind kind, std::map<std::string, Value> opts = {}) {
  return std::static_pointer_cast<T>(registry().create(name, kind, opts));
}

/// A fresh temporary folder, removed with the object.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "wick-test-XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

/// A TCP port on loopback that nothing listens on right now.
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

/// `n` ranks as n threads of this process, over gloo on loopback:
/// body(group) runs on each.
template <class F>
void ranks(int n, F&& body) {
  const int port = free_port();
  auto run = [&](int rank) {
    DistEnv env;
    env.rank = rank;
    env.world_size = n;
    env.local_rank = rank;
    env.local_world_size = n;
    env.master_port = port;
    body(std::make_shared<Group>(env, "gloo"));
  };
  std::vector<std::future<void>> others;
  for (int r = 1; r < n; ++r) others.push_back(std::async(std::launch::async, run, r));
  run(0);
  for (auto& o : others) o.get();
}

/// Two ranks (ranks(2, body)).
template <class F>
void two_ranks(F&& body) {
  ranks(2, std::forward<F>(body));
}

/// Runs f and returns the wick::Error message it throws ("" if none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace wick::test
