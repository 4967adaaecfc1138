// optim `lora`: LoRA adapters on a model's linear layers, PEFT-compatible
// (plugins/lib/adapters/adapters.hpp).

#include "lib/adapters/adapters.hpp"

namespace {

class Lora final : public wick_plugins::Adapters {
 public:
  explicit Lora(const wick::Options& o) : Adapters(o, /*quantize=*/false) {}
};

}  // namespace

WICK_PLUGIN(wick::plugin<Lora>(
    "lora", "LoRA adapters on a model's linear layers; PEFT-compatible save, load and merge",
    wick_plugins::adapter_options()))
