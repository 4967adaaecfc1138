#pragma once
// What trainer.cpp and checkpoint_io.cpp share of the Trainer's insides; not
// part of the engine's interface.
#include <ATen/core/Generator.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dist/reducer.hpp"

namespace wick::trainer_internal {

/// The random generators a run draws from: the CPU's, and the device's when it is a GPU.
std::vector<std::pair<std::string, at::Generator>> generators(const at::Device& device);

/// A checkpoint's folder name: step-00000012.
std::string step_dir_name(std::int64_t step);

/// ZeRO-3: every unit freed when the scope ends, as it ends (a save, a load,
/// an evaluation that gathered).
struct ReleaseUnits {
  GradReducer* reducer;
  ~ReleaseUnits() { reducer->release_all(); }
};

}  // namespace wick::trainer_internal
