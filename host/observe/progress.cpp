#include "observe/progress.hpp"

#include <sys/ioctl.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <vector>

#include "observe/format.hpp"

namespace wick {
namespace {

void write_all(int fd, const std::string& s) {
  std::size_t off = 0;
  while (off < s.size()) {
    const auto n = ::write(fd, s.data() + off, s.size() - off);
    if (n <= 0) return;
    off += static_cast<std::size_t>(n);
  }
}

int term_width(int fd) {
  winsize ws{};
  return ::ioctl(fd, TIOCGWINSZ, &ws) == 0 ? ws.ws_col : 0;
}

double num(const nlohmann::json& j, const char* k, double def = 0) {
  auto it = j.find(k);
  return it != j.end() && it->is_number() ? it->get<double>() : def;
}

}  // namespace

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

ProgressObserver::ProgressObserver(std::int64_t log_every, int fd)
    : log_every_(log_every), fd_(fd), tty_(::isatty(fd) == 1) {}

void ProgressObserver::on_start(const RunStart& start) {
  start_ = start;
  t0_ = now_seconds();
}

void ProgressObserver::on_step(const nlohmann::json& rec) {
  items_ += num(rec, "items");
  last_ = rec;
  draw(rec, false);
}

void ProgressObserver::draw(const nlohmann::json& rec, bool final) {
  const auto step = static_cast<std::int64_t>(num(rec, "step"));
  const double done = static_cast<double>(step - start_.start_step);
  const double elapsed = now_seconds() - t0_;
  const double rate = items_ / std::max(elapsed, 1e-9);
  const double eta = done > 0 ? static_cast<double>(start_.total_steps - step) * elapsed / done : 0;
  std::string mem;
  if (rec.contains("mem_allocated"))
    mem = "mem " + fmt_bytes(num(rec, "mem_allocated")) + " (peak " + fmt_bytes(num(rec, "mem_peak")) + ", reserved " +
          fmt_bytes(num(rec, "mem_reserved")) + ")";
  else
    mem = "mem " + fmt_bytes(num(rec, "mem_resident")) + " (peak " + fmt_bytes(num(rec, "mem_peak_resident")) +
          ", tensors " + fmt_bytes(num(rec, "mem_tensors")) + ")";
  const auto gn = rec.find("grad_norm");
  const double grad_norm = gn != rec.end() && gn->is_number() ? gn->get<double>() : NAN;
  std::vector<std::string> parts{
      strf("step %lld/%lld", static_cast<long long>(step), static_cast<long long>(start_.total_steps)),
      strf("%.1f %s/s", rate, start_.item_name.c_str()),
      final ? "took " + fmt_time(elapsed) : "ETA " + fmt_time(eta),
      strf("loss %.4f", num(rec, "loss", NAN)),
      strf("lr %.2e", num(rec, "lr")),
      mem,
      strf("gnorm %.3g", grad_norm)};
  if (rec.contains("loss_scale")) parts.push_back(strf("scale %g", num(rec, "loss_scale")));
  if (tty_) {
    const int width = term_width(fd_);
    std::string line = parts[0];
    for (std::size_t i = 1; i < parts.size(); ++i) {
      const std::string longer = line + " | " + parts[i];
      if (width > 0 && static_cast<int>(longer.size()) >= width) break;
      line = longer;
    }
    if (width > 0 && static_cast<int>(line.size()) >= width) line.resize(static_cast<std::size_t>(width - 1));
    write_all(fd_, "\r\x1b[K" + line + (final ? "\n" : ""));
  } else if ((final && step != last_logged_) || (!final && (step % log_every_ == 0 || step == 1))) {
    last_logged_ = step;
    std::string line;
    for (std::size_t i = 0; i < parts.size(); ++i) line += (i ? " | " : "") + parts[i];
    write_all(fd_, line + "\n");
  }
}

void ProgressObserver::finish_line() {
  if (drawn_final_ || last_.is_null()) return;
  drawn_final_ = true;
  draw(last_, true);
}

void ProgressObserver::note(const std::string& line) { write_all(fd_, (tty_ ? "\r\x1b[K" : "") + line + "\n"); }

void ProgressObserver::on_eval(const nlohmann::json& r) {
  std::string extra;
  if (r.contains("accuracy")) extra = strf(" | accuracy %.4f", num(r, "accuracy"));
  note(strf("eval @ step %lld | loss %.4f", static_cast<long long>(num(r, "step")), num(r, "loss", NAN)) + extra);
}

void ProgressObserver::on_end(const nlohmann::json& run) {
  finish_line();
  std::string ev;
  if (run.contains("eval") && run["eval"].is_object()) {
    const auto& e = run["eval"];
    ev = e.contains("accuracy") ? strf(", eval accuracy %.4f", num(e, "accuracy")) : strf(", eval loss %.4f", num(e, "loss"));
  }
  const auto fl = run.find("final_loss");
  const std::string final_loss = fl != run.end() && fl->is_number() ? strf("%.4f", fl->get<double>()) : "-";
  note(strf("wick: %s %lld steps in %s, final loss %s%s, peak memory %s", run.value("status", "").c_str(),
            static_cast<long long>(num(run, "steps")), fmt_time(num(run, "seconds")).c_str(), final_loss.c_str(),
            ev.c_str(), fmt_bytes(num(run, "peak_memory")).c_str()));
  const auto& m = run["memory"];
  const bool cuda = m.value("device", "").rfind("cuda", 0) == 0;
  const std::string who =
      num(m, "ranks", 1) > 1 ? strf("of rank %lld of %lld (shard = %s) ", static_cast<long long>(num(m, "rank")),
                                    static_cast<long long>(num(m, "ranks")), run.value("shard", "none").c_str())
                             : "";
  note("wick: memory " + who + "on " + m.value("device", "") + ": peak " + fmt_bytes(num(m, "peak")) + " held by tensors = weights " +
       fmt_bytes(num(m, "weights")) + " + gradients " + fmt_bytes(num(m, "gradients")) + " + optimizer " +
       fmt_bytes(num(m, "optimizer")) + " + " + (cuda ? "" : "data buffers " + fmt_bytes(num(m, "data")) + " + ") +
       "activations " + fmt_bytes(num(m, "activations")) + " + other " + fmt_bytes(num(m, "other")) +
       (cuda ? " (data buffers in host memory: " + fmt_bytes(num(m, "data")) + ")"
             : " (other: data sets and tensors held before the first step)") +
       (num(m, "offloaded") > 0 ? "; block inputs offloaded to host memory: " + fmt_bytes(num(m, "offloaded")) + " at most"
                                : "") +
       (num(m, "host_weights") > 0 ? "; input embeddings in host memory: " + fmt_bytes(num(m, "host_weights")) : "") +
       // the steps' peak is not the run's: the start moves (and divides) the
       // model, the end gathers it back
       (m.contains("run_peak") ? "; the whole run's peak " + fmt_bytes(num(m, "run_peak")) + " (start " +
                                     fmt_bytes(num(m, "start_peak")) + ", end " + fmt_bytes(num(m, "end_peak")) + ")"
                               : ""));
  if (run.contains("skipped_files"))
    note(strf("wick: %lld data files could not be decoded and were skipped (named above)",
              static_cast<long long>(num(run, "skipped_files"))));
  if (run.contains("skipped_items"))
    note(strf("wick: %lld data item%s had nothing to learn from and %s skipped (named above)",
              static_cast<long long>(num(run, "skipped_items")), num(run, "skipped_items") == 1 ? "" : "s",
              num(run, "skipped_items") == 1 ? "was" : "were"));
  if (num(run, "skipped_steps") > 0)
    note(strf("wick: %lld of %lld steps skipped for inf/nan gradients (fp16 loss scale now %g)",
              static_cast<long long>(num(run, "skipped_steps")), static_cast<long long>(num(run, "steps")),
              num(run, "loss_scale")));
}

}  // namespace wick
