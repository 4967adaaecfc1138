#pragma once
// The progress display and the end-of-run summary, on stderr. On a terminal:
// one line, redrawn in place each step and cut to the terminal's width
// (fields dropped from the right), so it never wraps. Not on a terminal: a
// plain line every log_every steps (and the first and last).

#include <cstdint>
#include <string>

#include "observe/observer.hpp"

namespace wick {

class ProgressObserver : public Observer {
 public:
  /// `fd`: where to write (2: stderr); tty-ness and width are read from it.
  ProgressObserver(std::int64_t log_every, int fd = 2);
  void on_start(const RunStart& start) override;
  void on_step(const nlohmann::json& record) override;
  void on_eval(const nlohmann::json& record) override;
  void on_end(const nlohmann::json& summary) override;
  bool wants_every_step() const override { return tty_; }

  /// Ends the redrawn line: the last step's line stays (before evaluation
  /// lines and the summary).
  void finish_line();
  /// A note between steps, on its own line (clears a redrawn line first).
  void note(const std::string& line);
  bool tty() const { return tty_; }

 private:
  void draw(const nlohmann::json& rec, bool final);
  std::int64_t log_every_;
  int fd_;
  bool tty_;
  RunStart start_;
  double t0_ = 0;
  double items_ = 0;
  nlohmann::json last_;
  std::int64_t last_logged_ = -1;
  bool drawn_final_ = false;
};

/// Seconds on a steady clock.
double now_seconds();

}  // namespace wick
