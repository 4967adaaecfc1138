// optim `qlora` (Dettmers et al.): LoRA adapters over base weights stored as
// 4-bit NF4 with double-quantized block constants, dequantized to
// compute_dtype per product; the implementation is plugins/lib/lora/.

#include <wick/optim.hpp>

#include "lib/lora/adapters.hpp"

namespace {

std::shared_ptr<wick::Object> create(const wick::Options& options) {
  return wick::lora::make_adapters(options, wick::lora::Base::Nf4);
}

}  // namespace

WICK_PLUGIN(wick::plugin<wick::Transform>(
    "qlora",
    "QLoRA: LoRA adapters over 4-bit NF4 base weights (double-quantized constants); PEFT-compatible adapters",
    wick::lora::qlora_options(), &create))
