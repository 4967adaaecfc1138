#include "dist/group.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <unistd.h>

#include "wick/options.hpp"

extern char** environ;

namespace wick {
namespace {

int to_int(const std::map<std::string, std::string>& env, const std::string& key, int def) {
  auto it = env.find(key);
  if (it == env.end() || it->second.empty()) return def;
  try {
    std::size_t used = 0;
    const int v = std::stoi(it->second, &used);
    if (used != it->second.size()) throw std::invalid_argument("trailing");
    return v;
  } catch (const std::exception&) {
    throw Error("environment variable " + key + "=" + it->second + " is not an integer");
  }
}

std::string get(const std::map<std::string, std::string>& env, const std::string& key, const std::string& def) {
  auto it = env.find(key);
  return it == env.end() || it->second.empty() ? def : it->second;
}

}  // namespace

std::string first_slurm_host(const std::string& list) {
  // host names separated by commas; a bracket holds ranges: a[01-03,7]
  std::string first;
  std::size_t i = 0;
  while (i < list.size() && list[i] != ',' && list[i] != '[') first.push_back(list[i++]);
  if (i < list.size() && list[i] == '[') {
    ++i;
    std::string range;
    while (i < list.size() && list[i] != ',' && list[i] != '-' && list[i] != ']') range.push_back(list[i++]);
    first += range;
  }
  return first;
}

DistEnv parse_dist_env(const std::map<std::string, std::string>& env) {
  DistEnv d;
  if (env.count("WORLD_SIZE") || env.count("RANK")) {
    d.source = "torchrun-style variables";
    d.world_size = to_int(env, "WORLD_SIZE", 1);
    d.rank = to_int(env, "RANK", 0);
    d.local_rank = to_int(env, "LOCAL_RANK", d.rank);
    d.local_world_size = to_int(env, "LOCAL_WORLD_SIZE", d.world_size);
    d.master_addr = get(env, "MASTER_ADDR", "127.0.0.1");
    d.master_port = to_int(env, "MASTER_PORT", 29500);
  } else if (env.count("SLURM_NTASKS") && env.count("SLURM_PROCID")) {
    d.source = "SLURM";
    d.world_size = to_int(env, "SLURM_NTASKS", 1);
    d.rank = to_int(env, "SLURM_PROCID", 0);
    d.local_rank = to_int(env, "SLURM_LOCALID", 0);
    // "4", "4(x2)" or "4(x2),2": tasks on this node (the first group's count)
    std::string per_node = get(env, "SLURM_NTASKS_PER_NODE", "");
    per_node = per_node.substr(0, per_node.find_first_of("(,"));
    d.local_world_size = to_int({{"SLURM_NTASKS_PER_NODE", per_node}}, "SLURM_NTASKS_PER_NODE", d.world_size);
    const std::string nodes = get(env, "SLURM_STEP_NODELIST", get(env, "SLURM_NODELIST", ""));
    d.master_addr = get(env, "MASTER_ADDR", nodes.empty() ? "127.0.0.1" : first_slurm_host(nodes));
    d.master_port = to_int(env, "MASTER_PORT", 29500);
  }
  if (d.world_size < 1) throw Error(d.source + ": world size " + std::to_string(d.world_size) + " must be >= 1");
  if (d.rank < 0 || d.rank >= d.world_size)
    throw Error(d.source + ": rank " + std::to_string(d.rank) + " is outside [0, " + std::to_string(d.world_size) + ")");
  if (d.local_rank < 0 || d.local_rank >= std::max(d.local_world_size, 1))
    throw Error(d.source + ": local rank " + std::to_string(d.local_rank) + " is outside [0, " +
                std::to_string(d.local_world_size) + ")");
  if (d.master_port <= 0 || d.master_port > 65535)
    throw Error(d.source + ": master port " + std::to_string(d.master_port) + " is not a TCP port");
  return d;
}

DistEnv dist_env() {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    const auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return parse_dist_env(env);
}

std::chrono::milliseconds dist_timeout() {
  const char* s = std::getenv("WICK_DIST_TIMEOUT");
  double seconds = s ? std::atof(s) : 300.0;
  if (seconds <= 0) seconds = 300.0;
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
}

Group::Group(const DistEnv& env, const std::string& backend) : env_(env), backend_(backend) {
  const auto timeout = dist_timeout();
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(env.master_port);
  o.isServer = env.rank == 0;
  o.numWorkers = env.world_size;
  o.waitWorkers = false;  // arrivals are checked below, naming who is missing
  o.timeout = timeout;
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port) + " (" + env.source + ")";
  try {
    store_ = c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
  } catch (const c10::Error& e) {
    fail("reaching the rendezvous at " + where,
         std::string(e.what_without_backtrace()) + "; rank 0 hosts it: did rank 0 start, and is the address right?");
  }
  rendezvous(timeout, where);
  try {
    if (backend == "gloo") {
      pg_ = make_gloo(store_, env, timeout);
    } else if (backend == "nccl") {
      device_ = at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
      pg_ = make_nccl(store_, env, timeout);
    } else {
      throw Error("unknown backend '" + backend + "' (expected gloo or nccl)");
    }
  } catch (const c10::Error& e) {
    fail("joining the " + backend + " group at " + where, e.what_without_backtrace());
  }
}

