#include "distributed/group.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <filesystem>
#include <fstream>
#include <thread>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util/memory.hpp"
#include "util/system.hpp"
#include "wick/options.hpp"

extern char** environ;

namespace wick {
std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return (ranks.size() == 1 ? "rank " : "ranks ") + out;
}

namespace {

std::string seconds_text(std::chrono::milliseconds t) {
  const auto ms = t.count();
  if (ms % 1000 == 0) return std::to_string(ms / 1000) + " s";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g s", static_cast<double>(ms) / 1000);
  return buf;
}

void notice(const std::string& line) {
  std::fprintf(stderr, "%s%s\n", ::isatty(2) ? "\r\x1b[K" : "", line.c_str());
  std::fflush(stderr);
}

// Waiting for other ranks is said on stderr first after kFirstNotice (ranks
// that start together say nothing), then every kNoticeEvery.
constexpr auto kFirstNotice = std::chrono::seconds(1);
constexpr auto kNoticeEvery = std::chrono::seconds(30);

std::string waiting_text(std::chrono::seconds waited) {
  return waited < kNoticeEvery ? "waiting" : "still waiting";
}

std::string waited_text(std::chrono::seconds waited, std::chrono::milliseconds timeout) {
  return "(" + std::to_string(waited.count()) + " s so far; gives up after " + seconds_text(timeout) +
         ", WICK_DIST_TIMEOUT)";
}

// A rank's end, told to the ranks still waiting for it. Under `wick launch`
// the launcher writes ended-<rank> files in WICK_LAUNCH_NEWS for ranks that
// ended with exit code 0 while others still ran (host/cli/launch.cpp; it
// stops every rank when one fails). Without it (torchrun, SLURM) each rank
// says so itself in the store before its connections close: wick/end/<rank>
// is "0" (its recipe returned) or "1" (it stopped with an error), and the
// counter wick/ends says when to look.
struct Ended {
  int rank;
  bool clean;
};
const std::string kEndsKey = "wick/ends";
std::string end_key(int rank) { return "wick/end/" + std::to_string(rank); }

const char* launch_news() {
  const char* news = std::getenv("WICK_LAUNCH_NEWS");
  return news && *news ? news : nullptr;
}

std::vector<Ended> ended_ranks(c10d::Store* store, int world_size, int self) {
  std::vector<Ended> out;
  if (const char* news = launch_news()) {
    for (int r = 0; r < world_size; ++r) {
      std::error_code ec;
      if (r != self && std::filesystem::exists(std::filesystem::path(news) / ("ended-" + std::to_string(r)), ec))
        out.push_back({r, true});
    }
    return out;
  }
  if (!store) return out;
  try {
    if (store->add(kEndsKey, 0) == 0) return out;  // one round trip while nobody has ended
    for (int r = 0; r < world_size; ++r)
      if (r != self && store->check({end_key(r)})) {
        const auto v = store->get(end_key(r));
        out.push_back({r, !v.empty() && v[0] == '0'});
      }
  } catch (const std::exception&) {  // the store's host is gone: the caller's own wait says so
  }
  return out;
}

void say_end(c10d::Store& store, int rank, bool clean) {
  try {
    store.set(end_key(rank), std::string(clean ? "0" : "1"));
    store.add(kEndsKey, 1);
  } catch (const std::exception&) {  // nobody left to tell
  }
}

// How a rank that ended is named to one that waited for it.
std::string ended_text(const Ended& e, const char* had = "") {
  return "rank " + std::to_string(e.rank) + " " + had + (e.clean ? "ended (exit code 0)" : "stopped with an error (its "
                                                                                          "own output says why)");
}

// While a blocking call waits for other ranks, a thread says so on stderr.

class WaitNotice {
 public:
  explicit WaitNotice(std::function<std::string(std::chrono::seconds waited)> what,
                      std::chrono::seconds first = kFirstNotice)
      : thread_([this, what = std::move(what), first] {
          const auto start = std::chrono::steady_clock::now();
          auto next = start + first;
          std::unique_lock<std::mutex> lock(mu_);
          while (!cv_.wait_until(lock, next, [this] { return done_; })) {
            notice(what(std::chrono::duration_cast<std::chrono::seconds>(std::chrono::steady_clock::now() - start)));
            next += kNoticeEvery;
          }
        }) {}
  ~WaitNotice() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace

namespace {

std::string where_text(const DistEnv& env) {
  return env.master_addr + ":" + std::to_string(env.master_port) + " (" + env.source + ")";
}

// The ranks' store: rank 0 opens it (or torchrun's agent holds it), the
// others reach it, within `timeout`, saying so after `first_notice`.
c10::intrusive_ptr<c10d::Store> open_store(const DistEnv& env, std::chrono::milliseconds timeout,
                                           std::chrono::seconds first_notice) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(env.master_port);
  o.isServer = env.rank == 0 && !env.agent_store;
  o.numWorkers = env.world_size;
  o.waitWorkers = false;  // arrivals are checked by the caller, naming who is missing
  o.timeout = timeout;
  const std::string where = where_text(env);
  // a name that does not resolve would be retried until the timeout and end
  // as "Interrupted system call"
  {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(env.master_addr.c_str(), nullptr, &hints, &found);
    if (found) ::freeaddrinfo(found);
    if (rc != 0)
      throw Error("rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size) +
                  ": the rendezvous address '" + env.master_addr + "' (" + env.source + ") does not resolve: " +
                  ::gai_strerror(rc) + "; expected a host name or IP address of rank 0's machine");
  }
  // rank 0 opens the rendezvous at once; the others wait to reach it
  const std::string me = "wick: rank " + std::to_string(env.rank) + " of " + std::to_string(env.world_size);
  const bool opens = o.isServer;
  WaitNotice waiting(
      [&](std::chrono::seconds waited) {
        return me + ": " + waiting_text(waited) +
               (opens ? " to open the rendezvous at " : " for rank 0 to open the rendezvous at ") + where + " " +
               waited_text(waited, timeout);
      },
      first_notice);
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
  if (env.agent_store)  // the agent's store outlives attempts: this attempt's keys apart
    store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(env.restart_count), store);
  return store;
}

// Rank 0 hosts the store (unless torchrun's agent does): after its own end it
// keeps the store until every other rank has said its end, so that a rank
// still on its way to the rendezvous, or waiting at the store, reads why
// rank 0 will not come instead of waiting out WICK_DIST_TIMEOUT; and a rank
// that ends after rank 0 can still say so.
void host_until_every_end(c10d::Store& store, const DistEnv& env) {
  const auto timeout = dist_timeout();
  const auto start = std::chrono::steady_clock::now(), deadline = start + timeout;
  constexpr auto kFirst = std::chrono::seconds(10);  // ranks ending together say nothing
  auto next_notice = start + kFirst;
  std::vector<std::string> keys;
  for (int r = 1; r < env.world_size; ++r) keys.push_back(end_key(r));
  const std::string me = "wick: rank 0 of " + std::to_string(env.world_size);
  try {
    while (!store.check(keys)) {
      const auto now = std::chrono::steady_clock::now();
      if (now > deadline) {
        notice(me + ": the recipe ended; gave up waiting for the other ranks to end after " + seconds_text(timeout) +
               " (WICK_DIST_TIMEOUT); ranks still on their way to the rendezvous will not find it");
        return;
      }
      if (now >= next_notice) {
        std::vector<int> missing;
        for (int r = 1; r < env.world_size; ++r)
          if (!store.check({end_key(r)})) missing.push_back(r);
        const auto waited = std::chrono::duration_cast<std::chrono::seconds>(now - start);
        notice(me + ": the recipe ended; " + waiting_text(waited) + " for " + rank_list(missing) +
               " to end, as this rank hosts the ranks' store at " + where_text(env) + " " +
               waited_text(waited, timeout));
        next_notice += next_notice == start + kFirst ? kNoticeEvery - kFirst : kNoticeEvery;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception&) {  // the store failed under us: nothing more to tell
  }
}

std::mutex& world_mutex() {
  static std::mutex mu;
  return mu;
}

std::shared_ptr<Group>& world_slot() {
  static std::shared_ptr<Group> group;
  return group;
}

}  // namespace

Group::Group(const DistEnv& env, const std::string& backend) : env_(env), backend_(backend) {
  const auto timeout = dist_timeout();
  const std::string where = where_text(env);
  try {
    store_ = open_store(env, timeout, kFirstNotice);
  } catch (const c10::Error& e) {
    fail("reaching the rendezvous at " + where,
         std::string(e.what_without_backtrace()) +
             (env.agent_store ? "; torchrun's agent hosts it: is the agent still running, and is the address right?"
                              : "; rank 0 hosts it: did rank 0 start, and is the address right?"));
  }
  rendezvous(timeout, where);
  try {
    if (backend == "gloo") {
      pg_ = make_gloo(store_, env, timeout);
    } else if (backend == "nccl") {
      device_ = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(rank_cuda_device(env.local_rank, env.local_world_size, cuda_device_count())));
      pg_ = make_nccl(store_, env, timeout);
    } else {
      throw Error("unknown backend '" + backend + "' (expected gloo or nccl)");
    }
  } catch (const c10::Error& e) {
    say_end(*store_, env_.rank, false);
    fail("joining the " + backend + " group at " + where, e.what_without_backtrace());
  }
}

void Group::rendezvous(std::chrono::milliseconds timeout, const std::string& where) {
  std::vector<std::string> keys;
  for (int r = 0; r < env_.world_size; ++r) keys.push_back("wick/arrived/" + std::to_string(r));
  try {
    store_->set(keys[static_cast<std::size_t>(env_.rank)], std::string("1"));
    const auto start = std::chrono::steady_clock::now(), deadline = start + timeout;
    auto next_notice = start + kFirstNotice;
    auto missing = [&] {
      std::vector<int> out;
      for (int r = 0; r < env_.world_size; ++r)
        if (!store_->check({keys[static_cast<std::size_t>(r)]})) out.push_back(r);
      return rank_list(out);
    };
    const std::string me = "rank " + std::to_string(env_.rank) + " of " + std::to_string(env_.world_size);
    // a rank that has already ended will never arrive
    for (int turn = 0; !store_->check(keys); ++turn) {
      const auto now = std::chrono::steady_clock::now();
      for (const Ended& e : turn % 5 == 0 ? ended_ranks(store_.get(), env_.world_size, env_.rank) : std::vector<Ended>{})
        if (!store_->check({keys[static_cast<std::size_t>(e.rank)]})) {
          say_end(*store_, env_.rank, false);
          throw Error(me + ": " + ended_text(e) + " without reaching the rendezvous at " + where + ": its recipe " +
                      (e.clean ? "returned" : "failed") + " before this wick.train; every rank must make the same "
                      "wick.train calls");
        }
      if (now > deadline) {
        say_end(*store_, env_.rank, false);
        throw Error(me + ": the rendezvous at " + where + " timed out after " + seconds_text(timeout) + ": " +
                    missing() + " never arrived (WICK_DIST_TIMEOUT sets how long ranks wait)");
      }
      if (now >= next_notice) {  // say, at once and then now and then, who is awaited
        const auto waited = std::chrono::duration_cast<std::chrono::seconds>(now - start);
        notice("wick: " + me + ": " + waiting_text(waited) + " for " + missing() + " at " + where + " " +
               waited_text(waited, timeout));
        next_notice += next_notice == start + kFirstNotice ? kNoticeEvery - kFirstNotice : kNoticeEvery;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const c10::Error& e) {
    fail("the rendezvous at " + where, e.what_without_backtrace());
  }
}

void announce_end(int rc) {
  if (const char* news = launch_news()) {
    // what the launcher writes once it has reaped the rank, written before
    // the rank's sockets close: the others' failed collective comes after it
    if (rc == 0) std::ofstream(std::filesystem::path(news) / ("ended-" + std::to_string(dist_env().rank))) << "0\n";
    return;
  }
  DistEnv env;
  try {
    env = dist_env();
  } catch (const std::exception&) {
    return;
  }
  if (env.world_size < 2) return;
  std::shared_ptr<Group> group;
  {
    std::lock_guard<std::mutex> lock(world_mutex());
    group = world_slot();
  }
  if (group) {
    group->end(rc == 0);
    return;
  }
  // A rank that never joined (its recipe returned or failed before any
  // wick.train) tells the others if their store is there within 10 s (a rank
  // waiting at the rendezvous). Rank 0 opens no store for this: a process
  // that only looks like rank 0 of several (an sbatch script's own step under
  // --ntasks, RANK=0 set by hand) would wait at exit for ranks that never come.
  if (env.rank == 0 && !env.agent_store) return;
  try {
    const auto window = std::min<std::chrono::milliseconds>(std::chrono::seconds(10), dist_timeout());
    say_end(*open_store(env, window, std::chrono::seconds(60)), env.rank, rc == 0);
  } catch (const std::exception&) {  // nobody there: the others' own waits name this rank
  }
}

void Group::end(bool clean) {
  // said before the backend's connections close: a rank inside a collective
  // with this one then fails at once and finds the reason in the store
  say_end(*store_, env_.rank, clean);
  pg_.reset();
  if (clean && env_.rank == 0 && !env_.agent_store) host_until_every_end(*store_, env_);
}

Group::~Group() = default;

void Group::fail(const std::string& what, const std::string& why) const {
  if (backend_ == "nccl" && why.find("Duplicate GPU") != std::string::npos)
    throw Error("rank " + std::to_string(env_.rank) + " of " + std::to_string(env_.world_size) + ": " + what +
                " failed: ranks share one GPU, which NCCL refuses (" + why.substr(0, why.find('\n')) +
                "); give each rank its own GPU, or set WICK_DIST_BACKEND=gloo to run the ranks' collectives "
                "through host memory");
  // a peer that ended closes its connections at once, having said so (under
  // wick launch the launcher hears of its end within 0.1 s)
  // (the store's host may be gone without closing its sockets: a short wait)
  if (store_ && !launch_news()) try {
      store_->setTimeout(std::chrono::seconds(2));
    } catch (const std::exception&) {
    }
  std::vector<Ended> ended = ended_ranks(store_.get(), env_.world_size, env_.rank);
  for (int k = 0; ended.empty() && launch_news() && k < 25; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ended = ended_ranks(store_.get(), env_.world_size, env_.rank);
  }
  std::string cause = " -- another rank probably stopped, crashed or stalled";
  if (!ended.empty())
    cause = " -- " + ended_text(ended[0], "had ") + (ended[0].clean ? ": its recipe returned while this rank was still in "
                                                              "wick.train; every rank must make the same wick.train "
                                                              "calls"
                                                            : "");
  throw Error("rank " + std::to_string(env_.rank) + " of " + std::to_string(env_.world_size) + ": " + what +
              " failed (" + backend_ + ", timeout " + seconds_text(dist_timeout()) + "): " + why + cause);
}

std::string dist_backend(const std::string& device) {
  const bool cuda = at::Device(device).is_cuda();
  const char* v = std::getenv("WICK_DIST_BACKEND");
  const std::string given = v ? v : "";
  if (given.empty()) return cuda ? "nccl" : "gloo";
  if (given != "nccl" && given != "gloo")
    throw Error("WICK_DIST_BACKEND=" + given + ": expected nccl or gloo (unset: nccl for CUDA, gloo for the CPU)");
  if (given == "nccl" && !cuda)
    throw Error("WICK_DIST_BACKEND=nccl with device '" + device + "': NCCL moves CUDA tensors only; train on "
                "device = \"cuda\" (or \"auto\" on a machine with GPUs), or unset WICK_DIST_BACKEND");
  return given;
}

std::shared_ptr<Group> Group::world(const std::string& device) {
  std::lock_guard<std::mutex> lock(world_mutex());
  std::shared_ptr<Group>& group = world_slot();
  if (group) return group;
  const DistEnv env = dist_env();
  const std::string backend = dist_backend(device);
  // one process forms no group, unless a backend is named: then it joins a
  // group of one (NCCL's init and collectives on one GPU, as a check)
  const char* named = std::getenv("WICK_DIST_BACKEND");
  if (env.world_size == 1 && !(named && *named)) return nullptr;
  group = std::make_shared<Group>(env, backend);
  if (backend == "gloo" && at::Device(device).is_cuda() && env.rank == 0)
    notice("wick: the ranks' collectives run on gloo with CUDA tensors (WICK_DIST_BACKEND=gloo): each is copied "
           "to host memory and back, slower than NCCL; for ranks sharing one GPU, or a check");
  return group;
}

namespace {
// gloo with CUDA tensors: the collective runs on host copies, and the
// results go back to the device. A finished Work stands for it.
class DoneWork : public c10d::Work {
 public:
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
};

// gloo's reduce-scatter clones its whole input and all-reduces the clone: a
// whole bucket more than NCCL, which writes each rank's part in place, holds.
// wick's input is a buffer it drops once reduced, so on gloo it is summed in
// place by an all-reduce (the same sums, in the same order: gloo's own
// reduce-scatter is that all-reduce), and this rank's chunk is copied out at
// the wait.
class ChunkOfAllReduce : public c10d::Work {
 public:
  ChunkOfAllReduce(c10::intrusive_ptr<c10d::Work> all_reduce, at::Tensor out, at::Tensor chunk)
      : inner_(std::move(all_reduce)), out_(std::move(out)), chunk_(std::move(chunk)) {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  bool wait(std::chrono::milliseconds timeout) override {
    if (!copied_) {
      inner_->wait(timeout);
      out_.copy_(chunk_);
      copied_ = true;
    }
    return true;
  }
  const c10::intrusive_ptr<c10d::Work>& inner() const { return inner_; }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  at::Tensor out_, chunk_;
  bool copied_ = false;
};
}  // namespace

bool Group::staged(const at::Tensor& t) const { return backend_ == "gloo" && t.is_cuda(); }

void Group::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
  try {
    CollectiveAllocations uncapped;
    work->wait(dist_timeout());
  } catch (const c10::Error& e) {
    fail(what, e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(what, e.what());
  }
  if (backend_ != "gloo" || !await_release_) return;
  if (const auto* chunked = dynamic_cast<const ChunkOfAllReduce*>(work.get())) await_release(chunked->inner(), 1);
  await_release(work, 1);
}

void Group::await_release(const c10::intrusive_ptr<c10d::Work>& work, std::size_t ours) {
  // gloo's worker thread wakes the waiter before it lets go of the Work,
  // which holds the collective's tensors (a bucket, gloo's temporaries).
  // Freed whenever that thread next runs, they would overlap what this
  // thread allocates next by a scheduling accident: a loaded machine measured
  // a peak up to a bucket higher. Waiting for the release (microseconds)
  // makes the peaks the same from run to run, as a GPU's are. Memory is all
  // that rides on it: a Work still held after a second (a gloo that keeps
  // them) ends the waiting for the rest of the run. (NCCL's watchdog holds
  // its Works until its next poll: not waited for.)
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (await_release_ && work.use_count() > ours) {
    if (std::chrono::steady_clock::now() >= until) {
      if (await_release_.exchange(false))
        notice("wick: rank " + std::to_string(env_.rank) + ": gloo kept a finished collective's tensors for over a " +
               "second; no longer waiting for it to let go of them, so this rank's peaks may now move with the " +
               "machine's load");
      return;
    }
    std::this_thread::yield();
  }
}

void Group::count(const std::vector<at::Tensor>& tensors) {
  std::int64_t b = 0;
  for (const auto& t : tensors) b += t.numel() * t.element_size();
  // an all-reduce: a ring reduce-scatter and all-gather
  count(b, 2.0 * (env_.world_size - 1) / env_.world_size * static_cast<double>(b));
}

void Group::count(std::int64_t bytes, double wire) {
  ++collectives_;
  bytes_ += bytes;
  sent_ += static_cast<std::int64_t>(std::llround(wire));
}

c10::intrusive_ptr<c10d::Work> Group::start(const std::string& what,
                                            const std::function<c10::intrusive_ptr<c10d::Work>()>& op) {
  try {
    CollectiveAllocations uncapped;
    return op();
  } catch (const c10::Error& e) {
    fail(what, e.what_without_backtrace());
  }
}

void Group::all_reduce(std::vector<at::Tensor>& tensors, const std::string& what) {
  count(tensors);
  bool any = false;
  for (const auto& t : tensors) any = any || staged(t);
  if (!any) {
    wait(start(what, [&] { return pg_->allreduce(tensors); }), what);
    return;
  }
  std::vector<at::Tensor> host;
  for (const auto& t : tensors) host.push_back(t.cpu());
  wait(start(what, [&] { return pg_->allreduce(host); }), what);
  for (std::size_t i = 0; i < tensors.size(); ++i) tensors[i].copy_(host[i]);
}

c10::intrusive_ptr<c10d::Work> Group::all_reduce_async(at::Tensor& t) {
  std::vector<at::Tensor> v{t};
  if (staged(t)) {
    all_reduce(v, "a gradient all-reduce");
    return c10::make_intrusive<DoneWork>();
  }
  count(v);
  return start("a gradient all-reduce", [&] { return pg_->allreduce(v); });
}

c10::intrusive_ptr<c10d::Work> Group::reduce_scatter_async(at::Tensor& out, at::Tensor& in) {
  TORCH_CHECK(in.numel() == out.numel() * env_.world_size, "reduce_scatter: ", in.numel(), " elements in, ",
              out.numel(), " out on ", env_.world_size, " ranks");
  TORCH_CHECK(in.scalar_type() == out.scalar_type(), "reduce_scatter: ", in.scalar_type(), " in, ",
              out.scalar_type(), " out");
  // gloo sums `in` in place over its memory from data_ptr: a strided view
  // would be summed over the wrong elements
  TORCH_CHECK(in.is_contiguous() && out.is_contiguous(), "reduce_scatter: non-contiguous ",
              in.is_contiguous() ? "output" : "input");
  const std::int64_t b = in.numel() * in.element_size();
  count(b, static_cast<double>(env_.world_size - 1) / env_.world_size * static_cast<double>(b));
  if (staged(in) || staged(out)) {
    at::Tensor hin = in.cpu(), hout = at::empty(out.sizes(), out.options().device(at::kCPU));
    wait(start("a gradient reduce-scatter", [&] { return gloo_reduce_scatter(hout, hin); }),
         "a gradient reduce-scatter");
    out.copy_(hout);
    return c10::make_intrusive<DoneWork>();
  }
  return start("a gradient reduce-scatter", [&] {
    return backend_ == "gloo" ? gloo_reduce_scatter(out, in) : pg_->_reduce_scatter_base(out, in);
  });
}

c10::intrusive_ptr<c10d::Work> Group::gloo_reduce_scatter(at::Tensor& out, at::Tensor& in) {
  std::vector<at::Tensor> v{in};
  auto work = pg_->allreduce(v);
  // this rank's part of the flat elements (not of dim 0: `in` may be of any shape)
  return c10::make_intrusive<ChunkOfAllReduce>(std::move(work), out.view({-1}),
                                               in.view({-1}).narrow(0, env_.rank * out.numel(), out.numel()));
}

// gloo's all-gather gathers into a flat temporary of the whole size on its
// worker thread and copies it out: a gathered unit more than NCCL, which
// writes into the output, holds. On gloo the gather is an all-reduce of the
// output's bytes, zero but for this rank's part, by bitwise or: every bit as
// each rank sent it (a sum would turn -0.0 into +0.0), nothing beside the
// output, twice a ring all-gather's bytes on the wire (gloo: one host, tests).
c10::intrusive_ptr<c10d::Work> Group::gloo_all_gather(at::Tensor& out, at::Tensor& in) {
  if (!out.is_contiguous()) return pg_->_allgather_base(out, in);
  at::Tensor flat = out.view({-1});
  const std::int64_t lo = in.numel() * env_.rank, hi = lo + in.numel();
  // zero around this rank's part, which `in` may already be (gathered in place)
  flat.narrow(0, 0, lo).zero_();
  flat.narrow(0, hi, flat.numel() - hi).zero_();
  at::Tensor mine = flat.narrow(0, lo, in.numel());
  if (!(in.is_contiguous() && in.data_ptr() == mine.data_ptr())) mine.copy_(in.reshape({-1}));
  std::vector<at::Tensor> bytes{flat.view(at::kByte)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::BOR;
  return pg_->allreduce(bytes, opts);
}

void Group::all_gather(at::Tensor& out, at::Tensor& in, const std::string& what) {
  TORCH_CHECK(out.numel() == in.numel() * env_.world_size, "all_gather: ", in.numel(), " elements in, ",
              out.numel(), " out on ", env_.world_size, " ranks");
  TORCH_CHECK(in.scalar_type() == out.scalar_type(), "all_gather: ", in.scalar_type(), " in, ", out.scalar_type(),
              " out");
  const std::int64_t b = out.numel() * out.element_size();
  count(in.numel() * in.element_size(), static_cast<double>(env_.world_size - 1) / env_.world_size * static_cast<double>(b));
  if (staged(in) || staged(out)) {
    at::Tensor hin = in.cpu(), hout = at::empty(out.sizes(), out.options().device(at::kCPU));
    wait(start(what, [&] { return gloo_all_gather(hout, hin); }), what);
    out.copy_(hout);
    return;
  }
  wait(start(what, [&] { return backend_ == "gloo" ? gloo_all_gather(out, in) : pg_->_allgather_base(out, in); }),
       what);
}

std::vector<std::int64_t> Group::all_gather_ints(const std::vector<std::int64_t>& mine, const std::string& what) {
  at::Tensor in = at::tensor(mine, at::kLong).to(device_);
  at::Tensor out = at::empty({static_cast<std::int64_t>(mine.size()) * env_.world_size}, in.options());
  all_gather(out, in, what);
  const at::Tensor host = out.cpu();
  return {host.data_ptr<std::int64_t>(), host.data_ptr<std::int64_t>() + host.numel()};
}

void Group::send(at::Tensor& t, int dst, const std::string& what) {
  std::vector<at::Tensor> v{staged(t) ? t.cpu() : t};
  const std::int64_t b = t.numel() * t.element_size();
  count(b, static_cast<double>(b));
  wait(start(what, [&] { return pg_->send(v, dst, /*tag=*/0); }), what);
}

void Group::recv(at::Tensor& t, int src, const std::string& what) {
  std::vector<at::Tensor> v{staged(t) ? at::empty(t.sizes(), t.options().device(at::kCPU)) : t};
  ++collectives_;
  wait(start(what, [&] { return pg_->recv(v, src, /*tag=*/0); }), what);
  if (staged(t)) t.copy_(v[0]);
}

void Group::wait_keys(const std::vector<std::string>& keys, const std::string& what) {
  // a rank that has ended will never set its key: said at once rather than
  // after WICK_DIST_TIMEOUT
  const auto deadline = std::chrono::steady_clock::now() + dist_timeout();
  for (int turn = 0; !store_->check(keys); ++turn) {
    for (const Ended& e : turn % 5 == 0 ? ended_ranks(store_.get(), env_.world_size, env_.rank) : std::vector<Ended>{})
      if (!store_->check({keys[static_cast<std::size_t>(e.rank)]}))
        throw Error("rank " + std::to_string(env_.rank) + " of " + std::to_string(env_.world_size) + ": " +
                    ended_text(e) + " while this rank waited for it (" + what + "): its recipe " +
                    (e.clean ? "returned where this one went on to another wick.train; every rank must make the "
                               "same wick.train calls"
                             : "failed"));
    if (std::chrono::steady_clock::now() > deadline)
      fail(what, "waited " + seconds_text(dist_timeout()) + " for every rank's answer");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::vector<std::string> Group::gather_strings(const std::string& value, const std::string& what) {
  const std::string prefix = "wick/gather/" + std::to_string(gather_round_++) + "/";
  std::vector<std::string> out;
  try {
    store_->set(prefix + std::to_string(env_.rank), std::vector<std::uint8_t>(value.begin(), value.end()));
    if (env_.rank == 0) {
      std::vector<std::string> keys;
      for (int r = 0; r < env_.world_size; ++r) keys.push_back(prefix + std::to_string(r));
      wait_keys(keys, "gathering " + what);
      for (const auto& k : keys) {
        const auto v = store_->get(k);
        out.emplace_back(v.begin(), v.end());
      }
    }
  } catch (const c10::Error& e) {
    fail(what, e.what_without_backtrace());
  }
  return out;
}

std::int64_t Group::sum(std::int64_t v, const std::string& what) {
  std::vector<at::Tensor> t{at::full({1}, v, at::TensorOptions().dtype(at::kLong).device(device_))};
  all_reduce(t, what);
  return t[0].item<std::int64_t>();
}

std::pair<at::Tensor, std::int64_t> Group::all_gather_rows(const at::Tensor& t, std::int64_t width,
                                                           const std::string& what) {
  const auto cpu_long = at::TensorOptions().dtype(at::kLong).device(device_);
  std::vector<at::Tensor> rows{at::zeros({env_.world_size}, cpu_long)};
  const std::int64_t mine = t.defined() ? t.size(0) : 0;
  rows[0][env_.rank] = mine;
  all_reduce(rows, "the row counts of " + what);
  const at::Tensor counts = rows[0].cpu();
  std::int64_t offset = 0, total = 0;
  for (int r = 0; r < env_.world_size; ++r) {
    if (r == env_.rank) offset = total;
    total += counts[r].item<std::int64_t>();
  }
  // x + 0 == x: the sum of zero buffers, each holding one rank's rows, is
  // their concatenation exactly, whatever the ranks' row counts.
  std::vector<at::Tensor> buf{at::zeros({total, width}, at::TensorOptions().dtype(at::kFloat).device(device_))};
  if (mine) buf[0].narrow(0, offset, mine).copy_(t.reshape({mine, width}));
  all_reduce(buf, what);
  return {buf[0], offset};
}

void Group::broadcast(std::vector<at::Tensor>& tensors, const std::string& what) {
  for (auto& t : tensors) {
    if (backend_ == "nccl" && !t.is_cuda()) {
      // NCCL sends device memory: a tensor kept in host memory (an input
      // embedding under offload_embeddings) crosses through the device 64 MiB
      // at a time, so the device never holds it whole
      const at::Tensor flat = t.contiguous().view({-1});
      const std::int64_t step = std::max<std::int64_t>(1, (std::int64_t{64} << 20) / t.element_size());
      for (std::int64_t at = 0; at < flat.numel(); at += step) {
        at::Tensor part = flat.narrow(0, at, std::min(step, flat.numel() - at));
        // (rank 0's bytes; the others' are overwritten)
        std::vector<at::Tensor> one{env_.rank == 0 ? part.to(device_) : at::empty(part.sizes(), part.options().device(device_))};
        count(one[0].nbytes(), env_.rank == 0 ? static_cast<double>(one[0].nbytes()) : 0.0);
        wait(start(what, [&] { return pg_->broadcast(one); }), what);
        part.copy_(one[0]);
      }
      if (!t.is_contiguous()) t.copy_(flat.view(t.sizes()));
      continue;
    }
    std::vector<at::Tensor> one{staged(t) ? t.cpu() : t};
    const std::int64_t b = t.numel() * t.element_size();
    count(b, env_.rank == 0 ? static_cast<double>(b) : 0.0);
    wait(start(what, [&] { return pg_->broadcast(one); }), what);
    if (staged(t)) t.copy_(one[0]);
  }
}

void Group::barrier(const std::string& what) {
  ++collectives_;
  wait(start(what, [&] { return pg_->barrier(); }), what);
}

namespace {
// "a vs b" for two values, or, when they are lists of the same number of
// words, only the words that differ (each after the word before it): a
// fingerprint of forty options names the one that differs.
std::string differences(const std::string& a, const std::string& b) {
  auto words = [](const std::string& s) {
    std::vector<std::string> w;
    std::size_t i = 0;
    while (i < s.size()) {
      const auto j = s.find(' ', i);
      w.push_back(s.substr(i, j == std::string::npos ? std::string::npos : j - i));
      if (j == std::string::npos) break;
      i = j + 1;
    }
    return w;
  };
  auto wa = words(a), wb = words(b);
  for (auto* w : {&wa, &wb})
    for (auto& x : *w)
      if (x.size() > 1 && x.back() == ',') x.pop_back();
  if (wa.size() != wb.size()) return a + " vs " + b;
  std::string out;
  for (std::size_t k = 0; k < wa.size(); ++k)
    if (wa[k] != wb[k])
      out += (out.empty() ? "" : "; ") + (k > 0 ? wa[k - 1] + " " : std::string()) + wa[k] + " vs " + wb[k];
  return out;
}
}  // namespace

void Group::check_same(const std::string& what, const std::string& value) {
  const std::string prefix = "wick/check/" + std::to_string(check_round_++) + "/";
  try {
    store_->set(prefix + std::to_string(env_.rank), std::vector<std::uint8_t>(value.begin(), value.end()));
    std::vector<std::string> keys;
    for (int r = 0; r < env_.world_size; ++r) keys.push_back(prefix + std::to_string(r));
    wait_keys(keys, "comparing " + what);
    std::vector<std::vector<std::uint8_t>> values;
    for (const auto& k : keys) values.push_back(store_->get(k));
    // rank 0 holds the store: it goes on only once every rank has read what
    // it needs, or a rank whose recipe then returns at once (a refusal that
    // follows on every rank) would close the store under another's reads
    std::vector<std::string> read;
    for (int r = 0; r < env_.world_size; ++r) read.push_back(prefix + "read/" + std::to_string(r));
    store_->set(read[static_cast<std::size_t>(env_.rank)], std::string("1"));
    if (env_.rank == 0) wait_keys(read, "comparing " + what);
    const auto& first = values[0];
    for (int r = 1; r < env_.world_size; ++r) {
      const auto& other = values[static_cast<std::size_t>(r)];
      if (other != first)
        throw Error("rank " + std::to_string(r) + "'s " + what + " differs from rank 0's: " +
                    differences(std::string(other.begin(), other.end()), std::string(first.begin(), first.end())) +
                    " (every rank must run the same recipe with the same options)");
    }
  } catch (const c10::Error& e) {
    fail("comparing " + what, e.what_without_backtrace());
  }
}

}  // namespace wick
