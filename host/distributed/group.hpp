#pragma once
// Ranks and their process group: one process per GPU (or CPU worker), meeting
// through torchrun-style variables or SLURM's, talking through LibTorch's c10d
// (gloo for CPU tensors, NCCL for CUDA tensors).

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace c10d {
class Backend;
class Store;
class Work;
}  // namespace c10d

namespace wick {

/// Where this process stands among the ranks.
struct DistEnv {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "single process";  // "torchrun-style variables", "torchrun's agent store", "SLURM"
  /// torchrun's agent hosts the store on MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True):
  /// every rank, rank 0 too, connects to it as a client, under the key prefix
  /// of the agent's restart attempt (TORCHELASTIC_RESTART_COUNT), as torch's own workers do.
  bool agent_store = false;
  int restart_count = 0;
};

/// The CUDA device of a rank: LOCAL_RANK modulo the devices it sees, so one
/// device per task (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES set per rank)
/// is device 0 whatever the local rank. visible < 1 gives 0. More ranks on
/// the node than several visible devices (they would share one) is an error.
int rank_cuda_device(int local_rank, int local_world_size, int visible);

/// Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
/// MASTER_PORT, or else SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
/// SLURM_NTASKS_PER_NODE, SLURM_(STEP_)NODELIST. Throws on inconsistent values.
/// Under SLURM without MASTER_PORT the port is 15000 + SLURM_JOB_ID % 10000
/// (Lightning's rule), so jobs sharing a node do not collide on 29500.
DistEnv parse_dist_env(const std::map<std::string, std::string>& env);
DistEnv dist_env();  // of this process

/// Says how this rank's recipe ended (rc 0: it returned), before its
/// connections close at exit, so a rank still waiting for it (at a collective,
/// the store or the rendezvous) names it at once rather than waiting out
/// WICK_DIST_TIMEOUT. Under `wick launch` a clean end is a file the launcher
/// reads; under torchrun or SLURM it is a key in the ranks' store, and rank 0,
/// which hosts the store, keeps it open until every rank has said its end
/// (opening it for this if the recipe made no wick.train).
void announce_end(int rc);

/// The first host of a SLURM node list: "gpu[03-05,07],cpu1" -> "gpu03".
std::string first_slurm_host(const std::string& nodelist);

/// How long a collective may wait for the other ranks (WICK_DIST_TIMEOUT
/// seconds, default 300) before it fails instead of hanging. A value that is
/// not a number of seconds in (0, 604800] is an error naming the variable.
constexpr int kDefaultDistTimeout = 300, kMaxDistTimeout = 7 * 24 * 3600;
std::chrono::milliseconds dist_timeout();

/// The backend for `device`: WICK_DIST_BACKEND (nccl or gloo, checked), else
/// nccl for CUDA and gloo for the CPU.
std::string dist_backend(const std::string& device);

/// "rank 3", "ranks 1-3, 7": for messages naming ranks.
std::string rank_list(const std::vector<int>& ranks);

class Group {
 public:
  /// Joins the ranks of `env` with backend "gloo" or "nccl".
  Group(const DistEnv& env, const std::string& backend);
  ~Group();

  /// The process-wide group, made on first use; nullptr for a single process
  /// (unless WICK_DIST_BACKEND names a backend: then a group of one).
  /// The backend: WICK_DIST_BACKEND, else NCCL for CUDA and gloo for the CPU
  /// (dist_backend). gloo with CUDA tensors (ranks sharing one GPU) runs each
  /// collective on host copies.
  static std::shared_ptr<Group> world(const std::string& device);

  int rank() const { return env_.rank; }
  int size() const { return env_.world_size; }
  const std::string& backend() const { return backend_; }
  const at::Device& device() const { return device_; }

  /// This rank's end (announce_end): said in the store, the backend closed,
  /// and on the store's host after a clean end, the others' ends awaited.
  void end(bool clean);

