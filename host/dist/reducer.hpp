#pragma once
// Gradient all-reduce for the last micro-batch of a window: parameters are
// grouped into buckets of about bucket_mb; when every gradient of a bucket
// has been accumulated during the backward, the bucket is flattened and its
// sum over ranks starts, overlapping the rest of the backward. finish()
// launches what is left (missing gradients count as zero), waits, and writes
// the sums back.

#include <ATen/core/Tensor.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace torch::autograd {
struct Node;
}
namespace c10d {
class Work;
}

namespace wick {

class Group;

class GradReducer {
 public:
  GradReducer(std::shared_ptr<Group> group, std::vector<at::Tensor> params, double bucket_mb);
  ~GradReducer();

  /// The next backward is the window's last: reduce as gradients become ready.
  void arm();
  /// After the last backward (or with no backward at all on this rank): every
  /// bucket reduced, every parameter's .grad the sum over ranks.
  void finish(std::int64_t step);
  std::size_t buckets() const { return buckets_.size(); }
  /// Buckets of the last window launched from gradient hooks, during the backward.
  std::size_t launched_during_backward() const { return launched_early_; }

 private:
  struct Bucket {
    std::vector<std::size_t> params;
    std::int64_t numel = 0;
    std::size_t pending = 0;
    at::Tensor flat;
    c10::intrusive_ptr<c10d::Work> work;
  };
  void ready(std::size_t param);
  void launch(Bucket& b);

  std::shared_ptr<Group> group_;
  std::vector<at::Tensor> params_;
  std::vector<std::size_t> bucket_of_;
  std::vector<Bucket> buckets_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keep the hooks' nodes alive
  std::mutex mu_;
  std::size_t next_ = 0;  // the next bucket to launch
  std::size_t launched_early_ = 0;
  std::atomic<bool> armed_{false};
  std::shared_ptr<std::atomic<bool>> alive_;
};

}  // namespace wick
