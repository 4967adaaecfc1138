// The exponential moving average of the trainable weights (ema): updated
// after each step, swapped in for an evaluation, written for model:load.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "distributed/group.hpp"
#include "train/trainer.hpp"
#include "wick/kit/safetensors.hpp"
#include "wick/kit/weights.hpp"

namespace fs = std::filesystem;

namespace wick {

void Trainer::update_ema() {
  at::NoGradGuard no_grad;
  const bool copy = step_ <= cfg_.ema_start;
  for (std::size_t i = 0; i < ema_.size(); ++i) {
    at::Tensor& avg = ema_[i].second;
    const at::Tensor w = (sharded_ema_ ? stepped_ : params_)[i].second.detach();
    if (copy) avg.copy_(w);
    // half-precision weights: one fp32 copy of one tensor at a time
    else avg.lerp_(w.scalar_type() == at::kFloat ? w : w.to(at::kFloat), 1.0 - cfg_.ema);
  }
}

void Trainer::with_ema(const std::function<void()>& fn) {
  if (!has_ema()) throw Error("the run keeps no average of its weights (ema = 0)");
  check_not_finished("evaluating the average");
  at::NoGradGuard no_grad;
  // what the forward reads the weights from: the model's tensors, or
  // (ZeRO-3) this rank's pieces of them, which every block gathers from
  std::vector<at::Tensor> into;
  if (sharded_ema_) {
    reducer_->release_all();
    for (const auto& piece : reducer_->my_pieces()) into.push_back(reducer_->piece_view(piece));
  } else {
    for (const auto& p : model_params_) into.push_back(p.detach());
  }
  std::vector<at::Tensor> trained;
  trained.reserve(into.size());
  for (std::size_t i = 0; i < into.size(); ++i) {
    trained.push_back(into[i].clone());
    into[i].copy_(ema_[i].second.reshape(into[i].sizes()));
  }
  auto restore = [&] {
    if (sharded_ema_) reducer_->release_all();  // gathered from the average
    for (std::size_t i = 0; i < into.size(); ++i) into[i].copy_(trained[i]);
  };
  try {
    fn();
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

void Trainer::save_ema(const fs::path& file) {
  if (!has_ema()) throw Error("the run keeps no average of its weights (ema = 0)");
  std::map<std::string, at::Tensor> avg;
  if (sharded_ema_) {
    // every rank's pieces joined on rank 0, which alone writes
    avg = joined_ema();
    if (cfg_.group->rank() != 0) return;
  } else {
    avg.insert(ema_.begin(), ema_.end());
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [name, t] : module_state(*model_)) {
    auto it = avg.find(name);
    out.emplace_back(name, it != avg.end() ? it->second : t);
  }
  write_safetensors(file, out, {{"format", "pt"}, {"wick.ema", std::to_string(cfg_.ema)},
                                {"wick.ema_step", std::to_string(step_)}});
}

}  // namespace wick