void Group::rendezvous(std::chrono::milliseconds timeout, const std::string& where) {
  std::vector<std::string> keys;
  for (int r = 0; r < env_.world_size; ++r) keys.push_back("wick/arrived/" + std::to_string(r));
  try {
    store_->set(keys[static_cast<std::size_t>(env_.rank)], std::string("1"));
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!store_->check(keys)) {
      if (std::chrono::steady_clock::now() > deadline) {
        std::string missing;
        for (int r = 0; r < env_.world_size; ++r)
          if (!store_->check({keys[static_cast<std::size_t>(r)]})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        throw Error("rank " + std::to_string(env_.rank) + " of " + std::to_string(env_.world_size) +
                    ": the rendezvous at " + where + " timed out after " + std::to_string(timeout.count() / 1000) +
                    " s: rank(s) " + missing + " never arrived");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const c10::Error& e) {
    fail("the rendezvous at " + where, e.what_without_backtrace());
  }
}

Group::~Group() = default;

void Group::fail(const std::string& what, const std::string& why) const {
  throw Error("rank " + std::to_string(env_.rank) + " of " + std::to_string(env_.world_size) + ": " + what +
              " failed (" + backend_ + ", timeout " + std::to_string(dist_timeout().count() / 1000) +
              " s): " + why + " -- another rank probably stopped, crashed or stalled");
}

std::shared_ptr<Group> Group::world(const std::string& device) {
  static std::mutex mu;
  static std::shared_ptr<Group> group;
  std::lock_guard<std::mutex> lock(mu);
  if (group) return group;
  const DistEnv env = dist_env();
  if (env.world_size == 1) return nullptr;
  group = std::make_shared<Group>(env, at::Device(device).is_cuda() ? "nccl" : "gloo");
  return group;
}

void Group::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
  try {
    work->wait(dist_timeout());
  } catch (const c10::Error& e) {
    fail(what, e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(what, e.what());
  }
}

void Group::count(const std::vector<at::Tensor>& tensors) {
  ++collectives_;
  for (const auto& t : tensors) bytes_ += t.numel() * t.element_size();
}

c10::intrusive_ptr<c10d::Work> Group::start(const std::string& what,
                                            const std::function<c10::intrusive_ptr<c10d::Work>()>& op) {
  try {
    return op();
  } catch (const c10::Error& e) {
    fail(what, e.what_without_backtrace());
  }
}

void Group::all_reduce(std::vector<at::Tensor>& tensors, const std::string& what) {
  count(tensors);
  wait(start(what, [&] { return pg_->allreduce(tensors); }), what);
}

c10::intrusive_ptr<c10d::Work> Group::all_reduce_async(at::Tensor& t) {
  std::vector<at::Tensor> v{t};
  count(v);
  return start("a gradient all-reduce", [&] { return pg_->allreduce(v); });
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
    std::vector<at::Tensor> one{t};
    count(one);
    wait(start(what, [&] { return pg_->broadcast(one); }), what);
  }
}

void Group::barrier(const std::string& what) {
  ++collectives_;
  wait(start(what, [&] { return pg_->barrier(); }), what);
}

void Group::check_same(const std::string& what, const std::string& value) {
  const std::string prefix = "wick/check/" + std::to_string(check_round_++) + "/";
  try {
    store_->set(prefix + std::to_string(env_.rank), std::vector<std::uint8_t>(value.begin(), value.end()));
    std::vector<std::string> keys;
    for (int r = 0; r < env_.world_size; ++r) keys.push_back(prefix + std::to_string(r));
    store_->wait(keys, dist_timeout());
    const auto first = store_->get(keys[0]);
    for (int r = 1; r < env_.world_size; ++r) {
      const auto other = store_->get(keys[r]);
      if (other != first)
        throw Error("rank " + std::to_string(r) + "'s " + what + " differs from rank 0's: " +
                    std::string(other.begin(), other.end()) + " vs " + std::string(first.begin(), first.end()) +
                    " (every rank must run the same recipe with the same options)");
    }
  } catch (const c10::Error& e) {
    fail("comparing " + what, e.what_without_backtrace());
  }
}

}  // namespace wick
