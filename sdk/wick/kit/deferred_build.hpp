#pragma once
/// \file deferred_build.hpp
/// Building a model deferred part by part (wick/kit/deferral.hpp), for
/// models whose parts are modules made by ordinary code (torch::nn layers
/// that draw their own initial values in their constructors):
///
/// \code
///   // a whole build: the block made now; deferred: a hollow block and a
///   // step that makes it again when the host wants its values
///   block = register_module("block", wick::deferred_part(deferral, [c] { return Block(c); }));
///   ...
///   // a folder's values for a hollow model: a step reading each tensor
///   wick::defer_load_state(*this, std::move(tensors), dir, ignore, deferral);
/// \endcode
///
/// A deferred part is made once as the build goes (so the random generator
/// moves on exactly as a whole build moves it, and what is drawn after it is
/// the same), its tensors then emptied; the step recorded for it makes the
/// part again from the generator state before it and hands each of its
/// tensors' values to the part's tensor of the same name. No part exists
/// whole beyond the one being made.
///
/// A step gives each value to the tensor it captured when it was recorded,
/// never to a layer's current one: a layer quantized after the build
/// (Linear::quantize_nf4 of a hollow layer, qlora over a deferred model)
/// replaces its weight, and the host routes the value for the former tensor
/// to the layer's 4-bit tensors. deferred_part and defer_load_state do so.

#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>

#include "wick/kit/deferral.hpp"
#include "wick/kit/weights.hpp"
#include "wick/options.hpp"

namespace wick {

/// Leaves the default CPU generator, when it goes, as it was when it was
/// made: a build for a folder's values (which draws nothing a whole random
/// build would keep) around torch layers that draw in their constructors.
class GeneratorKept {
 public:
  GeneratorKept() : gen_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    state_ = gen_.get_state();
  }
  ~GeneratorKept() {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(state_);
  }
  GeneratorKept(const GeneratorKept&) = delete;
  GeneratorKept& operator=(const GeneratorKept&) = delete;

 private:
  at::Generator gen_;
  at::Tensor state_;
};

/// Empties every tensor of `m` (parameters and buffers) that has elements:
/// each keeps its shape and dtype and holds no bytes (is_hollow).
inline void hollow_out(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  for (auto& [name, t] : module_state(m))
    if (t.numel() > 0 && !is_hollow(t)) t.set_data(hollow(t.sizes(), t.options()));
}

/// Hands each tensor of `made` to `emit` as the value of the tensor of the
/// same name in `into` (a module's state as it was recorded: the tensors
/// themselves, so one replaced since, a layer quantized after the build,
/// still names its former tensor, which the host routes).
inline void emit_by_name(torch::nn::Module& made, const std::map<std::string, at::Tensor>& into, const Emit& emit) {
  for (const auto& [name, value] : module_state(made)) {
    auto it = into.find(name);
    if (it == into.end())
      throw Error("deferred build: a part made again holds " + name + ", which the part it was recorded for has not");
    if (value.numel() > 0) emit(it->second, value);
  }
}

/// The part `make()` makes (a torch ModuleHolder or shared_ptr of a module,
/// made whole and initialised as a whole build makes it). Without a
/// deferral: make()'s part. With one: make()'s part, made now and then
/// hollowed (hollow_out); with `replay`, a random step of `deferral` makes it
/// again when the host wants the values and hands them over by name
/// (emit_by_name). Without `replay` the values come from a step of the
/// caller's (a folder's tensors: defer_load_state) and none is recorded.
/// The step keeps `make`: it captures what it needs by value.
template <class Make>
auto deferred_part(Deferral* deferral, Make make, bool replay = true) -> decltype(make()) {
  if (!deferral) return make();
  if (!replay) {
    auto part = make();
    hollow_out(*part);
    return part;
  }
  // the step makes the part; its first run (as it is recorded) keeps what it
  // made as the part, and the part's tensors by name
  struct Kept {
    bool recorded = false;
    decltype(make()) part{nullptr};
    std::map<std::string, at::Tensor> tensors;
  };
  auto kept = std::make_shared<Kept>();
  deferral->add_random([kept, make](const Emit& emit) {
    auto part = make();
    if (!kept->recorded) {
      kept->recorded = true;
      kept->part = part;
      for (auto& [name, t] : module_state(*part)) kept->tensors.emplace(name, t);
      return;
    }
    emit_by_name(*part, kept->tensors, emit);
  });
  auto part = kept->part;
  kept->part = nullptr;  // (the step keeps the tensors, not the module)
  hollow_out(*part);
  return part;
}

/// A model with a deferred build (`deferral` not empty) is deferred while one
/// of its tensors still waits (hollow): after the host gave each its storage,
/// or a run gathered the divided weights back, none does (what a plugin's
/// Deferred::deferred() answers).
inline bool waits_for_values(const torch::nn::Module& model, const Deferral& deferral) {
  if (deferral.empty()) return false;
  for (const auto& [name, t] : module_state(const_cast<torch::nn::Module&>(model)))
    if (is_hollow(t)) return true;
  return false;
}

/// The `deferred` option of a model plugin, saying which of the model's
/// weights `what` it defers.
inline OptionSpec deferred_option(const std::string& what) {
  return opt_bool("deferred", false,
                  "make no weights of " + what + " now (DeepSpeed's zero.Init, FSDP's meta device): under "
                  "wick.train's shard = \"parameters\" on several ranks each rank makes only its chunks, so no "
                  "rank holds them whole; any other use makes the whole model first. The same values as a whole "
                  "build (the random draws replayed, or the folder's tensors read one at a time)");
}

/// What a folder's tensor may be taken as instead of being handed whole to
/// the module's tensor of its name (a linear layer's weight quantized as it
/// arrives: Linear::emit_nf4_from): true when `take` handed it over itself.
using TakeDeferredTensor = std::function<bool(const std::string& name, const at::Tensor& tensor, const Emit& emit)>;

/// The deferred counterpart of load_state(m, tensors, source, ignore): the
/// names and shapes checked now (the same error), and a step of `deferral`
/// recorded that hands each tensor, in the file's order, to `m`'s tensor of
/// its name (or to `take`), in the file's dtype. The tensors (views of a
/// mapped file) are kept by the step until the deferral is cleared.
inline void defer_load_state(torch::nn::Module& m, NamedTensorList&& tensors, const std::string& source,
                             const std::set<std::string>& ignore, Deferral& deferral, TakeDeferredTensor take = {}) {
  std::map<std::string, at::Tensor> targets;
  {
    const NamedTensorList state = module_state(m);
    detail::check_fit(state, tensors, source, ignore);
    for (const auto& [name, t] : state) targets.emplace(name, t);
  }
  auto file = std::make_shared<NamedTensorList>(std::move(tensors));
  deferral.add([file, targets = std::move(targets), take = std::move(take)](const Emit& emit) {
    at::NoGradGuard no_grad;
    for (const auto& [name, t] : *file) {
      if (take && take(name, t, emit)) continue;
      if (auto it = targets.find(name); it != targets.end()) emit(it->second, t);
    }
  });
}

}  // namespace wick
