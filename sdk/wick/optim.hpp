#pragma once
/// \file optim.hpp
/// Optim plugins: optimizers, learning-rate schedules and model transforms
/// (LoRA, freezing), one kind, `optim`, told apart by their base class. A
/// complete optimizer plugin:
///
/// \code
///   #include <wick/optim.hpp>
///   #include <ATen/ATen.h>
///
///   // Plain gradient descent: p -= lr * grad.
///   class Descent : public wick::Optimizer {
///    public:
///     explicit Descent(const wick::Options& o) : lr_(o.get_number("lr")) {}
///     void attach(wick::NamedTensors params) override { params_ = std::move(params); }   // Required
///     void step(double lr) override {                                                     // Required
///       for (auto& [name, p] : params_)
///         if (p.grad().defined()) p.sub_(p.grad(), lr);
///     }
///     double base_lr() const override { return lr_; }                                    // Required
///     std::map<std::string, at::Tensor> state() const override { return {}; }            // Required
///     void load_state(const std::map<std::string, at::Tensor>&) override {}              // Required
///     std::int64_t state_bytes(const wick::NamedTensors&) const override { return 0; }   // Optional
///    private:
///     double lr_;
///     wick::NamedTensors params_;
///   };
///
///   WICK_PLUGIN(wick::plugin<Descent>("descent", "plain gradient descent",
///                                     {wick::opt_number("lr", 0.1, "learning rate").at_least(0)}))
/// \endcode
///
/// A schedule derives from wick::Schedule (factor(step, total_steps)); a
/// transform from wick::Transform (apply, and optionally save, load, merge).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "wick/object.hpp"
#include "wick/plugin.hpp"

namespace wick {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Sharded runs (wick.train's `shard`): a parameter split across ranks is
/// cut at multiples of this many elements of its flattened self, so state
/// kept per block of a size dividing it (8-bit optimizers' 256) lines up.
inline constexpr std::int64_t kShardAlign = 4096;

/// Updates parameters from their .grad(). The host calls attach() once, then
/// step(lr) once per optimizer step with the scheduled learning rate.
///
/// Parameter groups (a recipe's `groups = {{params = patterns, lr = ...}}`):
/// the host makes one object per group from the plugin, with the group's
/// options over the recipe's, and attaches that group's parameters; step(lr)
/// gets the group's own base rate times the schedule's factor. load_state
/// receives the entries of every group: take your parameters' own (state
/// keyed by parameter name, as the built-in optimizers keep it).
class Optimizer : public Object {
 public:
  static constexpr ObjectKind object_type = ObjectKind::Optimizer;
  ObjectKind object_kind() const final { return object_type; }

  /// Required: the trainable parameters, by name. Called once.
  virtual void attach(NamedTensors params) = 0;
  /// Optional: sharded runs (shard = "optimizer" or "gradients"; only for an
  /// optimizer that is also an ElementwiseUpdates, below) attach this rank's
  /// share instead. A parameter split across ranks arrives as a flat
  /// piece of it, under its own name: elements [k x kShardAlign, ...) of the
  /// flattened parameter, whose whole element count is `whole[i]`
  /// (params[i].numel() for one that is whole). step() then updates pieces
  /// elementwise as it would the whole; state() keeps, for a piece, entries
  /// that are elementwise (its numel), per block (ceil(numel / b), b dividing
  /// kShardAlign) or the same on every piece (a step count): the host joins
  /// them into one rank's state for checkpoints and cuts them again on resume.
  /// Default: attach(params). Override when a choice depends on the whole
  /// parameter (adamw8bit keeps fp32 moments below min_8bit_size elements).
  virtual void attach_shard(NamedTensors params, const std::vector<std::int64_t>& whole) {
    (void)whole;
    attach(std::move(params));
  }
  /// Required: one update with learning rate lr. A parameter without a
  /// gradient is left as it is.
  virtual void step(double lr) = 0;
  /// Required: the recipe's base learning rate (the schedule multiplies it).
  virtual double base_lr() const = 0;
  /// Required: the optimizer's state as named tensors, for checkpoints
  /// ("<param>.exp_avg", ...), and its inverse.
  virtual std::map<std::string, at::Tensor> state() const = 0;
  virtual void load_state(const std::map<std::string, at::Tensor>& state) = 0;
  /// Optional: the bytes of state step() will keep for `params` (for memory
  /// planning before the first step). Default: two fp32 tensors per parameter,
  /// as Adam keeps.
  virtual std::int64_t state_bytes(const NamedTensors& params) const {
    std::int64_t n = 0;
    for (const auto& [name, p] : params) n += 2 * 4 * p.numel();
    return n;
  }
};

/// Optional capability of an Optimizer (derive from it as well): step()
/// updates each element from that element's weight, gradient and state
/// alone (or per block of a size dividing kShardAlign, as 8-bit moments are
/// kept), so a sharded run (wick.train's `shard`) may hand it flat pieces of
/// parameters and get the bits whole parameters give. The host refuses
/// shard = "optimizer" or "gradients" for an optimizer without it: over a
/// piece, a per-tensor norm (LAMB's trust ratio), a factored second moment
/// (Adafactor) or an orthogonalised update (Muon) is not the whole's, and
/// the run would differ from one rank's without a word. sgd, adamw and
/// adamw8bit have it.
class ElementwiseUpdates {
 public:
  virtual ~ElementwiseUpdates() = default;
};

/// A learning-rate multiplier per optimizer step.
class Schedule : public Object {
 public:
  static constexpr ObjectKind object_type = ObjectKind::Schedule;
  ObjectKind object_kind() const final { return object_type; }
  /// Required: the factor for 0-based optimizer step `step` of `total_steps`.
  virtual double factor(std::int64_t step, std::int64_t total_steps) const = 0;
};

class Model;

/// Changes a model before training (LoRA adapters, freezing, quantization):
/// apply() once; save() and load() what it added, merge() folds it back.
class Transform : public Object {
 public:
  static constexpr ObjectKind object_type = ObjectKind::Transform;
  ObjectKind object_kind() const final { return object_type; }
  /// Required.
  virtual void apply(Model& model) = 0;
  /// Optional: write / read what the transform added, in a folder.
  virtual void save(Model& model, const std::string& dir) const {
    (void)model, (void)dir;
    throw Error("this transform has nothing to save");
  }
  virtual void load(Model& model, const std::string& dir) {
    (void)model, (void)dir;
    throw Error("this transform cannot load");
  }
  /// Optional: fold into the base weights and remove.
  virtual void merge(Model& model) {
    (void)model;
    throw Error("this transform cannot merge");
  }
};

}  // namespace wick
