#include "observe/runlog.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "observe/events.hpp"
#include "util/system.hpp"
#include "wick/kit/safetensors.hpp"  // write_file_atomic

namespace fs = std::filesystem;

namespace wick {
namespace {

bool read_text(const fs::path& p, std::string& out) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return false;
  std::ostringstream ss;
  ss << in.rdbuf();
  out = ss.str();
  return true;
}

std::string options_markdown(const nlohmann::json& opts) {
  std::string s = "| option | value |\n|---|---|";
  for (auto it = opts.begin(); it != opts.end(); ++it)
    s += "\n| " + it.key() + " | " + (it->is_string() ? it->get<std::string>() : it->dump()) + " |";
  return s;
}

}  // namespace

std::vector<std::pair<std::string, double>> scalar_tags(const nlohmann::json& rec) {
  std::vector<std::pair<std::string, double>> out;
  const std::string group = rec.value("eval", false) ? "eval/" : "train/";
  for (auto it = rec.begin(); it != rec.end(); ++it) {
    const std::string& k = it.key();
    if (k == "step" || k == "epoch" || k == "eval") continue;
    double v = 0;
    if (it->is_boolean()) v = it->get<bool>() ? 1 : 0;
    else if (it->is_number()) v = it->get<double>();
    else continue;
    if (!std::isfinite(v)) continue;
    out.emplace_back(k.rfind("mem_", 0) == 0 ? "memory/" + k.substr(4) : group + k, v);
  }
  std::sort(out.begin(), out.end());
  return out;
}

RunLogObserver::RunLogObserver(std::string dir) : dir_(std::move(dir)) {}

RunLogObserver::~RunLogObserver() {
  if (events_) set_forced_exit_note(nullptr);  // started and not finished
  if (metrics_fd_ >= 0) {
    flush_metrics();
    ::close(metrics_fd_);
  }
}

void RunLogObserver::on_start(const RunStart& start) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw Error("cannot create run folder " + dir_ + ": " + ec.message());
  nlohmann::json prev;
  if (start.start_step > 0) {
    std::string text;
    if (read_text(fs::path(dir_) / "run.json", text)) prev = nlohmann::json::parse(text, nullptr, false);
    if (prev.is_discarded() || !prev.is_object()) prev = nlohmann::json();
  }
  std::string recipe_text;
  const bool have_recipe = !start.recipe.empty() && read_text(start.recipe, recipe_text);
  if (have_recipe) {
    std::string copy;
    if (!read_text(fs::path(dir_) / "recipe.lua", copy) || copy != recipe_text)
      write_file_atomic(fs::path(dir_) / "recipe.lua", recipe_text);
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  meta_ = {{"status", "running"}, {"options", start.options}, {"total_steps", start.total_steps},
           {"start_step", start.start_step}, {"pid", static_cast<std::int64_t>(::getpid())}, {"host", host}};
  if (!start.recipe.empty()) meta_["recipe"] = start.recipe;
  meta_["started"] = prev.is_object() && prev.contains("started") ? prev["started"] : nlohmann::json(std::time(nullptr));
  if (prev.is_object()) meta_["resumed"] = prev.value("resumed", 0) + 1;
  for (auto it = start.extra.begin(); it != start.extra.end(); ++it) meta_[it.key()] = *it;
  if (prev.is_object() && prev.contains("best_loss")) prev_best_ = prev["best_loss"];
  write_file_atomic(fs::path(dir_) / "run.json", meta_.dump() + "\n");
  const auto metrics = fs::path(dir_) / "metrics.jsonl";
  if (start.start_step > 0) {
    // Resumed: records of steps after the checkpoint (run before a kill, or
    // a half-written last line) go; the resumed run writes them again.
    std::string text, kept;
    if (read_text(metrics, text)) {
      std::istringstream in(text);
      std::string line;
      while (std::getline(in, line)) {
        const auto rec = nlohmann::json::parse(line, nullptr, false);
        // (a step that is not a number reads as unreadable, like a line that is not JSON)
        if (!rec.is_object()) continue;
        const auto st = rec.find("step");
        if (st == rec.end() || (st->is_number() && st->get<double>() <= static_cast<double>(start.start_step)))
          kept += line + "\n";
      }
      if (kept != text) write_file_atomic(metrics, kept);
    }
  }
  metrics_fd_ = ::open(metrics.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (start.start_step > 0 ? O_APPEND : O_TRUNC), 0644);
  if (metrics_fd_ < 0) throw Error("cannot write " + metrics.string() + ": " + std::strerror(errno));
  pending_.clear();
  metrics_failed_ = false;
  events_ = std::make_unique<EventWriter>(dir_);
  const double t = wall_time_now();
  // Every run's file starts a session: TensorBoard takes the first as the
  // start and a later one (a resume) as a restart, dropping what earlier files
  // logged from its step on (the steps after the checkpoint, run again)
  events_->session_start(start.start_step + 1, t);
  if (have_recipe) events_->text(start.start_step, "recipe", "```lua\n" + recipe_text + "\n```", t);
  // a signal the run cannot answer ends the process from another thread: said in run.json first
  set_forced_exit_note([this](const std::string& why) { on_failure(why, nlohmann::json::object()); });
  events_->text(start.start_step, "options", options_markdown(start.options), t);
}

