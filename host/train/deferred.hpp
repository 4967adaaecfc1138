#pragma once
// Models built deferred (wick::Deferred, wick/kit/deferral.hpp): their
// tensors hollow until made. A run that divides the weights (shard =
// "parameters" on several ranks) keeps each rank's chunks of each value as
// it is made (trainer.cpp, GradReducer::fill); every other use makes the
// model whole first, here.

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "wick/kit/safetensors.hpp"

namespace torch::nn {
class Module;
}

namespace wick {

class Model;
class Emit;

/// Whether the model waits for its values: a plugin's deferred build
/// (wick::Deferred), or weights a divided run left in a file (defer_to_file).
bool is_deferred(Model& model);

/// Makes each waiting value once, in turn, for emit(tensor, value) (as
/// wick::Deferred::materialize; a lambda is an Emit): the file's tensors
/// when the model was deferred to one, else the plugin's steps.
void run_deferred(Model& model, const Emit& emit);

/// The model's values are `file`'s (safetensors, the model's names), read
/// when they are wanted; its tensors are hollow (a divided run's end with
/// return_weights = "file").
void defer_to_file(const std::shared_ptr<Model>& model, const std::filesystem::path& file);

/// Every deferred value made and kept whole (each hollow tensor given its
/// own storage), saying so on stderr as `who` when `say`; nothing when the
/// model is not deferred. Throws, naming it, when a hollow tensor got no value.
void materialize_whole(Model& model, const std::string& who, bool say = true);

/// Writes `out` to `file` (safetensors) from a deferred model: entry j is
/// made (out[j].make()) from the model's tensors uses[j], once each of them
/// holds its value. The model's values are made in turn (run_deferred), each
/// put into its hollow tensor while the entries using it are made and dropped
/// after, so the model holds about one layer's values at a time and stays
/// deferred. An entry whose tensors never get a value is an error naming it.
void write_deferred(Model& model, const std::filesystem::path& file, const std::vector<LazyTensor>& out,
                    const std::vector<std::vector<at::Tensor>>& uses, const std::map<std::string, std::string>& metadata);

/// Writes a deferred model's weights to `file` as save_model does, a value
/// at a time as it is made (its own tensors for the rest), so the model is
/// never whole and stays deferred.
void save_deferred(Model& model, const std::filesystem::path& file);

/// t in `dtype` on `device` (as Tensor::to); a hollow tensor stays hollow,
/// with no bytes read or made.
at::Tensor moved(const at::Tensor& t, std::optional<at::ScalarType> dtype, std::optional<at::Device> device = {});

/// The module's hollow tensors onto `device`, still hollow, so that
/// Module::to(device) after moves only the others.
void move_hollow(torch::nn::Module& module, at::Device device);

}  // namespace wick
