// LoRA adapters (optim `lora`) and their QLoRA form over 4-bit NF4 base
// weights (optim `qlora`): one implementation, two plugins.
#pragma once

#include <wick/optim.hpp>
#include <wick/options.hpp>

#include <memory>

namespace wick::lora {

/// What the adapted layers' base weights become.
enum class Base {
  Float,  ///< left as they are (`lora`)
  Nf4,    ///< quantized to 4-bit NF4 while the adapters are added (`qlora`)
};

/// The transform, from options validated against lora_options() (Base::Float)
/// or qlora_options() (Base::Nf4).
std::shared_ptr<wick::Transform> make_adapters(const wick::Options& options, Base base);

/// r, alpha, dropout, target_modules, bias, modules_to_save.
wick::OptionSchema lora_options();
/// lora_options() plus compute_dtype and block_size.
wick::OptionSchema qlora_options();

}  // namespace wick::lora
