#include "train/run_folder.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "wick/options.hpp"

namespace fs = std::filesystem;

namespace wick {
namespace {

// The holder, as its run.json names it (written when its run starts).
std::string holder_of(const fs::path& out) {
  std::ifstream in(out / "run.json");
  std::stringstream ss;
  ss << in.rdbuf();
  const auto meta = nlohmann::json::parse(ss.str(), nullptr, false);
  if (!meta.is_object() || meta.value("status", "") != "running" || !meta.contains("pid") ||
      !meta["pid"].is_number_integer())
    return "a process that is starting: its run.json is not written yet";
  const auto pid = meta["pid"].get<long long>();
  std::string who = "pid " + std::to_string(pid) + " on host " +
                    (meta.contains("host") && meta["host"].is_string() ? meta["host"].get<std::string>() : "?");
  if (pid == ::getpid())
    who += " (this process: a run started inside another run's callback, or before the first one ended)";
  return who;
}

// (O_CLOEXEC: a recipe's os.execute must not inherit, and so keep, the lock)
int open_folder(const fs::path& out) { return ::open(out.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); }

}  // namespace

RunFolderLock::RunFolderLock(const fs::path& out, const std::string& what) {
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) throw Error(what + ": cannot create the run folder " + out.string() + ": " + ec.message());
  const int fd = open_folder(out);
  if (fd < 0) throw Error(what + ": cannot open the run folder " + out.string() + ": " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK)
      throw Error(what + ": out '" + out.string() + "' is in use by a live run (" + holder_of(out) +
                  "): one run writes a folder at a time; wait for it to end or stop it, or give another out");
    // a file system without locks (some network mounts): said, and the run goes on unguarded
    std::fprintf(stderr, "wick: warning: %s: cannot lock the run folder %s (%s): nothing stops a second run from "
                 "writing into it meanwhile\n", what.c_str(), out.c_str(), std::strerror(err));
    return;
  }
  fd_ = fd;
}

RunFolderLock::~RunFolderLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor drops the flock
}

RunFolderLock& RunFolderLock::operator=(RunFolderLock&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

std::string run_folder_holder(const fs::path& out) {
  const int fd = open_folder(out);
  if (fd < 0) return "";
  std::string who;
  if (::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK) who = holder_of(out);
  ::close(fd);
  return who;
}

void refuse_run_file(const fs::path& file, const std::string& what) {
  std::error_code ec;
  const fs::path abs = fs::weakly_canonical(fs::absolute(file, ec), ec);
  if (ec) return;
  // the nearest folder above the file that holds a run (checkpoints/ included)
  for (fs::path dir = abs.parent_path(); !dir.empty(); dir = dir.parent_path()) {
    const bool run = fs::is_regular_file(dir / "run.json", ec) || fs::is_regular_file(dir / "metrics.jsonl", ec);
    if (run) {
      const fs::path rel = abs.lexically_relative(dir);
      const std::string first = rel.begin() == rel.end() ? "" : rel.begin()->string();
      static const char* const kOwn[] = {"run.json", "metrics.jsonl", "recipe.lua", "checkpoints",
                                         "model.safetensors", "ema.safetensors"};
      bool own = first.starts_with("events.out.tfevents.");
      for (const char* k : kOwn) own = own || first == k;
      if (own)
        throw Error(what + ": " + file.string() + " is " + (rel == fs::path(first) ? "" : "inside ") +
                    "the run folder " + dir.string() + "'s own '" + first + "', which would be lost; write it elsewhere");
      return;
    }
    if (dir == dir.root_path()) break;
  }
}

}  // namespace wick
