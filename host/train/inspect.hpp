#pragma once
// Looking inside a run without training: the samples and windows the loader
// gives, a model's outputs and gradients on a batch, each written as
// safetensors so that PyTorch (or a test) can compare.

#include <cstdint>
#include <filesystem>
#include <vector>

#include "wick/data.hpp"
#include "wick/model.hpp"

namespace wick {

/// Samples first .. first+count-1 (0-based) as a window of micro-batches of
/// `micro`; throws naming the range when it does not fit the data.
std::vector<Batch> sample_window(const Dataset& data, std::int64_t first, std::int64_t count, std::int64_t micro);

/// A window's micro-batches as safetensors "<k>.<name>" (k from 0).
void save_window(const std::vector<Batch>& window, const std::filesystem::path& file);

/// Samples as the loader reads them in `epoch` of a run seeded `seed`, as
/// safetensors "<i>.<name>" (an index given twice is written once).
void save_samples(const Dataset& data, const std::vector<std::int64_t>& indices, const std::filesystem::path& file,
                  std::int64_t epoch, std::uint64_t seed);

/// A batch read from a safetensors file (its tensors by name).
Batch read_batch(const std::filesystem::path& file);

/// The model's outputs (Model::predict, evaluation mode, no gradients) for
/// the batch in `batch_file`, written as safetensors "output".
void save_predictions(Model& model, const std::filesystem::path& batch_file, const std::filesystem::path& out_file);

/// The loss (sum / items) of the batch in `batch_file` and every parameter's
/// gradient of it, as safetensors "loss", "items", "grad.<name>"; the model's
/// gradients are cleared before and after.
void save_gradients(Model& model, const std::filesystem::path& batch_file, const std::filesystem::path& out_file);

}  // namespace wick
