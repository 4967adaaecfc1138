// optim `lora`: low-rank adapters on a model's linear layers (Hu et al.),
// PEFT-compatible; the implementation is plugins/lib/lora/.

#include <wick/optim.hpp>

#include "lib/lora/adapters.hpp"

namespace {

std::shared_ptr<wick::Object> create(const wick::Options& options) {
  return wick::lora::make_adapters(options, wick::lora::Base::Float);
}

}  // namespace

WICK_PLUGIN(wick::plugin<wick::Transform>("lora",
                                  "LoRA adapters on a model's linear layers; PEFT-compatible save, load and merge",
                                  wick::lora::lora_options(), &create))
