#pragma once
/// \file data.hpp
/// Data plugins: a dataset of samples as named CPU tensors. The host owns
/// worker threads, prefetch, shuffling, sharding and the copy to the device.
/// A complete data plugin:
///
/// \code
///   #include <wick/data.hpp>
///   #include <ATen/ATen.h>
///
///   // n points on a line, y = 2x + 1: something for a model to fit.
///   class Line : public wick::Dataset {
///    public:
///     explicit Line(const wick::Options& o) : n_(o.get_int("size")) {}
///     std::int64_t size() const override { return n_; }                // Required
///     wick::Sample get(std::int64_t i) const override {                  // Required, thread-safe
///       const double x = static_cast<double>(i) / static_cast<double>(n_);
///       return {{"x", at::full({1}, x)}, {"y", at::full({1}, 2 * x + 1)}};
///     }
///    private:
///     std::int64_t n_;
///   };
///
///   WICK_PLUGIN(wick::plugin<Line>("line", "points on y = 2x + 1",
///                                  {wick::opt_int("size", 256, "number of points").at_least(1)}))
/// \endcode
///
/// Optional: get_batch (one gather for in-memory data), collate, set_epoch
/// (random augmentation by seed and epoch), encode/decode (text),
/// apply_chat_template (chat data), and
/// attributes() (facts a recipe reads, such as data.num_classes).

#include <ATen/core/Tensor.h>
#include <ATen/ops/stack.h>

#include <map>
#include <string>
#include <vector>

#include "wick/object.hpp"
#include "wick/plugin.hpp"

namespace wick {

using Sample = std::map<std::string, at::Tensor>;
using Batch = std::map<std::string, at::Tensor>;

class Dataset : public Object {
 public:
  static constexpr ObjectKind object_type = ObjectKind::Dataset;
  ObjectKind object_kind() const final { return object_type; }

  /// Required: number of samples.
  virtual std::int64_t size() const = 0;

  /// Required: sample i as CPU tensors. Called from several worker threads at
  /// once: must be thread-safe.
  virtual Sample get(std::int64_t i) const = 0;

  /// Optional: the batch of samples `indices` at once. Default: get() each
  /// and collate(). In-memory data sets override it with one gather per tensor.
  virtual Batch get_batch(const std::vector<std::int64_t>& indices) const {
    std::vector<Sample> samples;
    samples.reserve(indices.size());
    for (auto i : indices) samples.push_back(get(i));
    return collate(samples);
  }

  /// Optional, for text: token ids of a string and back, as transformers'
  /// tokenizer.encode(text, add_special_tokens=...) and
  /// decode(ids, skip_special_tokens=...) give them.
  virtual std::vector<std::int64_t> encode(const std::string& text, bool add_special_tokens) const {
    (void)text, (void)add_special_tokens;
    throw Error("this data set has no tokenizer");
  }
  virtual std::string decode(const std::vector<std::int64_t>& ids, bool skip_special_tokens) const {
    (void)ids, (void)skip_special_tokens;
    throw Error("this data set has no tokenizer");
  }
  std::vector<std::int64_t> encode(const std::string& text) const { return encode(text, true); }
  std::string decode(const std::vector<std::int64_t>& ids) const { return decode(ids, false); }

  /// Optional, for chat data: `messages_json` (a JSON list of {"role",
  /// "content", ...}) rendered through the data set's chat template with
  /// `options_json` (a JSON object: add_generation_prompt, tools, documents,
  /// and further template variables), as transformers'
  /// apply_chat_template(messages, tokenize=False, ...) renders it.
  virtual std::string apply_chat_template(const std::string& messages_json, const std::string& options_json) const {
    (void)messages_json, (void)options_json;
    throw Error("this data set has no chat template");
  }

  /// Optional: called by the loader before each epoch's samples are read, with
  /// the epoch and the run's seed. Data sets with random augmentation (crops,
  /// flips, frame sampling) draw sample i's randomness from (seed, epoch, i),
  /// so the same seed gives the same samples whatever the worker threads do.
  /// Const because the host holds data sets as const: keep the two numbers in
  /// mutable atomics.
  virtual void set_epoch(std::int64_t epoch, std::uint64_t seed) const {
    (void)epoch;
    (void)seed;
  }

  /// Optional: samples to a batch. Default stacks each named tensor.
  virtual Batch collate(const std::vector<Sample>& samples) const {
    Batch out;
    if (samples.empty()) return out;
    for (const auto& [name, first] : samples.front()) {
      std::vector<at::Tensor> parts;
      parts.reserve(samples.size());
      for (const auto& s : samples) parts.push_back(s.at(name));
      out[name] = at::stack(parts);
    }
    return out;
  }
};

}  // namespace wick
