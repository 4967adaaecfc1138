#include "train/run_folder.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "train/run_internal.hpp"
#include "wick/kit/json_fields.hpp"
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

namespace {

// The run.json fields a resume reads or hands back, of the types the run
// wrote; "" when they are.
std::string run_json_problem(const nlohmann::json& meta, const std::string& file) {
  try {
    constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
    const JsonFields j(meta, file);
    j.string("status", "");
    for (const char* k : {"steps", "start_step", "total_steps", "skipped_steps", "started", "ended", "micro_batch",
                          "accumulate", "world_size", "resumed"})
      j.integer(k, 0, 0, kMax);
    for (const char* k : {"final_loss", "best_loss", "peak_memory", "seconds", "loss_scale"})
      if (j.has(k) && !j.json()[k].is_number()) j.bad(k, "a number");
    for (const char* k : {"memory", "options", "eval", "best", "stopped", "logged"})
      if (j.has(k)) j.object(k);
    for (const char* k : {"checkpoint", "recipe", "precision", "device", "ema"}) j.string(k, "");
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// The files that make an out folder hold a run (with TensorBoard's events).
const char* const kRunFiles[] = {"run.json", "metrics.jsonl", "recipe.lua", "report.html", "checkpoints",
                                 "profile.json"};

}  // namespace

PriorRun prior_run(const fs::path& out) {
  PriorRun p;
  std::error_code ec;
  std::vector<std::string> found;
  for (const char* f : kRunFiles)
    if (fs::exists(out / f, ec)) found.push_back(f);
  for (const auto& e : fs::directory_iterator(out, ec))
    if (e.path().filename().string().starts_with("events.out.tfevents.")) {
      found.push_back("TensorBoard events");
      break;
    }
  if (found.empty()) return p;
  p.holds = true;
  const std::string file = (out / "run.json").string();
  const std::string text = read_text(file);
  if (!text.empty()) {
    try {
      p.meta = nlohmann::json::parse(text);
      p.problem = run_json_problem(p.meta, file);
    } catch (const nlohmann::json::exception& e) {
      p.problem = file + " is not valid JSON: " + json_error_text(e);
    }
    if (!p.problem.empty()) p.meta = nlohmann::json();
  }
  if (p.meta.is_object() && p.meta.contains("status")) {
    const auto steps = p.meta.value("steps", p.meta.value("start_step", std::int64_t{0}));
    const std::string status = p.meta.value("status", std::string("?"));
    p.what = "status " + status + ", " + std::to_string(steps) + " of " +
             std::to_string(p.meta.value("total_steps", std::int64_t{0})) + " steps";
    // run.json is written as a run starts and ends: one still "running" that
    // no process holds was killed, and its checkpoints say how far it got
    if (status == "running") {
      std::string last;
      if (std::ifstream in(out / "checkpoints" / "last"); in) std::getline(in, last);
      p.what = "status running, but no process holds it: killed or crashed, " +
               (last.empty() ? std::string("no checkpoint") : "last checkpoint " + last) + ", of " +
               std::to_string(p.meta.value("total_steps", std::int64_t{0})) + " steps";
    }
  } else {
    p.meta = nlohmann::json();
    for (const auto& f : found) p.what += (p.what.empty() ? "" : ", ") + f;
  }
  return p;
}

// overwrite = true: the earlier run's files go; each is renamed first, so a
// kill halfway leaves no half-removed checkpoint that looks whole. The recipe
// being run is never one of them (out = its own folder, and it is recipe.lua).
void remove_run(const fs::path& out, const std::string& recipe) {
  std::error_code ec;
  std::vector<fs::path> doomed;
  for (const char* f : kRunFiles)
    if (fs::exists(out / f, ec) && !(!recipe.empty() && fs::equivalent(out / f, recipe, ec)))
      doomed.push_back(out / f);
  for (const auto& e : fs::directory_iterator(out, ec))
    if (const std::string name = e.path().filename().string();
        name.starts_with("events.out.tfevents.") || (name.starts_with("profile-rank") && name.ends_with(".json")))
      doomed.push_back(e.path());
  for (const auto& d : doomed) {
    const fs::path trash = out / (".trash-" + d.filename().string());
    fs::remove_all(trash, ec);
    fs::rename(d, trash, ec);
    if (ec) throw Error("overwrite: cannot remove " + d.string() + ": " + ec.message());
    fs::remove_all(trash, ec);
  }
}

}  // namespace wick
