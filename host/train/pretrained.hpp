#pragma once
// A model's weights as a Hugging Face folder holds them (wick.save_pretrained):
// float linear layers under their own names, whatever the model carries in
// memory (4-bit NF4 base weights, LoRA adapters beside them).

#include <cstdint>
#include <filesystem>
#include <vector>

#include "wick/kit/safetensors.hpp"
#include "wick/kit/weights.hpp"
#include "wick/model.hpp"

namespace wick {

/// The model's state with each NF4 layer's weight dequantized (to the
/// model's float dtype) and, with `merge`, each LoRA adapter folded into its
/// layer's weight (alpha / r * B A, summed in fp32): the model computes what
/// the in-memory one does, and the adapters are not left beside it. Without
/// `merge`, a layer carrying an adapter is an error (the caller writes the
/// adapters as PEFT does). Those weights are made as write_safetensors comes
/// to them, one at a time (a 7B QLoRA model never holds its float weights all
/// at once); the model itself is left as it is. `uses`, when given, gets for
/// each entry the model's tensors it is made from.
std::vector<LazyTensor> pretrained_tensors(Model& model, bool merge,
                                           std::vector<std::vector<at::Tensor>>* uses = nullptr);

/// Writes pretrained_tensors(model, merge) to `file` when `write` (rank 0);
/// every rank checks. A deferred model (built deferred, or left in a divided
/// run's file) is written as its values are made, a layer at a time, and
/// stays deferred: it is never whole.
void save_pretrained_weights(Model& model, const std::filesystem::path& file, bool merge, bool write);

/// The linear layers of the model (Model's AdapterTargets) carrying a LoRA
/// adapter now.
std::int64_t adapted_layers(Model& model);

}  // namespace wick
