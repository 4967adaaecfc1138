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
///
/// A 4-bit weight made from a float one goes through Linear::emit_nf4_from
/// (wick/kit/linear.hpp), not through nf4_quantize and emit: a host that
/// keeps a part of each tensor (a rank of a divided run) then reads and
/// quantizes only the values its parts come from (Emit::nf4).

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/TensorImpl.h>

#include <functional>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace wick {

struct Nf4Weight;  // wick/kit/nf4.hpp

/// What a deferred build hands its values to (the host's, through
/// Deferred::materialize): emit(tensor, value) gives one tensor its whole
/// value; nf4() says whether the host takes a 4-bit weight's values from the
/// float weight they are quantized from (Linear::emit_nf4_from uses it).
class Emit {
 public:
  /// sink(tensor, value): `tensor` the model's hollow tensor, `value` its
  /// whole value (its shape; the dtype the build makes it in), valid during
  /// the call only.
  using Sink = std::function<void(const at::Tensor& tensor, const at::Tensor& value)>;
  /// nf4(hollow, weight): the 4-bit tensors of `hollow` (a deferred layer's)
  /// are nf4_quantize(weight, hollow.block, hollow.scale_block)'s; `weight`
  /// (its shape, any float dtype) valid during the call only.
  using Nf4Sink = std::function<void(const Nf4Weight& hollow, const at::Tensor& weight)>;

  Emit(Sink sink, Nf4Sink nf4) : sink_(std::move(sink)), nf4_(std::move(nf4)) {}
  /// A plain sink: every value whole.
  template <class F, std::enable_if_t<std::is_invocable_v<F&, const at::Tensor&, const at::Tensor&> &&
                                          !std::is_same_v<std::decay_t<F>, Emit>,
                                      int> = 0>
  Emit(F sink) : sink_(std::move(sink)) {}  // NOLINT: a lambda is an Emit

  void operator()(const at::Tensor& tensor, const at::Tensor& value) const { sink_(tensor, value); }
  /// The host's 4-bit sink, or null (then the layer quantizes and emits each
  /// tensor whole).
  const Nf4Sink& nf4() const { return nf4_; }

 private:
  Sink sink_;
  Nf4Sink nf4_;
};

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
  using Emit = wick::Emit;
  using Step = std::function<void(const Emit&)>;

  /// A step that draws from the default CPU generator: run once now (its
  /// values dropped, through an Emit whose nf4() takes a 4-bit weight's
  /// float values and makes nothing of them), after recording the
  /// generator's state.
  void add_random(Step step) {
    auto gen = at::detail::getDefaultCPUGenerator();
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    // (the values dropped: a 4-bit weight is not even quantized, as nothing is drawn for that)
    step(Emit([](const at::Tensor&, const at::Tensor&) {}, [](const Nf4Weight&, const at::Tensor&) {}));
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
