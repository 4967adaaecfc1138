#pragma once
// shard = "parameters": whether a model's weights are divided across ranks
// now (host/train/trainer.cpp keeps the record), for readers outside a
// trainer's steps (the Lua binding) to refuse by name instead of reading
// freed memory.

#include <memory>
#include <string>

namespace wick {

class Model;

/// Why the model's weights cannot be read now (divided across the ranks by a
/// running trainer, or lost with a run that failed while they were); "" when
/// they are whole.
std::string weights_partitioned(const Model& model);

/// The record a trainer keeps: `why` the model's weights cannot be read, or
/// "" once they are whole again.
void mark_partitioned(const std::shared_ptr<Model>& m, const std::string& why);

}  // namespace wick
