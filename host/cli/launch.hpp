#pragma once
#include <string>
#include <vector>

namespace wick {

/// What `wick launch` starts; the CLI has checked each value.
struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                ///< 0: a free port on this machine (one node only)
  std::vector<std::string> run_args;  ///< RECIPE [key=value ...], given to each rank's `wick <verb>`
  std::string verb = "run";           ///< what each rank runs: run, or plan (wick plan --ranks N)
};

/// Starts the local ranks and waits for them; returns the exit code.
int launch(const LaunchOptions& options);

}  // namespace wick
