#include "train/loader.hpp"

#include "train/run_options.hpp"

#include <algorithm>
#include <random>

namespace wick {

std::vector<std::int64_t> epoch_order(std::int64_t size, const LoaderConfig& cfg, std::int64_t epoch) {
  std::vector<std::int64_t> order(size);
  for (std::int64_t i = 0; i < size; ++i) order[i] = i;
  if (cfg.shuffle) {
    // Fisher-Yates with a 64-bit Mersenne twister: the same order on every
    // platform and library version, whatever the rank count.
    std::mt19937_64 gen(cfg.seed * 0x9E3779B97F4A7C15ULL + static_cast<std::uint64_t>(epoch) + 1);
    for (std::int64_t i = size - 1; i > 0; --i) {
      std::uint64_t j = gen() % static_cast<std::uint64_t>(i + 1);
      std::swap(order[i], order[j]);
    }
  }
  if (cfg.world_size > 1) {
    std::vector<std::int64_t> shard;
    for (std::int64_t i = cfg.rank; i < size; i += cfg.world_size) shard.push_back(order[i]);
    return shard;
  }
  return order;
}

Loader::Loader(std::shared_ptr<const Dataset> data, LoaderConfig cfg) : data_(std::move(data)), cfg_(cfg) {
  check_loader_config(cfg_);  // wick.train's declarations, as wick.loader checks them
  if (cfg_.rank >= cfg_.world_size)
    throw Error("rank " + std::to_string(cfg_.rank) + " is outside the world of " + std::to_string(cfg_.world_size));
  if (data_->size() <= 0) throw Error("the data set is empty");
  start_epoch(0);
}

Loader::~Loader() { stop_workers(); }

std::int64_t Loader::windows_per_epoch() const {
  // Counted over all ranks: every rank takes the same number of steps, and
  // window k holds the same samples whatever the rank count (a rank whose
  // shard has run out gets an empty window and contributes zero).
  const std::int64_t n = data_->size();
  const std::int64_t global_window = cfg_.micro_batch * cfg_.accumulate * cfg_.world_size;
  return cfg_.drop_last ? n / global_window : (n + global_window - 1) / global_window;
}

void Loader::stop_workers() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
  ready_.clear();
  error_ = nullptr;
  stop_ = false;
}

void Loader::start_epoch(std::int64_t epoch, std::int64_t first_window) {
  stop_workers();
  epoch_ = epoch;
  data_->set_epoch(epoch, cfg_.seed);
  order_ = epoch_order(data_->size(), cfg_, epoch);
  micro_.clear();
  for (std::size_t i = 0; i < order_.size(); i += cfg_.micro_batch) {
    const auto end = std::min(order_.size(), i + static_cast<std::size_t>(cfg_.micro_batch));
    micro_.emplace_back(order_.begin() + i, order_.begin() + end);
  }
  windows_ = windows_per_epoch();
  window_ = std::min(first_window, windows_);
  next_claim_ = next_take_ = window_ * cfg_.accumulate;
  end_micro_ = std::min<std::int64_t>(static_cast<std::int64_t>(micro_.size()), windows_ * cfg_.accumulate);
  for (int w = 0; w < cfg_.workers; ++w) {
    threads_.emplace_back([this] {
      for (;;) {
        std::int64_t m;
        {
          std::unique_lock<std::mutex> lk(mu_);
          cv_.wait(lk, [&] { return stop_ || (next_claim_ < end_micro_ && next_claim_ < next_take_ + cfg_.prefetch); });
          if (stop_) return;
          m = next_claim_++;
        }
        Batch b;
        std::exception_ptr err;
        try {
          b = build(m);
        } catch (...) {
          err = std::current_exception();
        }
        {
          std::lock_guard<std::mutex> lk(mu_);
          if (err && !error_) error_ = err;
          ready_[m] = std::move(b);
        }
        cv_.notify_all();
      }
    });
  }
}

Batch Loader::build(std::int64_t micro) const {
  Batch b = data_->get_batch(micro_[micro]);
  if (cfg_.pin_memory)
    for (auto& [name, t] : b) t = t.pin_memory();
  return b;
}

Batch Loader::take(std::int64_t micro) {
  if (threads_.empty()) {
    ++next_take_;
    return build(micro);
  }
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return error_ || ready_.count(micro); });
  if (error_) std::rethrow_exception(error_);
  Batch b = std::move(ready_[micro]);
  ready_.erase(micro);
  ++next_take_;
  lk.unlock();
  cv_.notify_all();
  return b;
}

std::optional<std::vector<Batch>> Loader::next_window() {
  if (window_ >= windows_) return std::nullopt;
  std::vector<Batch> out;
  const std::int64_t first = window_ * cfg_.accumulate;
  const std::int64_t last = std::min(first + cfg_.accumulate, end_micro_);
  for (std::int64_t m = first; m < last; ++m) out.push_back(take(m));
  ++window_;
  std::int64_t bytes = 0;
  for (const auto& b : out)
    for (const auto& [k, t] : b) bytes += static_cast<std::int64_t>(t.nbytes());
  window_bytes_ = bytes;
  return out;
}

std::int64_t Loader::buffered_bytes() {
  std::int64_t bytes = window_bytes_;
  std::lock_guard<std::mutex> lk(mu_);
  for (const auto& [m, b] : ready_)
    for (const auto& [k, t] : b) bytes += static_cast<std::int64_t>(t.nbytes());
  return bytes;
}

}  // namespace wick
