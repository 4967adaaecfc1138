#pragma once
// Freezing and unfreezing a model's parameters by name, for any model: what
// the trainer then trains (parameters with requires_grad) and what holds
// gradients and optimizer state (only those).

#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/module.h>

namespace wick {

struct TrainableCount {
  std::int64_t total = 0;      ///< values in every parameter
  std::int64_t trainable = 0;  ///< values in the parameters that train
  std::int64_t matched = 0;    ///< parameter tensors the patterns named
};

/// Whether `name` (a parameter's dotted name) is named by `pattern`, in the
/// forms LoRA's target_modules takes and globs:
/// - whole dotted components at any depth: the name itself, a module holding
///   it ("model.vision_tower", or "q_proj": every q_proj), or the parameter's
///   own name ("bias": every bias);
/// - a glob over the whole name, where `*` stands for any characters, dots
///   included, and `?` for one ("*.bias", "*norm*", "model.layers.1?.*");
/// - "re:" and an ECMAScript regular expression matching the whole name.
bool names_parameter(const std::string& pattern, const std::string& name);

/// Throws naming `where` when `pattern` cannot name anything: empty, or a
/// "re:" pattern that is not a regular expression.
void check_pattern(const std::string& pattern, const std::string& where);

/// While one lives, a trainer trains `m` with an optimizer that holds
/// `params` (the parameters trainable when it was made): set_trainable then
/// refuses to unfreeze one it does not hold, which would report itself
/// trainable and never train.
class TrainedParameters {
 public:
  TrainedParameters(const torch::nn::Module& m, const std::vector<at::Tensor>& params);
  ~TrainedParameters();
  TrainedParameters(const TrainedParameters&) = delete;
  TrainedParameters& operator=(const TrainedParameters&) = delete;

 private:
  const torch::nn::Module* m_;
};

/// Sets requires_grad to `trainable` on every floating parameter of `m` that
/// one of `patterns` names. A pattern that names no parameter is an error
/// naming it and the model's top-level modules; `fn` names the caller.
TrainableCount set_trainable(torch::nn::Module& m, const std::vector<std::string>& patterns, bool trainable,
                             const std::string& fn);

}  // namespace wick
