#pragma once
// A step's arithmetic: fp32, autocast over fp32 weights (the mixed modes),
// or weights, activations and gradients in half precision (the true modes);
// and fp16's loss scaling, by PyTorch's GradScaler kernels and rules.

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "wick/kit/enum_names.hpp"

namespace wick {

class Model;

/// Arithmetic: fp32; autocast with fp32 master weights (bf16/fp16-mixed); or
/// weights, activations and gradients in half precision (bf16/fp16-true).
enum class Precision { FP32, BF16Mixed, FP16Mixed, BF16True, FP16True };
inline constexpr EnumName<Precision> kPrecisionNames[] = {{Precision::FP32, "fp32"},
                                                           {Precision::BF16Mixed, "bf16-mixed"},
                                                           {Precision::FP16Mixed, "fp16-mixed"},
                                                           {Precision::BF16True, "bf16-true"},
                                                           {Precision::FP16True, "fp16-true"}};
static_assert(enum_names_distinct(kPrecisionNames));
Precision parse_precision(const std::string& s);
std::string to_string(Precision p);

/// fp16 loss scaling, torch.amp.GradScaler's rules: the loss is multiplied by
/// `scale` before backward; a step whose gradients hold inf or nan is skipped
/// and the scale multiplied by `backoff`; after `interval` clean steps in a
/// row it is multiplied by `growth`. `dynamic = false` keeps `init` fixed
/// (overflowing steps are still skipped).
struct LossScaleConfig {
  double init = 65536.0;
  double growth = 2.0;
  double backoff = 0.5;
  std::int64_t interval = 2000;
  bool dynamic = true;
};

/// Autocast for the forward of a mixed-precision step: ops LibTorch lists run
/// in bf16/fp16 while the weights stay fp32. Restores what was there before.
/// Nothing for the other precisions.
class AutocastScope {
 public:
  /// cache = false: no half-precision copy of a weight kept for the rest of
  /// the forward (ZeRO-3: those copies would be every block's weights again)
  AutocastScope(Precision p, const at::Device& device, bool cache = true);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool on_ = false, prev_enabled_ = false, prev_cache_ = true;
  at::DeviceType type_ = at::kCPU;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

/// bf16 or fp16: the half type of a precision.
at::ScalarType half_dtype(Precision p);
bool true_half(Precision p);  ///< bf16-true or fp16-true: the weights themselves in half precision

/// The true modes: the model's floating-point parameters and buffers in the
/// half type; integer tensors (4-bit codes, counters) stay as they are,
/// unlike Module::to.
void to_half_precision(Model& model, Precision p);

/// fp16: each gradient of `params` divided by `scale` in place; returns a
/// one-element float tensor, > 0 when some gradient holds inf or nan.
at::Tensor unscale_gradients(const std::vector<std::pair<std::string, at::Tensor>>& params, const at::Tensor& scale);

/// The dynamic scale after a step (skipped: it overflowed), as GradScaler
/// updates it; `growth_tracker` counts the clean steps in a row.
void update_loss_scale(at::Tensor& scale, at::Tensor& growth_tracker, bool skipped, const LossScaleConfig& c);

}  // namespace wick
