#pragma once
// The host's data loader: a seeded shuffle per epoch, the rank's shard, micro-
// batches grouped into windows of `accumulate`, built by worker threads into a
// bounded prefetch queue.

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "wick/data.hpp"

namespace wick {

struct LoaderConfig {
  std::int64_t micro_batch = 1;
  std::int64_t accumulate = 1;
  bool shuffle = true;
  std::uint64_t seed = 0;
  bool drop_last = false;  // drop an epoch's last window if it is short
  int workers = 0;         // 0: build batches on the calling thread
  int prefetch = 2;        // micro-batches built ahead, at most
  int rank = 0, world_size = 1;
  bool pin_memory = false;  // page-lock batches for fast, asynchronous copies to a GPU
};

/// The sample order of one epoch on one rank: deterministic in (seed, epoch).
std::vector<std::int64_t> epoch_order(std::int64_t size, const LoaderConfig& cfg, std::int64_t epoch);

class Loader {
 public:
  Loader(std::shared_ptr<const Dataset> data, LoaderConfig cfg);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  const LoaderConfig& config() const { return cfg_; }
  /// Optimizer steps (windows) one epoch takes on this rank.
  std::int64_t windows_per_epoch() const;
  /// Starts epoch `epoch` at window `first_window` (for resuming).
  void start_epoch(std::int64_t epoch, std::int64_t first_window = 0);
  /// The next window of micro-batches, or nothing at the epoch's end.
  std::optional<std::vector<Batch>> next_window();
  std::int64_t epoch() const { return epoch_; }
  std::int64_t window() const { return window_; }  // windows handed out this epoch
  /// Bytes the loader holds: the last window handed out and the micro-batches
  /// built ahead of it (at most `prefetch`).
  std::int64_t buffered_bytes();

 private:
  Batch build(std::int64_t micro) const;
  void stop_workers();
  Batch take(std::int64_t micro);

  std::shared_ptr<const Dataset> data_;
  LoaderConfig cfg_;
  std::vector<std::int64_t> order_;
  std::vector<std::vector<std::int64_t>> micro_;  // sample indices per micro-batch this epoch
  std::int64_t epoch_ = 0, window_ = 0, windows_ = 0;
  std::int64_t window_bytes_ = 0;

  // Worker pool state: micro-batches [next_take_, next_take_ + prefetch) may be built.
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
  std::map<std::int64_t, Batch> ready_;
  std::exception_ptr error_;
  std::int64_t next_claim_ = 0, next_take_ = 0, end_micro_ = 0;
  bool stop_ = false;
};

}  // namespace wick
