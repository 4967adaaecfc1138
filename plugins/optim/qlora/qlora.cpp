// optim `qlora`: LoRA adapters over 4-bit NF4 base weights with
// double-quantized block constants (plugins/lib/adapters/adapters.hpp).

#include "lib/adapters/adapters.hpp"

namespace {

class Qlora final : public wick_plugins::Adapters {
 public:
  explicit Qlora(const wick::Options& o) : Adapters(o, /*quantize=*/true) {}
};

}  // namespace

WICK_PLUGIN(wick::plugin<Qlora>(
    "qlora", "QLoRA: LoRA adapters over 4-bit NF4 base weights (double-quantized constants); PEFT-compatible adapters",
    wick_plugins::qlora_options()))
