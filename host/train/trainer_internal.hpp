#pragma once
// What the trainer's files (trainer.cpp, checkpoint_io.cpp, ema.cpp, evaluate.cpp) share of the Trainer's insides; not
// part of the engine's interface.
#include <ATen/core/Generator.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "distributed/reducer.hpp"
#include "wick/data.hpp"

namespace wick::trainer_internal {

/// The random generators a run draws from: the CPU's, and the device's when it is a GPU.
std::vector<std::pair<std::string, at::Generator>> generators(const at::Device& device);

/// The random generators' states, to draw the same numbers again.
using RngState = std::vector<std::pair<at::Generator, at::Tensor>>;
RngState rng_state(const at::Device& device);
void set_rng_state(const RngState& state);

/// A checkpoint's folder name: step-00000012.
std::string step_dir_name(std::int64_t step);

/// Every micro-batch of the window cut in `parts` along the sample dimension
/// (empty pieces dropped): the same samples in the same order.
std::vector<Batch> split_window(const std::vector<Batch>& window, std::int64_t parts);

/// A tensor's bytes (0 when undefined).
std::int64_t bytes_of(const at::Tensor& t);

/// offload_embeddings: a copy of `value` in host memory outside the count of
/// the device's tensors (util/memory.hpp's host offload), for the table `name`.
at::Tensor host_table(const at::Tensor& value, const std::string& name);

/// offload_embeddings: the input embedding tables `model` offers
/// (wick::HostLookups), each by its name among the model's tensors; an Error
/// that says why when there are none, one is not the model's own, or one
/// trains. Before anything of the model changes (the trainer), or to know
/// whether the option can be offered (wick plan).
std::map<const c10::TensorImpl*, std::string> offered_host_tables(Model& model);

/// sum += x, where an undefined sum is zero: a single micro-batch costs no
/// zeros tensor and no addition (each is a dispatch the step would pay).
void add_to(at::Tensor& sum, const at::Tensor& x);

/// A model metric as one double on its device: a sum unless it is one already.
at::Tensor metric_value(const at::Tensor& v);

/// ZeRO-3: every unit freed when the scope ends, as it ends (a save, a load,
/// an evaluation that gathered).
struct ReleaseUnits {
  GradReducer* reducer;
  ~ReleaseUnits() { reducer->release_all(); }
};

}  // namespace wick::trainer_internal
