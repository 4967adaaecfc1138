#pragma once
/// \file deferral.hpp
/// Deferred construction: a model built without its weights' bytes, whose
/// values are made later, one tensor at a time, where the host wants them
/// (ZeRO-3: each rank keeps only its chunks, so no rank holds the whole
/// model; DeepSpeed's zero.Init, FSDP's meta-device build).
///
/// A deferred model's tensors are *hollow*: a CPU tensor of its shape and
/// dtype whose storage holds no bytes (what a ZeRO-3 parameter is between
/// gathers). Reading one fails; the host gives each its storage.
///
/// A plugin records, as it builds, a step for each value it would have made:
/// \code
///   wick::Deferral d;
///   weight = register_parameter("weight", wick::hollow({out, in}, at::kFloat));
///   d.add_random([w = weight](const wick::Deferral::Emit& emit) {   // draws from the generator
///     emit(w, at::empty(w.sizes(), at::kFloat).normal_(0, 0.02));
///   });
///   ...
///   d.run(sink);  // the steps again, in order, each value handed to sink once
/// \endcode
/// A random step runs once as it is recorded, its values dropped, so the
/// random generator moves on exactly as a whole build moves it (what is drawn
/// after the build, a LoRA adapter, a data order, is the same); run() replays
/// it from the generator state recorded before it, so every value has the
/// bits a whole build gives it, and restores the generator after.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/TensorImpl.h>

#include <functional>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace wick {

/// A tensor of `sizes` and `options` whose storage holds no bytes.
inline at::Tensor hollow(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

/// Whether `t` has elements but no bytes (deferred, or a ZeRO-3 weight
/// between gathers).
inline bool is_hollow(const at::Tensor& t) {
  return t.defined() && !t.is_meta() && t.numel() > 0 && t.has_storage() && !t.storage().data();
}

/// The steps of a deferred build, in the order the build made their values.
class Deferral {
 public:
  /// emit(tensor, value): `tensor` is the model's hollow tensor, `value` its
  /// whole value (its shape; the dtype the build makes it in), valid during
  /// the call only.
  using Emit = std::function<void(const at::Tensor& tensor, const at::Tensor& value)>;
  using Step = std::function<void(const Emit&)>;

  /// A step that draws from the default CPU generator: run once now (its
  /// values dropped), after recording the generator's state.
  void add_random(Step step) {
    auto gen = at::detail::getDefaultCPUGenerator();
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    step([](const at::Tensor&, const at::Tensor&) {});
    steps_.push_back({std::move(step), std::move(state)});
  }
  /// A step that draws nothing (ones, zeros, a file's tensor).
  void add(Step step) { steps_.push_back({std::move(step), at::Tensor()}); }

  bool empty() const { return steps_.empty(); }

  /// Every step again, in order, each random one from its recorded state;
  /// the generator is left as it was found.
  void run(const Emit& emit) const {
    auto gen = at::detail::getDefaultCPUGenerator();
    at::Tensor saved;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      saved = gen.get_state();
    }
    struct Restore {
      at::Generator gen;
      at::Tensor state;
      ~Restore() {
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(state);
      }
    } restore{gen, saved};
    for (const auto& s : steps_) {
      if (s.state.defined()) {
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(s.state);
      }
      s.step(emit);
    }
  }

  /// Drops the steps (and what they hold: a mapped folder's tensors).
  void clear() { steps_.clear(); }

 private:
  struct Recorded {
    Step step;
    at::Tensor state;  // the generator's state before a random step
  };
  std::vector<Recorded> steps_;
};

}  // namespace wick
