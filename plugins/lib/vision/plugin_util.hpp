#pragma once
// Small helpers the vision plugins share (header-only, internal).

#include <wick/kit/dtype_names.hpp>
#include <wick/model.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

namespace wick::vision {

inline at::ScalarType dtype_named(const std::string& name) { return wick::parse_enum(wick::kDtypeNames, name, "dtype"); }

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

/// The batch's frame_mask (video_folder with max_frames = 0: clips padded to
/// the longest of the batch, 1 = a real frame) checked against video [N, T,
/// ...]: a bool [N, T] on video's device, or undefined when the batch has no
/// mask or every frame is real. An error names the plugin and what is wrong:
/// another shape, a value other than 0 and 1, a clip without a frame.
inline at::Tensor frame_mask(const wick::Batch& b, const at::Tensor& video, const std::string& who) {
  auto it = b.find("frame_mask");
  if (it == b.end()) return {};
  const at::Tensor& m = it->second;
  if (m.dim() != 2 || m.size(0) != video.size(0) || m.size(1) != video.size(1))
    throw wick::Error(who + ": frame_mask must be [N, T] = [" + std::to_string(video.size(0)) + ", " +
                      std::to_string(video.size(1)) + "] like video's first two dimensions, got " + c10::str(m.sizes()));
  if (m.is_floating_point() || m.is_complex())
    throw wick::Error(who + ": frame_mask must hold integers or booleans (1 = a real frame), got " +
                      std::string(c10::toString(m.scalar_type())));
  const at::Tensor c = m.to(at::kCPU, at::kLong);
  if (c.numel() > 0 && (c.min().item<std::int64_t>() < 0 || c.max().item<std::int64_t>() > 1))
    throw wick::Error(who + ": frame_mask holds values other than 0 and 1 (1 = a real frame, 0 = padding)");
  const at::Tensor per_clip = c.sum(1);
  for (std::int64_t r = 0; r < per_clip.size(0); ++r)
    if (per_clip[r].item<std::int64_t>() == 0)
      throw wick::Error(who + ": clip " + std::to_string(r) + " of the batch has no frame (its frame_mask row is all 0)");
  if (per_clip.min().item<std::int64_t>() == video.size(1)) return {};
  return c.to(at::kBool).to(video.device());
}

/// Class labels [N] checked against the head's size (an out-of-range label,
/// such as the -1 of a manifest row without one, is an error naming the plugin).
/// Frames [F, ...] through `encode`, `chunk` at a time (0: all at once), the
/// outputs concatenated along the first dimension. A frozen encoder runs
/// without gradients, so a chunk's activations are gone once its output is
/// out. A trained one over several chunks runs each chunk as block `block` of
/// `owner`: checkpointed, a chunk keeps only its input (a view of `frames`)
/// and runs again, alone, in backward (the encoder's own blocks checkpointed
/// inside it). `encode` must hold what it uses by value: it may run again
/// after the forward has returned.
inline at::Tensor encode_frames(wick::Model& owner, const std::string& block, const at::Tensor& frames,
                                std::int64_t chunk, bool trains,
                                const std::function<at::Tensor(const at::Tensor&)>& encode) {
  const std::int64_t total = frames.size(0);
  if (chunk <= 0) chunk = total;
  std::vector<at::Tensor> parts;
  for (std::int64_t s = 0; s < total; s += chunk) {
    const at::Tensor r = frames.narrow(0, s, std::min(chunk, total - s));
    if (!trains) {
      at::NoGradGuard no_grad;
      parts.push_back(encode(r));
    } else {
      parts.push_back(chunk < total ? owner.run_block(block, encode, r) : encode(r));
    }
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
}

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