  /// Sums in place on every rank (blocking).
  void all_reduce(std::vector<at::Tensor>& tensors, const std::string& what);
  /// Starts a sum in place; wait() on the result.
  c10::intrusive_ptr<c10d::Work> all_reduce_async(at::Tensor& t);
  /// Starts a reduce-scatter: `in` ([size() * n]) summed over the ranks, this
  /// rank's n elements (chunk rank()) written to `out`; wait() on the result.
  /// `in` is the caller's to drop afterwards: on gloo it holds the whole sums.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_async(at::Tensor& out, at::Tensor& in);
  /// Every rank's `in` (n elements) concatenated in rank order into `out`
  /// ([size() * n]), on every rank (blocking).
  void all_gather(at::Tensor& out, at::Tensor& in, const std::string& what);
  /// Every rank's `mine` (the same count on each), read on the host: rank r's
  /// values at [r * mine.size(), (r + 1) * mine.size()).
  std::vector<std::int64_t> all_gather_ints(const std::vector<std::int64_t>& mine, const std::string& what);
  /// Point to point (blocking): `t` to rank `dst`; rank `src`'s into `t`.
  void send(at::Tensor& t, int dst, const std::string& what);
  void recv(at::Tensor& t, int src, const std::string& what);
  /// Every rank's `value` on rank 0, in rank order (through the store; small
  /// strings: names and shapes). Other ranks get an empty list.
  std::vector<std::string> gather_strings(const std::string& value, const std::string& what);
  /// Waits for `work`, naming `what` in a failure.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what);
  std::int64_t sum(std::int64_t v, const std::string& what);
  /// Every rank's rows of `t` ([rows, width], rows may differ and be 0),
  /// concatenated in rank order, on every rank; also the row offset of this
  /// rank's rows. Floating tensors only (returned in float32). Two small
  /// all-reduces: the row counts, then the rows placed in a zero buffer.
  std::pair<at::Tensor, std::int64_t> all_gather_rows(const at::Tensor& t, std::int64_t width, const std::string& what);
  /// Copies rank 0's tensors to every rank, in place.
  void broadcast(std::vector<at::Tensor>& tensors, const std::string& what);
  void barrier(const std::string& what);
  /// Every rank must pass the same `value` for `what` (a recipe fingerprint):
  /// a difference is an error naming the ranks and both values.
  void check_same(const std::string& what, const std::string& value);

  /// Collectives started and bytes given to them by this rank so far.
  std::int64_t collectives() const { return collectives_; }
  std::int64_t bytes() const { return bytes_; }
  /// Bytes this rank sends over the wire so far, as NCCL's ring algorithms
  /// send them: an all-reduce of S bytes 2(N-1)/N S, a reduce-scatter
  /// of S bytes in and an all-gather of S bytes out (N-1)/N S each (so the
  /// two together send what one all-reduce sends), a broadcast or a send S.
  /// (On gloo wick makes its reduce-scatters and all-gathers of all-reduces,
  /// which send twice their figure: counted as NCCL would send them.)
  std::int64_t sent() const { return sent_; }

 private:
  void rendezvous(std::chrono::milliseconds timeout, const std::string& where);
  /// gloo given a CUDA tensor: the collective runs on a host copy.
  bool staged(const at::Tensor& t) const;
  /// Runs `op` (which starts a collective), turning LibTorch's errors into wick's.
  c10::intrusive_ptr<c10d::Work> start(const std::string& what,
                                       const std::function<c10::intrusive_ptr<c10d::Work>()>& op);
  void count(const std::vector<at::Tensor>& tensors);
  /// `bytes` given in, `wire` sent as ring algorithms send
  void count(std::int64_t bytes, double wire);
  [[noreturn]] void fail(const std::string& what, const std::string& why) const;
  /// The store's wait for `keys` (one per rank), within WICK_DIST_TIMEOUT;
  /// under wick launch a rank that ended without its key ends it at once.
  void wait_keys(const std::vector<std::string>& keys, const std::string& what);
  /// gloo: `in` summed in place by an all-reduce, the chunk copied at the wait.
  c10::intrusive_ptr<c10d::Work> gloo_reduce_scatter(at::Tensor& out, at::Tensor& in);
  /// gloo: `out` zeroed but for this rank's part, its bytes or-ed over the ranks.
  c10::intrusive_ptr<c10d::Work> gloo_all_gather(at::Tensor& out, at::Tensor& in);
  /// gloo: until its worker thread lets go of `work` (held `ours` times here).
  void await_release(const c10::intrusive_ptr<c10d::Work>& work, std::size_t ours);
  DistEnv env_;
  std::string backend_;
  std::atomic<bool> await_release_{true};  // see wait()
  at::Device device_{at::kCPU};
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::Backend> pg_;
  int check_round_ = 0, gather_round_ = 0;
  std::atomic<std::int64_t> collectives_{0}, bytes_{0}, sent_{0};
};

/// Backend factories (gloo.cpp, nccl.cpp).
c10::intrusive_ptr<c10d::Backend> make_gloo(const c10::intrusive_ptr<c10d::Store>& store, const DistEnv& env,
                                            std::chrono::milliseconds timeout);
c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>& store, const DistEnv& env,
                                            std::chrono::milliseconds timeout);

}  // namespace wick
