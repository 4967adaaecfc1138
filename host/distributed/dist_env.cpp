// The ranks' environment: who this process is among the ranks (torchrun's,
// SLURM's or `wick launch`'s variables), which GPU it takes, and how long it
// waits for the others (WICK_DIST_TIMEOUT).
#include "distributed/group.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

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
    const std::string agent = get(env, "TORCHELASTIC_USE_AGENT_STORE", "");
    if (agent == "True" || agent == "true" || agent == "1") {
      d.agent_store = true;
      d.source = "torchrun's agent store";
      d.restart_count = to_int(env, "TORCHELASTIC_RESTART_COUNT", 0);
      if (d.restart_count < 0)
        throw Error("environment variable TORCHELASTIC_RESTART_COUNT=" + std::to_string(d.restart_count) +
                    " is below 0");
    }
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
    int port = 29500;
    if (get(env, "MASTER_PORT", "").empty() && env.count("SLURM_JOB_ID")) {
      const int job = to_int(env, "SLURM_JOB_ID", 0);
      if (job < 0) throw Error("environment variable SLURM_JOB_ID=" + std::to_string(job) + " is below 0");
      port = 15000 + job % 10000;
    }
    d.master_port = to_int(env, "MASTER_PORT", port);
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

int rank_cuda_device(int local_rank, int local_world_size, int visible) {
  if (visible < 1) return 0;
  // one device per task (srun --gpus-per-task=1) wraps; ranks outnumbering several devices would share one
  if (visible > 1 && local_world_size > visible)
    throw Error("LOCAL_WORLD_SIZE " + std::to_string(local_world_size) + " ranks on this node see " +
                std::to_string(visible) + " CUDA devices: ranks would share a device (NCCL refuses that); " +
                "start at most one rank per device, or show each rank one device (CUDA_VISIBLE_DEVICES, srun --gpus-per-task=1)");
  return local_rank % visible;
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
  if (!s || !*s) return std::chrono::seconds(kDefaultDistTimeout);
  const std::string text = s;
  // a plain decimal number of seconds: no "inf", "nan", hex or trailing text
  const bool plain = text.find_first_not_of("0123456789.eE+-") == std::string::npos;
  char* end = nullptr;
  errno = 0;
  const double seconds = plain ? std::strtod(s, &end) : 0.0;
  if (!plain || end != s + text.size() || errno == ERANGE || !(seconds > 0) || seconds > kMaxDistTimeout)
    throw Error("environment variable WICK_DIST_TIMEOUT=" + text + ": expected a number of seconds above 0 and at most " +
                std::to_string(kMaxDistTimeout) + " (7 days); unset, it is " + std::to_string(kDefaultDistTimeout));
  return std::chrono::milliseconds(std::max<std::int64_t>(1, std::llround(seconds * 1000)));
}

}  // namespace wick
