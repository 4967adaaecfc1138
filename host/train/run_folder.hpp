#pragma once
// A run folder has one writer at a time: the run that holds its lock.

#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

namespace wick {

/// Holds an exclusive flock on the folder itself for its life (no file of its
/// own: a refused run leaves the folder as it found it). The kernel drops the
/// lock when the process ends however it ends (kill -9 included), so a dead
/// run never leaves its folder locked; the holder's run.json names its pid
/// and host, which a refusal repeats.
class RunFolderLock {
 public:
  RunFolderLock() = default;
  /// Creates `out` if needed and takes its lock, or throws Error naming the
  /// folder, `what` wanted it and who holds it.
  RunFolderLock(const std::filesystem::path& out, const std::string& what);
  ~RunFolderLock();
  RunFolderLock(RunFolderLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  RunFolderLock& operator=(RunFolderLock&& o) noexcept;
  RunFolderLock(const RunFolderLock&) = delete;
  RunFolderLock& operator=(const RunFolderLock&) = delete;

 private:
  int fd_ = -1;
};

/// Who holds `out`'s lock now, as "pid N on host H" ("" when no live
/// process does).
std::string run_folder_holder(const std::filesystem::path& out);

/// Throws Error when writing `file` (as `what`) would replace one of a run
/// folder's own records: run.json, metrics.jsonl, recipe.lua, TensorBoard
/// events, weights or anything under checkpoints/.
void refuse_run_file(const std::filesystem::path& file, const std::string& what);

/// What an out folder already holds: a run's files, and its run.json.
struct PriorRun {
  bool holds = false;
  std::string what;
  nlohmann::json meta;
  std::string problem;  // run.json unreadable or of the wrong types: named, never guessed at
};
/// Reads `out`: which of a run's files it holds, and its run.json, checked.
PriorRun prior_run(const std::filesystem::path& out);
/// overwrite = true: removes the earlier run's files (never the recipe being run).
void remove_run(const std::filesystem::path& out, const std::string& recipe);

}  // namespace wick
