#include "train/precision.hpp"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_amp_update_scale.h>

#include <cmath>
#include <map>

#include "train/deferred.hpp"
#include "wick/model.hpp"

namespace wick {

AutocastScope::AutocastScope(Precision p, const at::Device& device, bool cache) {
  if (p != Precision::BF16Mixed && p != Precision::FP16Mixed) return;
  on_ = true;
  type_ = device.type();
  prev_enabled_ = at::autocast::is_autocast_enabled(type_);
  prev_dtype_ = at::autocast::get_autocast_dtype(type_);
  prev_cache_ = at::autocast::is_autocast_cache_enabled();
  at::autocast::set_autocast_enabled(type_, true);
  at::autocast::set_autocast_dtype(type_, p == Precision::BF16Mixed ? at::kBFloat16 : at::kHalf);
  if (!cache) at::autocast::set_autocast_cache_enabled(false);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!on_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(type_, prev_enabled_);
  at::autocast::set_autocast_dtype(type_, prev_dtype_);
  at::autocast::set_autocast_cache_enabled(prev_cache_);
}

at::ScalarType half_dtype(Precision p) {
  return p == Precision::BF16True || p == Precision::BF16Mixed ? at::kBFloat16 : at::kHalf;
}

bool true_half(Precision p) { return p == Precision::BF16True || p == Precision::FP16True; }

Precision parse_precision(const std::string& s) { return parse_enum(kPrecisionNames, s, "precision"); }

std::string to_string(Precision p) { return std::string(enum_name(kPrecisionNames, p)); }

void to_half_precision(Model& model, Precision p) {
  if (!true_half(p)) return;
  at::NoGradGuard no_grad;
  const auto dtype = half_dtype(p);
  // (a deferred model's hollow tensors change dtype with no bytes made)
  for (auto& t : model.parameters())
    if (at::isFloatingType(t.scalar_type())) t.set_data(moved(t, dtype));
  for (auto& b : model.buffers())
    if (at::isFloatingType(b.scalar_type())) b.set_data(moved(b, dtype));
}

at::Tensor unscale_gradients(const std::vector<std::pair<std::string, at::Tensor>>& params, const at::Tensor& scale) {
  at::Tensor found_inf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(scale.device()));
  const at::Tensor inv_scale = scale.to(at::kDouble).reciprocal().to(at::kFloat);
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const auto& [name, p] : params)
    if (p.grad().defined()) by_dtype[p.grad().scalar_type()].push_back(p.grad());
  for (auto& [dtype, grads] : by_dtype) at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
  return found_inf;
}

void update_loss_scale(at::Tensor& scale, at::Tensor& growth_tracker, bool skipped, const LossScaleConfig& c) {
  if (!c.dynamic) return;
  const at::Tensor agreed = at::full({}, skipped ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat).device(scale.device()));
  at::_amp_update_scale_(scale, growth_tracker, agreed, c.growth, c.backoff, c.interval);
}

}  // namespace wick
