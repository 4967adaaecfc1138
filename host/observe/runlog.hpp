#pragma once
// The run folder as a run writes it (rank 0, when `out` is given):
//   metrics.jsonl   one JSON record per optimizer step and per evaluation: the
//                   source of truth that the report and `wick runs` read
//   events.out.tfevents.*
//                   the same numbers for TensorBoard: every numeric field of a
//                   record is a scalar (scalar_tags); the recipe and the
//                   resolved options as text
//   run.json        status (running, finished, interrupted, failed), the
//                   recipe, options, times, pid and host; rewritten at the end
//   recipe.lua      a copy of the recipe as it ran

#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "observe/observer.hpp"

namespace wick {

class EventWriter;

/// TensorBoard tags of a metrics record: `train/<field>` (`eval/<field>` for
/// evaluation records), memory fields `mem_<x>` as `memory/<x>`; booleans as
/// 0 or 1; `step`, `epoch` and `eval` are not scalars, nor are non-finite
/// numbers (metrics.jsonl writes them as null). Sorted by tag.
std::vector<std::pair<std::string, double>> scalar_tags(const nlohmann::json& record);

class RunLogObserver : public Observer {
 public:
  explicit RunLogObserver(std::string dir);
  ~RunLogObserver() override;
  void on_start(const RunStart& start) override;
  void on_step(const nlohmann::json& record) override;
  void on_steps_delivered() override;
  void on_eval(const nlohmann::json& record) override;
  void on_end(const nlohmann::json& summary) override;
  void on_failure(const std::string& error, const nlohmann::json& summary) override;

 private:
  void record(const nlohmann::json& rec, bool flush_now);
  void finish(const nlohmann::json& fields);
  void flush_metrics();
  std::string dir_;
  nlohmann::json meta_;
  nlohmann::json prev_best_;
  // metrics.jsonl: the lines of a group of steps wait in pending_ and go to
  // the file in one write(), so a kill leaves whole lines (no stdio buffer
  // that fills, and flushes, in the middle of one)
  int metrics_fd_ = -1;
  std::string pending_;
  bool metrics_failed_ = false;
  std::unique_ptr<EventWriter> events_;
};

}  // namespace wick