// A record's line in metrics.jsonl and its scalars in the event file; both
// files are flushed per group of steps (on_steps_delivered) and per evaluation.
void RunLogObserver::record(const nlohmann::json& rec, bool flush_now) {
  if (metrics_fd_ < 0) return;
  pending_ += rec.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  pending_ += '\n';
  // a long group (log_every = 1 over many steps between deliveries) still
  // goes out in whole lines once it holds 1 MiB
  if (flush_now || pending_.size() >= (1u << 20)) flush_metrics();
  events_->scalars(rec.value("step", std::int64_t{0}), scalar_tags(rec), wall_time_now(), flush_now);
}

// Whole lines in one write() (its rest after a short write, or a signal);
// a file that cannot be written is said once on stderr, and the run goes on
void RunLogObserver::flush_metrics() {
  std::size_t done = 0;
  while (metrics_fd_ >= 0 && done < pending_.size()) {
    const ssize_t n = ::write(metrics_fd_, pending_.data() + done, pending_.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (!metrics_failed_)
        std::cerr << "wick: cannot write " << (fs::path(dir_) / "metrics.jsonl").string() << ": "
                  << (n < 0 ? std::strerror(errno) : "nothing written")
                  << " (the run goes on; its records from here are missing)\n";
      metrics_failed_ = true;
      break;
    }
    done += static_cast<std::size_t>(n);
  }
  pending_.clear();
}

void RunLogObserver::on_step(const nlohmann::json& rec) { record(rec, false); }
void RunLogObserver::on_steps_delivered() {
  if (metrics_fd_ < 0) return;
  flush_metrics();
  events_->flush();
}
void RunLogObserver::on_eval(const nlohmann::json& rec) { record(rec, true); }

void RunLogObserver::finish(const nlohmann::json& fields) {
  set_forced_exit_note(nullptr);
  for (auto it = fields.begin(); it != fields.end(); ++it)
    if (!it->is_null()) meta_[it.key()] = *it;
  if (prev_best_.is_number() &&
      (!meta_.contains("best_loss") || !meta_["best_loss"].is_number() || prev_best_.get<double>() < meta_["best_loss"].get<double>()))
    meta_["best_loss"] = prev_best_;
  meta_["ended"] = std::time(nullptr);
  meta_.erase("pid");
  if (metrics_fd_ >= 0) {
    flush_metrics();
    ::close(metrics_fd_);
  }
  metrics_fd_ = -1;
  if (events_) events_->close();
  events_.reset();
  write_file_atomic(fs::path(dir_) / "run.json", meta_.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

void RunLogObserver::on_end(const nlohmann::json& summary) {
  static const char* kFields[] = {"status", "steps", "final_loss", "best_loss", "peak_memory", "seconds", "eval",
                                  "checkpoint", "micro_batch", "accumulate", "epochs", "seed", "checkpointing",
                                  "skipped_steps", "loss_scale", "memory", "split", "skipped_files",
                                  "skipped_items", "best", "best_step", "stopped", "logged", "ema", "profile"};
  nlohmann::json f = nlohmann::json::object();
  for (const char* k : kFields)
    if (summary.contains(k)) f[k] = summary[k];
  finish(f);
}

void RunLogObserver::on_failure(const std::string& error, const nlohmann::json& summary) {
  // ended by SIGINT or SIGTERM in a callback that did not return: said so, not "failed"
  nlohmann::json f = {{"status", interrupted() ? "interrupted" : "failed"}, {"error", error}};
  for (const char* k : {"steps", "final_loss", "seconds"})
    if (summary.contains(k)) f[k] = summary[k];
  finish(f);
}

}  // namespace wick
