#pragma once
// Small helpers the vision plugins share (header-only, internal).

#include <wick/model.hpp>

#include <ATen/ATen.h>

#include <string>

namespace wick::vision {

inline at::ScalarType dtype_named(const std::string& name) {
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  return at::kFloat;
}

/// The batch's tensor `key`, or an error naming the plugin, the key and what
/// the batch holds.
inline const at::Tensor& batch_tensor(const wick::Batch& b, const std::string& key, const std::string& who,
                                      const std::string& what) {
  auto it = b.find(key);
  if (it == b.end()) {
    std::string keys;
    for (const auto& [k, v] : b) keys += (keys.empty() ? "" : ", ") + k;
    throw wick::Error(who + ": the batch has no '" + key + "' (" + what + "); it holds: " + keys);
  }
  return it->second;
}

/// Class labels [N] checked against the head's size (an out-of-range label,
/// such as the -1 of a manifest row without one, is an error naming the plugin).
inline at::Tensor checked_labels(const wick::Batch& b, std::int64_t classes, const std::string& who) {
  at::Tensor y = batch_tensor(b, "label", who, "class labels [N], int64").reshape({-1}).to(at::kLong);
  if (y.numel() > 0) {
    const auto lo = y.min().item<std::int64_t>(), hi = y.max().item<std::int64_t>();
    if (lo < 0 || hi >= classes)
      throw wick::Error(who + ": label " + std::to_string(lo < 0 ? lo : hi) + " is outside 0.." +
                        std::to_string(classes - 1) + " (classes = " + std::to_string(classes) +
                        "; a manifest row without a label gives -1)");
  }
  return y;
}

/// Summed cross-entropy of logits [N, classes] against labels [N], with the
/// count of right answers as the accuracy metric.
inline wick::ForwardResult classification(const at::Tensor& logits, const at::Tensor& labels) {
  at::Tensor l = logits.to(at::kFloat);
  wick::ForwardResult r;
  r.loss_sum = at::cross_entropy_loss(l, labels, {}, at::Reduction::Sum);
  r.items = labels.size(0);
  r.metrics["accuracy"] = l.argmax(-1).eq(labels).sum();
  return r;
}

}  // namespace wick::vision
