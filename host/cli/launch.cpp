// wick launch: one `wick run` process per local rank, with torchrun-style
// variables. Rank 0 keeps the terminal; the others' lines are prefixed. When a
// rank fails the others are stopped, and the launcher exits non-zero naming
// the rank and how it ended. SIGINT and SIGTERM are forwarded.

#include "cli/launch.hpp"

#include <boost/dll/runtime_symbol_info.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "wick/options.hpp"

namespace wick {
namespace {

volatile std::sig_atomic_t g_forward = 0;
void on_signal(int sig) { g_forward = sig; }

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    throw Error("cannot find a free TCP port on 127.0.0.1 for the rendezvous: " + std::string(std::strerror(errno)));
  }
  const int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return std::string("was killed by signal ") + (name ? std::string("SIG") + name : std::to_string(sig));
  }
  return "ended with status " + std::to_string(status);
}

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int out = -1, err = -1;  // pipes for ranks > 0
  std::string out_buf, err_buf;
  bool done = false;
  int status = 0;
};

void drain(Child& c, int& fd, std::string& buf, FILE* to, bool flush_all) {
  char tmp[4096];
  for (;;) {
    ssize_t n = fd >= 0 ? ::read(fd, tmp, sizeof tmp) : 0;
    if (n > 0) {
      buf.append(tmp, static_cast<std::size_t>(n));
      continue;
    }
    if (n == 0 && fd >= 0) {
      ::close(fd);
      fd = -1;
      flush_all = true;
    }
    break;
  }
  // Rank 0 may be drawing its progress line in place on this terminal: clear
  // that line first, so another rank's line never lands in the middle of it
  // (rank 0 redraws on its next step).
  const char* clear = ::isatty(::fileno(to)) ? "\r\033[K" : "";
  std::size_t pos;
  while ((pos = buf.find('\n')) != std::string::npos) {
    std::fprintf(to, "%s[rank %d] %s\n", clear, c.rank, buf.substr(0, pos).c_str());
    buf.erase(0, pos + 1);
  }
  if (flush_all && !buf.empty()) {
    std::fprintf(to, "%s[rank %d] %s\n", clear, c.rank, buf.c_str());
    buf.clear();
  }
  std::fflush(to);
}

// Signals a rank's process group: the rank and every process it started that
// stayed in the group, also after the rank itself has ended.
void signal_group(const Child& c, int sig) {
  if (c.pid > 0 && ::killpg(c.pid, sig) != 0 && errno == ESRCH && !c.done) ::kill(c.pid, sig);
}

// The child of a fork: rank `rank` (local `local_rank`) set up and exec'ed as
// `wick <verb> <run_args>`; its output into the pipes unless it is rank 0.
[[noreturn]] void exec_rank(const LaunchOptions& o, int rank, int local_rank, int port, const std::string& exe,
                            const std::string& news_dir, pid_t launcher, const int out_pipe[2], const int err_pipe[2]) {
  // the child: its own process group, so a terminal's Ctrl-C reaches it through us only,
  // and stopping the rank stops what it started (a recipe's os.execute) with it
  ::setpgid(0, 0);
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  // a launcher killed outright (kill -9, the OOM killer) takes its ranks
  // with it: none runs on alone writing the run folder or holding a device
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(1);  // it died before the line above
  if (rank != 0) {
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    ::close(out_pipe[0]), ::close(err_pipe[0]), ::close(out_pipe[1]), ::close(err_pipe[1]);
  }
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(o.nproc_per_node * o.nnodes).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(local_rank).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node).c_str(), 1);
  ::setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  if (!news_dir.empty()) ::setenv("WICK_LAUNCH_NEWS", news_dir.c_str(), 1);
  // share the cores: N ranks each with every core's worth of threads would fight
  if (!std::getenv("OMP_NUM_THREADS")) {
    const long cores = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
    ::setenv("OMP_NUM_THREADS", std::to_string(std::max(1L, cores / o.nproc_per_node)).c_str(), 1);
  }
  std::vector<std::string> argv_s{"wick", o.verb};
  argv_s.insert(argv_s.end(), o.run_args.begin(), o.run_args.end());
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  argv.push_back(nullptr);
  ::execv(exe.c_str(), argv.data());
  std::fprintf(stderr, "wick launch: cannot run %s: %s\n", exe.c_str(), std::strerror(errno));
  ::_exit(127);
}

// Starts one rank; the launcher's side of its pipes in c.out and c.err.
Child start_rank(const LaunchOptions& o, int local_rank, int port, const std::string& exe, const std::string& news_dir,
                 pid_t launcher) {
  Child c;
  c.rank = o.node_rank * o.nproc_per_node + local_rank;
  int out_pipe[2] = {-1, -1}, err_pipe[2] = {-1, -1};
  if (c.rank != 0 && (::pipe(out_pipe) != 0 || ::pipe(err_pipe) != 0))
    throw Error("wick launch: cannot create pipes: " + std::string(std::strerror(errno)));
  c.pid = ::fork();
  if (c.pid < 0) throw Error("wick launch: cannot start rank " + std::to_string(c.rank) + ": " + std::strerror(errno));
  if (c.pid == 0) exec_rank(o, c.rank, local_rank, port, exe, news_dir, launcher, out_pipe, err_pipe);
  ::setpgid(c.pid, c.pid);  // as the child does: whichever runs first, the group exists before any signal
  if (c.rank != 0) {
    ::close(out_pipe[1]), ::close(err_pipe[1]);
    c.out = out_pipe[0];
    c.err = err_pipe[0];
    ::fcntl(c.out, F_SETFL, O_NONBLOCK);
    ::fcntl(c.err, F_SETFL, O_NONBLOCK);
  }
  return c;
}

// The launcher's last line when a rank failed: the ranks that had already
// returned, which are the cause, named first.
void report_failure(int failed_rank, int failed_status, const std::vector<int>& ended_early) {
  std::string early;
  for (int r : ended_early) early += (early.empty() ? "" : ", ") + std::to_string(r);
  if (!early.empty()) {
    // the rank that left first is the cause; the one that then failed waited for it
    std::fprintf(stderr,
                 "wick launch: rank%s %s ended with code 0 while the others still ran (its recipe returned where "
                 "theirs went on: every rank must make the same wick.train calls); rank %d then %s and the other "
                 "ranks were stopped\n",
                 ended_early.size() > 1 ? "s" : "", early.c_str(), failed_rank, describe_status(failed_status).c_str());
    return;
  }
  std::fprintf(stderr, "wick launch: rank %d %s; the other ranks were stopped\n", failed_rank,
               describe_status(failed_status).c_str());
}

}  // namespace

int launch(const LaunchOptions& o) {
  const int nproc = o.nproc_per_node;
  const int port = o.master_port != 0 ? o.master_port : free_port();
  const std::string exe = boost::dll::program_location().string();

  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  const pid_t launcher = ::getpid();
  // Where the launcher tells the ranks that one of them has ended: a rank
  // that returns before wick.train would leave the others waiting for it at
  // the rendezvous for the whole WICK_DIST_TIMEOUT (dist/group.cpp reads it).
  std::string news_dir = (std::filesystem::temp_directory_path() / "wick-launch-XXXXXX").string();
  if (!::mkdtemp(news_dir.data())) news_dir.clear();
  struct RemoveNews {
    std::string dir;
    ~RemoveNews() {
      std::error_code ec;
      if (!dir.empty()) std::filesystem::remove_all(dir, ec);
    }
  } remove_news{news_dir};
  std::vector<Child> children;
  for (int r = 0; r < nproc; ++r) children.push_back(start_rank(o, r, port, exe, news_dir, launcher));

  int failed_rank = -1, failed_status = 0, forwarded = 0;
  std::vector<int> ended_early;  // ranks that ended cleanly while others still ran
  auto stop_at = std::chrono::steady_clock::time_point::max();
  std::size_t running = children.size();
  while (running > 0) {
    std::vector<pollfd> fds;
    for (auto& c : children) {
      if (c.out >= 0) fds.push_back({c.out, POLLIN, 0});
      if (c.err >= 0) fds.push_back({c.err, POLLIN, 0});
    }
    ::poll(fds.data(), fds.size(), 100);
    for (auto& c : children) {
      drain(c, c.out, c.out_buf, stdout, false);
      drain(c, c.err, c.err_buf, stderr, false);
    }
    if (g_forward && g_forward != forwarded) {
      forwarded = g_forward;
      for (auto& c : children) signal_group(c, forwarded);
    }
    // every rank that ended since the last look, those that ended cleanly
    // first: a rank that returned makes another fail within the same look
    // (its connections close), and the one that returned is the cause
    std::vector<Child*> ended;
    for (auto& c : children) {
      if (c.done) continue;
      int status = 0;
      if (::waitpid(c.pid, &status, WNOHANG) != c.pid) continue;
      c.done = true;
      c.status = status;
      --running;
      ended.push_back(&c);
    }
    const auto clean = [](const Child* c) { return WIFEXITED(c->status) && WEXITSTATUS(c->status) == 0; };
    std::stable_partition(ended.begin(), ended.end(), clean);
    const bool one_failed = !ended.empty() && !clean(ended.back());
    for (Child* cp : ended) {
      Child& c = *cp;
      const int status = c.status;
      drain(c, c.out, c.out_buf, stdout, true);
      drain(c, c.err, c.err_buf, stderr, true);
      const bool ok = clean(cp);
      if (ok && (running > 0 || one_failed) && failed_rank < 0) {
        ended_early.push_back(c.rank);
        if (!news_dir.empty()) {
          std::ofstream(std::filesystem::path(news_dir) / ("ended-" + std::to_string(c.rank))) << "0\n";
        }
      }
      if (!ok && failed_rank < 0) {
        failed_rank = c.rank;
        failed_status = status;
        // a rank whose recipe returned says so itself before its connections
        // close (announce_end): it may not be reaped yet, but it ended first
        for (const auto& o : children) {
          std::error_code ec;
          if (&o != &c && !news_dir.empty() &&
              std::find(ended_early.begin(), ended_early.end(), o.rank) == ended_early.end() &&
              std::filesystem::exists(std::filesystem::path(news_dir) / ("ended-" + std::to_string(o.rank)), ec))
            ended_early.push_back(o.rank);
        }
        // The others cannot finish without this rank: ask them (and all they
        // started) to stop, then insist.
        for (auto& o : children) signal_group(o, SIGTERM);
        stop_at = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      }
    }
    if (std::chrono::steady_clock::now() > stop_at) {
      for (auto& o : children)
        if (!o.done) {
          std::fprintf(stderr, "wick launch: rank %d did not stop within 10 s of SIGTERM (stalled?) and is killed\n",
                       o.rank);
          signal_group(o, SIGKILL);
        }
      stop_at = std::chrono::steady_clock::time_point::max();
    }
  }
  // Whatever a stopped rank started and left behind (a process that ignores
  // SIGTERM, or outlived its rank) goes with the run.
  if (failed_rank >= 0 || forwarded)
    for (auto& c : children) signal_group(c, SIGKILL);
  if (failed_rank >= 0) {
    report_failure(failed_rank, failed_status, ended_early);
    return 1;
  }
  return 0;
}

}  // namespace wick
