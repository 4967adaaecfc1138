#include "train/trainer.hpp"

#include <optional>
#include <set>
#include "wick/kit/weights.hpp"
#include "wick/kit/json_fields.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <torch/csrc/autograd/autograd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <deque>
#include <cmath>
#include <fstream>
#include <limits>
#include <random>
#include <set>

#include <c10/core/Event.h>
#ifdef WICK_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "train/activation_checkpoint.hpp"
#include "wick/kit/safetensors.hpp"
#include "dist/group.hpp"
#include "dist/reducer.hpp"
#include "train/loader.hpp"
#include "train/param_groups.hpp"
#include "train/trainer_internal.hpp"
#include "util/checksum.hpp"
#include "util/system.hpp"

namespace fs = std::filesystem;

namespace wick {
using namespace trainer_internal;
namespace {

// Autocast for the forward of a mixed-precision step: ops LibTorch lists run
// in bf16/fp16 while the weights stay fp32. Restores what was there before.
class AutocastScope {
 public:
  /// cache = false: no half-precision copy of a weight kept for the rest of
  /// the forward (ZeRO-3: those copies would be every block's weights again)
  AutocastScope(Precision p, const at::Device& device, bool cache = true) {
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
  ~AutocastScope() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(type_, prev_enabled_);
    at::autocast::set_autocast_dtype(type_, prev_dtype_);
    at::autocast::set_autocast_cache_enabled(prev_cache_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool on_ = false, prev_enabled_ = false, prev_cache_ = true;
  at::DeviceType type_ = at::kCPU;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

// Every micro-batch of the window cut in `parts` along the sample dimension
// (empty pieces dropped): the same samples in the same order.
std::vector<Batch> split_window(const std::vector<Batch>& window, std::int64_t parts) {
  if (parts == 1) return window;
  std::vector<Batch> out;
  for (const auto& b : window) {
    const std::int64_t n = b.begin()->second.size(0);
    std::map<std::string, std::vector<at::Tensor>> pieces;
    for (const auto& [k, t] : b) {
      if (t.dim() == 0 || t.size(0) != n)
        throw Error("cannot split micro-batch " + describe(b) + " to recover from running out of memory: its tensors "
                    "differ in their first (sample) dimension");
      pieces[k] = t.tensor_split(parts, 0);
    }
    for (std::int64_t j = 0; j < parts; ++j) {
      Batch piece;
      for (auto& [k, v] : pieces) piece[k] = v[j];
      if (piece.begin()->second.size(0) > 0) out.push_back(std::move(piece));
    }
  }
  return out;
}

at::ScalarType half_dtype(Precision p) {
  return p == Precision::BF16True || p == Precision::BF16Mixed ? at::kBFloat16 : at::kHalf;
}

std::int64_t bytes_of(const at::Tensor& t) { return t.defined() ? static_cast<std::int64_t>(t.nbytes()) : 0; }


// shard = "parameters": the models whose weights a trainer holds divided now
// (or lost with a run that failed while they were), with what to tell a
// reader; a model gone since frees its address for another
std::mutex partitioned_mu;
std::map<const Model*, std::pair<std::weak_ptr<Model>, std::string>>& partitioned_models() {
  static std::map<const Model*, std::pair<std::weak_ptr<Model>, std::string>> m;
  return m;
}
void mark_partitioned(const std::shared_ptr<Model>& m, const std::string& why) {
  std::lock_guard<std::mutex> lock(partitioned_mu);
  if (why.empty()) partitioned_models().erase(m.get());
  else partitioned_models()[m.get()] = {m, why};
}

// ZeRO-3's Model::run_block: a block's whole weights gathered before it runs
// (and again before its backward, or its recomputation), freed once it has;
// the recipe's checkpointing runs inside.
class PartitionRunner : public BlockRunner {
 public:
  PartitionRunner(GradReducer* reducer, std::map<std::string, std::size_t> units, BlockRunner* inner)
      : reducer_(reducer), units_(std::move(units)), inner_(inner) {}
  std::vector<at::Tensor> run(const std::string& block, const Fn& fn, const std::vector<at::Tensor>& inputs) override {
    auto it = units_.find(block);
    if (it == units_.end()) return inner_ ? inner_->run(block, fn, inputs) : fn(inputs);
    GradReducer* r = reducer_;
    const std::size_t u = it->second;
    const std::string what = "the all-gather of block " + block + "'s weights";
    r->gather_unit(u, what);
    // a checkpointed block runs fn again during its backward: its weights first
    Fn gathered = [r, u, fn, what](const std::vector<at::Tensor>& in) {
      r->gather_unit(u, what);
      return fn(in);
    };
    std::vector<at::Tensor> out = inner_ ? inner_->run(block, gathered, inputs) : fn(inputs);
    if (at::GradMode::is_enabled())
      for (auto& o : out)  // the gradient reaching the block's output: its backward is next
        if (o.defined() && o.requires_grad())
          o.register_hook([r, u, what](const at::Tensor&) { r->gather_unit(u, what + " for its backward"); });
    r->release_unit(u);
    return out;
  }

 private:
  GradReducer* reducer_;
  std::map<std::string, std::size_t> units_;
  BlockRunner* inner_;
};

}  // namespace

namespace trainer_internal {

std::vector<std::pair<std::string, at::Generator>> generators(const at::Device& device) {
  std::vector<std::pair<std::string, at::Generator>> g{{"cpu", at::detail::getDefaultCPUGenerator()}};
  if (device.is_cuda()) g.emplace_back("cuda", at::globalContext().defaultGenerator(device));
  return g;
}

std::string step_dir_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

}  // namespace trainer_internal

std::string weights_partitioned(const Model& model) {
  std::lock_guard<std::mutex> lock(partitioned_mu);
  auto& all = partitioned_models();
  auto it = all.find(&model);
  if (it == all.end()) return "";
  if (it->second.first.expired()) {  // another model at a freed address
    all.erase(it);
    return "";
  }
  return it->second.second;
}

Precision parse_precision(const std::string& s) {
  if (s == "fp32") return Precision::FP32;
  if (s == "bf16-mixed") return Precision::BF16Mixed;
  if (s == "fp16-mixed") return Precision::FP16Mixed;
  if (s == "bf16-true") return Precision::BF16True;
  if (s == "fp16-true") return Precision::FP16True;
  throw Error("precision: expected fp32, bf16-mixed, fp16-mixed, bf16-true or fp16-true, got '" + s + "'");
}

std::string to_string(Precision p) {
  switch (p) {
    case Precision::FP32: return "fp32";
    case Precision::BF16Mixed: return "bf16-mixed";
    case Precision::FP16Mixed: return "fp16-mixed";
    case Precision::BF16True: return "bf16-true";
    case Precision::FP16True: return "fp16-true";
  }
  return "?";
}

std::string describe(const Batch& b) {
  std::string s = "{";
  for (const auto& [k, v] : b) {
    std::ostringstream o;
    o << (s.size() > 1 ? ", " : "") << k << " " << c10::toString(v.scalar_type()) << " " << v.sizes();
    s += o.str();
  }
  return s + "}";
}

// sync = "micro_batch": a micro-batch before the last reduces its gradients
// at once; sum, then divide by the rank count, so the part accumulated before
// stays counted once.
static void finish_early_sync(GradReducer& reducer, std::vector<std::pair<std::string, at::Tensor>>& params, Group& group,
                       std::int64_t step) {
  reducer.finish(step);
  at::NoGradGuard no_grad;
  for (auto& [name, p] : params)
    if (p.grad().defined()) p.mutable_grad().div_(group.size());
}

Batch to_device(const Batch& b, const at::Device& device) {
  if (device.is_cpu()) return b;
  Batch out;
  for (const auto& [k, v] : b) out[k] = v.to(device, /*non_blocking=*/v.is_pinned());
  return out;
}

void save_model(torch::nn::Module& model, const fs::path& file, const std::map<std::string, std::string>& metadata) {
  auto meta = metadata;
  meta.emplace("format", "pt");
  write_safetensors(file, module_state(model), meta);
}

void load_model(torch::nn::Module& model, const fs::path& file) {
  load_state(model, read_safetensors(file).tensors, file.string());
}

Trainer::Trainer(std::shared_ptr<Model> model, std::shared_ptr<Optimizer> optim, std::shared_ptr<Schedule> schedule,
                 TrainerConfig cfg)
    : model_(std::move(model)), optim_(std::move(optim)), schedule_(std::move(schedule)), cfg_(std::move(cfg)) {
  if (!model_) throw Error("wick.train: 'model' is required");
  if (!optim_) throw Error("wick.train: 'optim' is required");
  if (const std::string why = weights_partitioned(*model_); !why.empty())
    throw Error("wick.train: the model cannot be trained: " + why);
  if (cfg_.clip_grad_norm < 0) throw Error("clip_grad_norm must be >= 0, got " + std::to_string(cfg_.clip_grad_norm));
  if (cfg_.clip_grad_value < 0) throw Error("clip_grad_value must be >= 0, got " + std::to_string(cfg_.clip_grad_value));
  if (cfg_.empty_cache_every < 0)
    throw Error("empty_cache_every must be >= 0 steps, got " + std::to_string(cfg_.empty_cache_every));
  if (cfg_.memory_fraction < 0 || cfg_.memory_fraction > 1)
    throw Error("memory_fraction must be in (0, 1] (0: no cap), got " + std::to_string(cfg_.memory_fraction));
  const auto& ls = cfg_.loss_scale;
  if (!(ls.init > 0) || !std::isfinite(ls.init)) throw Error("loss_scale: init must be > 0, got " + std::to_string(ls.init));
  if (ls.dynamic && !(ls.growth > 1)) throw Error("loss_scale: growth must be > 1, got " + std::to_string(ls.growth));
  if (ls.dynamic && !(ls.backoff > 0 && ls.backoff < 1))
    throw Error("loss_scale: backoff must be in (0, 1), got " + std::to_string(ls.backoff));
  if (ls.dynamic && ls.interval < 1) throw Error("loss_scale: interval must be >= 1, got " + std::to_string(ls.interval));
  at::Device device(cfg_.device);
  const bool true_mode = cfg_.precision == Precision::BF16True || cfg_.precision == Precision::FP16True;
  if (cfg_.master_weights && !true_mode)
    throw Error("master_weights: only with precision = \"bf16-true\" or \"fp16-true\" (" + to_string(cfg_.precision) +
                (cfg_.precision == Precision::FP32 ? " weights are fp32 already)" : " keeps fp32 weights already)"));
  if (cfg_.shard != ShardMode::None && cfg_.sync_every_micro_batch)
    throw Error("shard = \"" + to_string(cfg_.shard) + "\": gradients are reduce-scattered once per window, with the "
                "last backward; sync = \"micro_batch\" cannot be used with it");
  if (cfg_.master_weights && cfg_.sync_every_micro_batch)
    throw Error("master_weights: gradients are summed in fp32 over the window and cross ranks once, at its end; "
                "sync = \"micro_batch\" cannot be used with it");
  std::map<std::string, at::Tensor> originals;  // the trainable weights before rounding, for the masters
  if (cfg_.master_weights)
    for (const auto& p : model_->named_parameters(/*recurse=*/true))
      if (p.value().requires_grad() && at::isFloatingType(p.value().scalar_type()))
        originals[p.key()] = p.value().detach().to(device, at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  if (true_mode) {
    // weights, gradients and optimizer state in half precision; integer
    // tensors (4-bit codes, counters) stay as they are, unlike Module::to
    at::NoGradGuard no_grad;
    const auto dtype = half_dtype(cfg_.precision);
    for (auto& p : model_->parameters())
      if (at::isFloatingType(p.scalar_type())) p.set_data(p.to(dtype));
    for (auto& b : model_->buffers())
      if (at::isFloatingType(b.scalar_type())) b.set_data(b.to(dtype));
  }
  model_->to(device);
  if (device.is_cuda() && cfg_.memory_fraction > 0) cuda_set_memory_fraction(cfg_.memory_fraction, device.index() < 0 ? 0 : device.index());
  // Activation checkpointing of the blocks the model declares.
  const auto blocks = model_->blocks();
  std::set<std::string> chosen;
  const auto& ck = cfg_.checkpointing;
  if (ck.mode != CheckpointingConfig::Mode::None && blocks.empty())
    throw Error("checkpointing: the model declares no blocks to checkpoint");
  if (ck.mode == CheckpointingConfig::Mode::All) chosen.insert(blocks.begin(), blocks.end());
  if (ck.mode == CheckpointingConfig::Mode::EveryK) {
    if (ck.k < 1) throw Error("checkpointing: expected every k-th block with k >= 1, got " + std::to_string(ck.k));
    for (std::size_t i = 0; i < blocks.size(); i += static_cast<std::size_t>(ck.k)) chosen.insert(blocks[i]);
  }
  if (ck.mode == CheckpointingConfig::Mode::Names)
    for (const auto& n : ck.names) {
      if (std::find(blocks.begin(), blocks.end(), n) == blocks.end()) {
        std::string known;
        for (const auto& b : blocks) known += (known.empty() ? "" : ", ") + b;
        throw Error("checkpointing: the model has no block '" + n + "' (its blocks: " + known + ")");
      }
      chosen.insert(n);
    }
  if (ck.offload && chosen.empty())
    throw Error("offload_activations: it moves the checkpointed blocks' inputs to host memory, and no block is "
                "checkpointed; set checkpointing = true (or k, or block names) too");
  if (!chosen.empty()) block_runner_ = std::make_unique<CheckpointRunner>(chosen, ck.offload);
  model_->set_block_runner(block_runner_.get());
  for (const auto& p : model_->named_parameters(/*recurse=*/true))
    if (p.value().requires_grad()) {
      model_params_.push_back(p.value());
      at::Tensor stepped = p.value();
      if (cfg_.master_weights) {
        auto it = originals.find(p.key());
        stepped = (it != originals.end() ? it->second : p.value().detach().to(at::kFloat)).requires_grad_(true);
      }
      params_.emplace_back(p.key(), stepped);
    }
  originals.clear();
  if (params_.empty()) throw Error("the model has no trainable parameters");
  if (!(cfg_.ema >= 0 && cfg_.ema < 1))
    throw Error("ema: expected a decay in [0, 1) (0.999; 0: no average), got " + std::to_string(cfg_.ema));
  // ZeRO-3 keeps the average divided as the weights are: made below, from this rank's pieces
  divided_ema_ = cfg_.ema > 0 && cfg_.group && cfg_.group->size() > 1 && cfg_.shard == ShardMode::Parameters;
  if (cfg_.ema > 0 && !divided_ema_) {
    // the average starts at the weights the run starts from (rank 0's, after the broadcast below)
    at::NoGradGuard no_grad;
    for (auto& [name, p] : params_)
      ema_.emplace_back(name, p.detach().to(device, at::kFloat, /*non_blocking=*/false, /*copy=*/true));
  }
  if (scaling()) {
    scale_ = at::full({}, ls.init, at::TensorOptions().dtype(at::kFloat).device(device));
    growth_tracker_ = at::zeros({}, at::TensorOptions().dtype(at::kInt).device(device));
  }
  if (cfg_.group) {
    // Every rank starts from rank 0's weights.
    std::vector<at::Tensor> state;
    for (auto& [name, t] : module_state(*model_)) state.push_back(t.detach());
    if (cfg_.master_weights)
      for (auto& [name, p] : params_) state.push_back(p.detach());
    cfg_.group->broadcast(state, "broadcasting rank 0's initial weights");
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < ema_.size(); ++i) ema_[i].second.copy_(params_[i].second);
    // Sharded fp32 masters are divided: the reducer lays out shapes only (on
    // the meta device), each rank keeps its pieces' masters (below) and the
    // gathered updates go straight into the half-precision weights.
    divided_masters_ = cfg_.master_weights && cfg_.shard != ShardMode::None && cfg_.group->size() > 1;
    const bool zero3 = cfg_.shard == ShardMode::Parameters && cfg_.group->size() > 1;
    // ZeRO-3 divides the model's own (half-precision) weights, whose
    // gradients it sums in fp32 with masters; the others lay out the masters'
    // shapes (divided) or what the optimizer steps
    std::vector<at::Tensor> trainable;
    for (std::size_t k = 0; k < params_.size(); ++k) {
      const at::Tensor& p = params_[k].second;
      trainable.push_back(zero3 && cfg_.master_weights ? model_params_[k]
                          : divided_masters_ ? at::empty(p.sizes(), p.options().device(at::kMeta)).requires_grad_(true)
                                             : p);
    }
    // ZeRO-3: a unit per declared block (its trainable parameters), the last
    // block first, and the weights in no block last: the order their
    // gradients complete in backward
    std::vector<std::vector<std::size_t>> units;
    std::map<std::string, std::size_t> unit_of_block;
    if (zero3) {
      const std::string L = "shard = \"parameters\"";
      std::vector<std::vector<std::size_t>> of_block(blocks.size());
      std::vector<std::size_t> rest;
      for (std::size_t k = 0; k < params_.size(); ++k) {
        std::size_t best = blocks.size(), len = 0;
        for (std::size_t b = 0; b < blocks.size(); ++b)
          if (params_[k].first.starts_with(blocks[b] + ".") && blocks[b].size() >= len) best = b, len = blocks[b].size();
        (best < blocks.size() ? of_block[best] : rest).push_back(k);
      }
      for (std::size_t b = blocks.size(); b-- > 0;)
        if (!of_block[b].empty()) {
          unit_of_block[blocks[b]] = units.size();
          units.push_back(of_block[b]);
        }
      if (!rest.empty()) {
        root_unit_ = units.size();
        units.push_back(rest);
      }
    }
    reducer_ = std::make_unique<GradReducer>(cfg_.group, trainable, cfg_.bucket_mb, cfg_.shard, units,
                                             zero3 && cfg_.master_weights ? at::kFloat : at::ScalarType::Undefined);
    if (partitioned()) {
      // model_ shares each parameter's TensorImpl, so a tensor reached by two
      // names (tied) is one unit's or the run reads it freed
      std::map<const c10::TensorImpl*, std::pair<std::string, std::size_t>> seen;
      for (std::size_t u = 0; u < units.size(); ++u)
        for (auto k : units[u]) {
          auto [it, fresh] = seen.emplace(params_[k].second.unsafeGetTensorImpl(), std::make_pair(params_[k].first, u));
          if (!fresh && it->second.second != u)
            throw Error("shard = \"parameters\": '" + params_[k].first + "' and '" + it->second.first +
                        "' are one tensor used in two blocks (or a block and the rest); its weights would be freed "
                        "while the other reads them: use shard = \"gradients\"");
        }
      partition_runner_ = std::make_unique<PartitionRunner>(reducer_.get(), unit_of_block, block_runner_.get());
      model_->set_block_runner(partition_runner_.get());
    }
    if (divided_masters_) {
      for (const auto& piece : reducer_->my_pieces()) {  // this rank's masters, copied out of the whole ones
        const at::Tensor p = params_[piece.param].second.detach();
        stepped_.emplace_back(params_[piece.param].first,
                              piece.numel == p.numel() ? p.clone() : p.reshape({-1}).narrow(0, piece.start, piece.numel).clone());
      }
      // the whole ones go (ZeRO-3 keeps their shapes: the reducer holds the model's weights)
      for (std::size_t k = 0; k < params_.size(); ++k)
        params_[k].second = zero3 ? at::empty(params_[k].second.sizes(), params_[k].second.options().device(at::kMeta))
                                  : trainable[k];
    }
  }
  if (sharded()) {
    // this rank's pieces: a whole parameter as itself (its shape kept), a
    // split one as a flat view of its part; both share the weights' storage
    // (divided masters: tensors of their own, made above)
    std::vector<std::int64_t> whole;
    for (const auto& piece : reducer_->my_pieces()) {
      const auto& [name, p] = params_[piece.param];
      if (divided_masters_) {
        // made above
      } else if (partitioned()) {  // its pieces are the weights: tensors of their own
        stepped_.emplace_back(name, piece.numel == p.numel() ? reducer_->piece_view(piece).view(p.sizes())
                                                             : reducer_->piece_view(piece));
      } else {
        stepped_.emplace_back(name, piece.numel == p.numel() ? p.detach() : reducer_->piece_view(piece));
      }
      whole.push_back(p.numel());
    }
    // pieces only to an optimizer that updates them as it would the whole
    auto elementwise = [&](Optimizer* o, const std::string& which) {
      if (dynamic_cast<ElementwiseUpdates*>(o)) return;
      throw Error("shard = \"" + to_string(cfg_.shard) + "\": " + which + " does not declare elementwise updates, so "
                  "its step over a rank's flat pieces of a parameter may not be its step over the whole (a per-tensor "
                  "norm, a factored moment) and the run would differ from one rank's; use shard = \"none\", or, as "
                  "its author, derive the optimizer from wick::ElementwiseUpdates (wick/optim.hpp) if each element's "
                  "update depends on that element alone");
    };
    if (auto* groups = dynamic_cast<ParamGroups*>(optim_.get())) {
      groups->check(params_);
      for (const auto& g : groups->groups()) elementwise(g.optim.get(), "the optimizer of parameter group " + g.name);
      elementwise(groups->rest().optim.get(), "the optimizer");
    } else {
      elementwise(optim_.get(), "the optimizer");
    }
    optim_->attach_shard(stepped_, whole);
  } else {
    stepped_ = params_;
    optim_->attach(params_);
  }
  if (divided_ema_) {
    // this rank's pieces of the average, in fp32, from what its optimizer steps
    at::NoGradGuard no_grad;
    for (const auto& [name, p] : stepped_)
      ema_.emplace_back(name, p.detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
  }
  if (partitioned()) {
    // nothing above failed: each rank now keeps its chunks only
    reducer_->release_all();
    mark_partitioned(model_, "its weights are divided across the ranks (shard = \"parameters\") while it trains; "
                             "read them after wick.train returns, or in a custom loop after trainer:finish() on every "
                             "rank (checkpoints hold them whole)");
  }
}

Trainer::~Trainer() {
  // the model may outlive this trainer (and be trained by another)
  if (model_ && (model_->block_runner() == block_runner_.get() || model_->block_runner() == partition_runner_.get()))
    model_->set_block_runner(nullptr);
  // ZeRO-3 without gather_weights_back(): a run that failed (a collective
  // here could wait on ranks gone or elsewhere), and the model says so when read
  if (partitioned() && !gathered_back_)
    mark_partitioned(model_, "its trainer ended while its weights were divided across the ranks (shard = "
                             "\"parameters\": a run that failed, or a custom loop that did not call trainer:finish() "
                             "on every rank): they are lost in this process; load the last checkpoint");
}

void Trainer::gather_weights_back() {
  if (!partitioned() || gathered_back_) return;
  try {
    reducer_->gather_all("gathering the trained weights at the end of the run");
  } catch (...) {
    mark_partitioned(model_, "the trained weights could not be gathered at the end of the run (shard = "
                             "\"parameters\"); load the last checkpoint");
    gathered_back_ = true;
    throw;
  }
  gathered_back_ = true;
  // the model runs its blocks as before the trainer divided them (the
  // partition runner would free each block's weights after it ran)
  if (model_->block_runner() == partition_runner_.get()) model_->set_block_runner(block_runner_.get());
  mark_partitioned(model_, "");
}

void Trainer::check_not_finished(const std::string& what) const {
  if (partitioned() && gathered_back_)
    throw Error(what + ": the trainer was finished (its divided weights gathered back into the model, shard = "
                "\"parameters\"); make a new trainer to go on training");
}

bool Trainer::repeated_blocks() const { return block_runner_ && block_runner_->repeated(); }

void Trainer::check_late_gradients() {
  if (!reducer_ || reducer_->late_param() < 0) return;
  throw Error("step " + std::to_string(step_ + 1) + ": the gradient of '" +
              params_[static_cast<std::size_t>(reducer_->late_param())].first +
              "' arrived after its bucket had been reduced across the ranks (its block ran more than once in one "
              "forward outside the blocks wick checkpoints, each backpropagated on its own); the step is not taken");
}

void Trainer::gather_root(const std::string& what) {
  if (partitioned() && root_unit_) reducer_->gather_unit(*root_unit_, what);
}

void Trainer::check_gathers() {
  Group& group = *cfg_.group;
  const auto mine = static_cast<std::int64_t>(reducer_->take_gather_trace());
  const auto all = group.all_gather_ints({mine}, "comparing the ranks' block order of step " + std::to_string(step_ + 1));
  for (int r = 0; r < group.size(); ++r)
    if (all[static_cast<std::size_t>(r)] != mine)
      throw Error("shard = \"parameters\", step " + std::to_string(step_ + 1) + ": rank " + std::to_string(r) +
                  " ran other blocks, or the same ones in another order or number, than rank " +
                  std::to_string(group.rank()) + " (data that changes a model's path, such as clips of different "
                  "frame counts split into chunks); every rank must run the same blocks: use shard = \"gradients\"");
}

bool Trainer::scaling() const {
  return cfg_.precision == Precision::FP16Mixed || cfg_.precision == Precision::FP16True;
}

double Trainer::loss_scale() const { return scale_.defined() ? scale_.item<double>() : 0.0; }

std::vector<std::string> Trainer::checkpointed_blocks() const {
  std::vector<std::string> out;
  for (const auto& b : model_->blocks())
    if (block_runner_ && block_runner_->blocks().count(b)) out.push_back(b);
  return out;
}

double Trainer::factor_at(std::int64_t step) const {
  return schedule_ ? schedule_->factor(step, cfg_.total_steps) : 1.0;
}

double Trainer::lr_at(std::int64_t step) const { return optim_->base_lr() * factor_at(step); }

void Trainer::update_ema() {
  at::NoGradGuard no_grad;
  const bool copy = step_ <= cfg_.ema_start;
  for (std::size_t i = 0; i < ema_.size(); ++i) {
    at::Tensor& avg = ema_[i].second;
    const at::Tensor w = (divided_ema_ ? stepped_ : params_)[i].second.detach();
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
  if (divided_ema_) {
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
    if (divided_ema_) reducer_->release_all();  // gathered from the average
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
  if (divided_ema_) {
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

std::map<std::string, std::int64_t> Trainer::memory_breakdown() const {
  std::int64_t weights = 0, grads = 0, opt = 0, trainable = 0;
  for (const auto& [name, t] : module_state(*model_)) weights += bytes_of(t);
  // ZeRO-3: this rank's pieces and the units gathered now, not every unit's whole weights
  if (partitioned()) weights += reducer_->held_weight_bytes() - reducer_->whole_weight_bytes();
  for (const auto& [name, p] : params_) {
    grads += bytes_of(p.grad());
    trainable += bytes_of(p);
  }
  for (const auto& [name, p] : stepped_)
    if (sharded()) grads += bytes_of(p.grad());  // this rank's reduced pieces
  for (const auto& [name, t] : optim_->state()) opt += bytes_of(t);
  std::int64_t ema = 0;
  for (const auto& [name, t] : ema_) ema += bytes_of(t);
  opt += ema;  // state kept beside the weights, as masters are
  std::int64_t master = 0;
  if (cfg_.master_weights) {
    for (const auto& p : model_params_) grads += bytes_of(p.grad());
    // divided: this rank's pieces (the whole ones are shapes on the meta device)
    for (const auto& [name, p] : divided_masters_ ? stepped_ : params_) master += bytes_of(p);
  }
  return {{"weights", weights + master},
          {"master_weights", master},
          {"gradients", grads},
          {"optimizer", opt},
          {"ema", ema},
          {"trainable", trainable},
          {"optimizer_expected", optim_->state_bytes(stepped_) + ema}};
}

void Trainer::probe(const Batch& batch, int times) {
  if (partitioned())
    throw Error("shard = \"parameters\": the micro-batch is not probed (each probe would gather weights on every "
                "rank); give micro_batch as a number");
  const at::Device device(cfg_.device);
  model_->train(true);
  clear_grads();
  try {
    for (int k = 0; k < times; ++k) {
      ForwardResult r;
      {
        AutocastScope autocast(cfg_.precision, device);
        r = model_->forward(to_device(batch, device));
      }
      at::Tensor l = r.loss_sum.reshape({}) * (1.0 / static_cast<double>(std::max<std::int64_t>(r.items, 1)));
      if (scaling()) l = l * scale_;
      l.backward();
      if (cfg_.master_weights) fold_grads();  // as a window does after each backward
    }
  } catch (...) {
    clear_grads();
    throw;
  }
  clear_grads();
}

void Trainer::clear_grads() {
  for (auto& p : model_params_) p.mutable_grad() = at::Tensor();
  if (sharded()) {
    for (auto& [name, p] : stepped_) p.mutable_grad() = at::Tensor();
    reducer_->release_chunks();
  }
  if (partitioned()) reducer_->release_all();  // a window given up halfway may have left some gathered
  if (cfg_.master_weights)
    for (auto& [name, p] : params_) p.mutable_grad() = at::Tensor();
}

void Trainer::fold_grads() {
  // ZeRO-3 sums each micro-batch's half-precision gradients in fp32 itself
  if (!cfg_.master_weights || partitioned()) return;
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < model_params_.size(); ++i) {
    at::Tensor& g = model_params_[i].mutable_grad();
    if (!g.defined()) continue;
    at::Tensor& acc = params_[i].second.mutable_grad();
    if (acc.defined()) acc.add_(g);
    else acc = g.to(at::kFloat);
    g = at::Tensor();
  }
}

namespace {
// sum += x, where an undefined sum is zero: a single micro-batch costs no
// zeros tensor and no addition (each is a dispatch the step would pay).
void add_to(at::Tensor& sum, const at::Tensor& x) { sum = sum.defined() ? sum + x : x; }

// A model metric as one double on its device: a sum unless it is one already.
at::Tensor metric_value(const at::Tensor& v) {
  at::Tensor d = v.detach().to(at::kDouble);
  return d.numel() == 1 ? d.reshape({}) : d.sum();
}
}  // namespace

namespace {
// A ZeRO-3 stand-in runs in evaluation mode: its collectives are a training
// micro-batch's, but it moves no running statistics (batch norm) and draws
// no dropout, and one sample is no batch to normalise over.
struct StandInMode {
  Model& model;
  explicit StandInMode(Model& m) : model(m) { model.train(false); }
  ~StandInMode() { model.train(true); }
  StandInMode(const StandInMode&) = delete;
  StandInMode& operator=(const StandInMode&) = delete;
};

// One sample of a micro-batch (its tensors' first rows, copied), or the
// micro-batch itself when its tensors differ in their first dimension: what
// a ZeRO-3 rank runs at loss x 0 to pair its collectives with the others'.
Batch one_sample(const Batch& b) {
  if (b.empty()) return b;
  const at::Tensor& first = b.begin()->second;
  if (first.dim() == 0 || first.size(0) <= 1) return b;
  for (const auto& [k, t] : b)
    if (t.dim() == 0 || t.size(0) != first.size(0)) return b;
  Batch out;
  for (const auto& [k, t] : b) out[k] = t.narrow(0, 0, 1).clone();
  return out;
}
// Pinned micro-batches reach the GPU on a side stream: the copy of micro-
// batch i + 1 is issued when micro-batch i starts, so it runs during i's
// forward and backward. The compute stream waits on the copy's event before
// it reads the tensors, and the caching allocator is told that the compute
// stream uses them (so their memory is not reused under it). Anything else
// (the CPU, pageable tensors, a stand-in) is copied as to_device copies.
class DeviceFeed {
 public:
  DeviceFeed(const at::Device& device, const std::vector<Batch>& pieces) : device_(device), pieces_(pieces) {
#ifdef WICK_WITH_CUDA
    if (device.is_cuda() && !pieces.empty() && pinned(pieces.front()))
      stream_.emplace(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index() < 0
                                                                                 ? c10::cuda::current_device()
                                                                                 : device.index()));
#endif
  }
  Batch take(std::size_t i, const Batch& b, bool stand_in) {
#ifdef WICK_WITH_CUDA
    if (stream_ && !stand_in && i < pieces_.size() && &b == &pieces_[i] && pinned(b)) {
      if (!pending_.count(i)) issue(i);
      auto node = pending_.extract(i);
      Pending& p = node.mapped();
      const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(stream_->device_index());
      p.done.block(compute);
      for (auto& [k, t] : p.batch)
        if (t.defined() && t.is_cuda())
          c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), compute);
      if (i + 1 < pieces_.size() && pinned(pieces_[i + 1]) && !pending_.count(i + 1)) issue(i + 1);
      return std::move(p.batch);
    }
#else
    (void)i;
    (void)stand_in;
#endif
    return to_device(b, device_);
  }

 private:
  static bool pinned(const Batch& b) {
    for (const auto& [k, t] : b)
      if (t.defined() && !t.is_pinned()) return false;
    return !b.empty();
  }
#ifdef WICK_WITH_CUDA
  struct Pending {
    Batch batch;
    c10::Event done{c10::DeviceType::CUDA};
  };
  void issue(std::size_t i) {
    c10::cuda::CUDAStreamGuard guard(*stream_);
    Pending p;
    for (const auto& [k, t] : pieces_[i]) p.batch[k] = t.defined() ? t.to(device_, /*non_blocking=*/true) : t;
    p.done.record(*stream_);
    pending_.emplace(i, std::move(p));
  }
  std::optional<c10::cuda::CUDAStream> stream_;
  std::map<std::size_t, Pending> pending_;
#endif
  at::Device device_;
  const std::vector<Batch>& pieces_;
};
}  // namespace

bool Trainer::run_window(const std::vector<Batch>& window, StepStats& s, at::Tensor& loss_sum,
                         std::map<std::string, at::Tensor>& metric_sums, std::string& oom_message) {
  Group* group = cfg_.group.get();
  const at::Device device(cfg_.device);
  // Ranks agree that none ran out of memory before the last backward starts
  // its all-reduces: one small collective, only when recovery is on.
  const bool zero3 = partitioned();
  const bool agree = group && cfg_.split_on_oom && !cfg_.sync_every_micro_batch && !zero3;
  const std::vector<Batch> pieces = split_window(window, split_);
  // ZeRO-3: every rank runs as many micro-batches as the rank with the most
  // (their gathers and reduce-scatters pair up); a rank with fewer runs one
  // sample of one it ran before again, its loss times zero, adding nothing
  std::size_t runs = pieces.size();
  if (zero3) {
    if (!pieces.empty() && stand_in_.empty()) stand_in_ = one_sample(pieces.front());
    // each rank's count and whether it has a stand-in: every rank decides alike
    const auto a = group->all_gather_ints({static_cast<std::int64_t>(pieces.size()), stand_in_.empty() ? 0 : 1},
                                          "the micro-batch counts of step " + std::to_string(step_ + 1));
    ++host_reads_;
    runs = 0;
    for (std::size_t q = 0; q < a.size(); q += 2) runs = std::max(runs, static_cast<std::size_t>(a[q]));
    for (int q = 0; q < group->size(); ++q)
      if (static_cast<std::size_t>(a[2 * q]) < runs && a[2 * q + 1] == 0)
        throw Error("shard = \"parameters\", step " + std::to_string(step_ + 1) + ": rank " + std::to_string(q) +
                    " has fewer micro-batches in this window than the others and has run none before to stand in "
                    "for them (the ranks' gathers must pair up); give every rank data from the first window on (a "
                    "larger data set, or fewer ranks)");
  }
  // ZeRO-3 recovers from running out of memory without a collective more per
  // gather: a rank that runs out partway through a micro-batch issues the
  // rest of its collectives as its last whole micro-batch issued them (with
  // nothing in them), and those of the window's later ones, and the ranks
  // agree once, after the window, to redo it in smaller parts. The run's
  // first window starts with the stand-in (one sample, at loss x 0, the
  // random state put back), so there is a whole micro-batch to follow.
  const bool recover = zero3 && cfg_.split_on_oom;
  const bool trace = recover && runs > 0 && !reducer_->can_replay();
  const double inv_items = 1.0 / static_cast<double>(s.items);
  const std::string where = "step " + std::to_string(step_ + 1);
  bool agreed = false, tracing = false;
  std::size_t i = 0;
  DeviceFeed feed(device, pieces);
  // one micro-batch's forward and backward; false: another rank ran out of
  // memory before this window's gradients were reduced
  auto micro_batch = [&](const Batch& batch, bool stand_in, bool last) {
    std::optional<StandInMode> mode;
    if (stand_in) mode.emplace(*model_);
    if (block_runner_) block_runner_->reset_runs();
    if (zero3) reducer_->begin_micro_batch();
    gather_root("the all-gather of the weights in no block, for micro-batch " + std::to_string(i + 1) + " of " + where);
    ForwardResult r;
    {
      AutocastScope autocast(cfg_.precision, device, /*cache=*/!zero3);
      try {
        r = model_->forward(feed.take(i, batch, stand_in));
      } catch (const c10::OutOfMemoryError&) {
        throw;
      } catch (const c10::Error& e) {
        throw Error(where + ", micro-batch " + std::to_string(i + 1) + " of " + std::to_string(pieces.size()) +
                    ": the model's forward failed on " + describe(batch) + ": " + e.what_without_backtrace());
      }
    }
    const std::int64_t counted = model_->count_items(batch);
    if (r.items != counted)
      throw Error("the model counted " + std::to_string(counted) + " items in a micro-batch before forward and " +
                  std::to_string(r.items) + " in forward");
    if (!r.loss_sum.defined() || r.loss_sum.numel() != 1)
      throw Error("the model's forward must return a one-element loss sum");
    if (last && agree) {
      agreed = true;
      if (group->sum(0, "the out-of-memory check of " + where) > 0) return false;
    }
    // this backward reduces as it goes (ZeRO-3: every backward)
    if (group && (last || cfg_.sync_every_micro_batch || zero3)) reducer_->arm(/*early=*/!repeated_blocks());
    at::Tensor l = r.loss_sum.reshape({}) * (stand_in ? 0.0 : inv_items);
    if (scaling()) l = l * scale_;
    l.backward();
    fold_grads();
    check_late_gradients();
    if (group && !last && cfg_.sync_every_micro_batch) finish_early_sync(*reducer_, params_, *group, step_ + 1);
    if (zero3) {  // this micro-batch's sums, into this rank's chunks
      reducer_->finish(step_ + 1);
      reducer_->end_micro_batch();
    }
    if (stand_in) return true;
    add_to(loss_sum, r.loss_sum.detach().to(at::kDouble).reshape({}));
    for (auto& [k, v] : r.metrics) add_to(metric_sums[k], metric_value(v));
    return true;
  };
  try {
    if (coupled_windows(*model_) && (group || pieces.size() > 1)) {
      if (!run_coupled(pieces, runs, s, loss_sum, metric_sums, i, agree ? &agreed : nullptr)) return false;
      s.micro_batches = static_cast<std::int64_t>(pieces.size());
      return true;
    }
    if (agree && pieces.empty()) {
      agreed = true;
      if (group->sum(0, "the out-of-memory check of " + where) > 0) return false;
    }
    if (trace) {
      std::vector<std::pair<at::Generator, at::Tensor>> rng;
      for (auto& [name, gen] : generators(device)) {
        std::lock_guard<std::mutex> lock(gen.mutex());
        rng.emplace_back(gen, gen.get_state());
      }
      tracing = true;
      micro_batch(stand_in_, /*stand_in=*/true, /*last=*/false);
      tracing = false;
      for (auto& [gen, state] : rng) {
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(state);
      }
    }
    for (; i < runs; ++i)
      if (!micro_batch(i < pieces.size() ? pieces[i] : stand_in_, i >= pieces.size(), i + 1 == runs)) return false;
    if (group && runs == 0) reducer_->arm();  // nothing to backpropagate: this rank sends zeros
    if (zero3 && runs == 0) reducer_->finish(step_ + 1);
    if (recover && group->sum(0, "the out-of-memory check of " + where) > 0) return false;
  } catch (const c10::OutOfMemoryError& e) {
    oom_message = e.what_without_backtrace();
    const std::string what = where + ", micro-batch " + std::to_string(std::min(i + 1, pieces.size())) + " of " +
                             std::to_string(pieces.size()) + ": out of memory: " + oom_message;
    if (!cfg_.split_on_oom) throw Error(what + " (recovery is off: on_oom = \"fail\")");
    if (zero3 && coupled_windows(*model_))
      throw Error(what + " (shard = \"parameters\" does not redo a window whose loss couples it: lower micro_batch "
                  "and raise accumulate)");
    if (zero3) {
      // the rest of this micro-batch's collectives and the later ones', then the agreement
      if (!reducer_->drain(step_ + 1))
        throw Error(what + (tracing ? " (in the one-sample micro-batch that shard = \"parameters\" runs first "
                                              "to learn its collectives: the model does not fit even so)"
                                            : " (shard = \"parameters\": this micro-batch began with other "
                                              "collectives than the last whole one, so this rank cannot finish it "
                                              "with the others; lower micro_batch and raise accumulate)"));
      for (std::size_t j = i + 1; j < runs; ++j) reducer_->replay(step_ + 1);
      group->sum(1, "the out-of-memory check of " + where);
      return false;
    }
    if (group && !agree)
      throw Error(what + " (recovery across ranks needs sync = \"window\")");
    if (agreed)
      throw Error(what + " (after the ranks began their gradient all-reduce: cannot redo the window)");
    if (group) group->sum(1, "the out-of-memory check of " + where);  // tell the others: everyone redoes the window
    return false;
  }
  s.micro_batches = static_cast<std::int64_t>(pieces.size());
  return true;
}

// A loss over the whole window (contrastive), exactly, in three passes
// (GradCache): embeddings of every micro-batch without a graph; the loss over
// all of them (every rank's, gathered) and its gradient with respect to each
// embedding; then each micro-batch's embeddings again, with the graph and the
// random state of the first pass, backpropagating those gradients. Memory
// holds one micro-batch's graph at a time plus the window's embeddings.
bool Trainer::run_coupled(const std::vector<Batch>& pieces, std::size_t runs, StepStats& s, at::Tensor& loss_sum,
                          std::map<std::string, at::Tensor>& metric_sums, std::size_t& i, bool* agreed) {
  WindowCoupled& coupled = *coupled_windows(*model_);
  Group* group = cfg_.group.get();
  const at::Device device(cfg_.device);
  const std::string where = "step " + std::to_string(step_ + 1);
  const int world = group ? group->size() : 1;
  // ZeRO-3: as many embeddings and backwards on every rank (their gathers
  // pair up), a rank with fewer micro-batches running its stand-in, whose
  // embeddings count nowhere and whose backward takes zeros; every backward
  // reduces its gradients
  const bool zero3 = partitioned();
  // 1. embeddings, no graph; the random state before each micro-batch
  std::vector<std::vector<std::pair<at::Generator, at::Tensor>>> states(runs);
  std::vector<std::vector<at::Tensor>> emb(pieces.size());
  std::vector<std::int64_t> rows(pieces.size());
  for (i = 0; i < runs; ++i) {
    for (auto& [name, gen] : generators(device)) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      states[i].emplace_back(gen, gen.get_state());
    }
    at::NoGradGuard no_grad;
    AutocastScope autocast(cfg_.precision, device, /*cache=*/!zero3);
    gather_root("the all-gather of the weights in no block, for the embeddings of micro-batch " + std::to_string(i + 1) +
                " of " + where);
    if (i >= pieces.size()) {
      StandInMode mode(*model_);
      coupled.embed(to_device(stand_in_, device));
      continue;
    }
    rows[i] = model_->count_items(pieces[i]);
    emb[i] = coupled.embed(to_device(pieces[i], device));
    if (emb[i].empty() || (i > 0 && emb[i].size() != emb[0].size()))
      throw Error(where + ": the model's embed() must give the same number (at least one) of embeddings for every "
                  "micro-batch");
    for (const auto& e : emb[i])
      if (e.dim() != 2 || e.size(0) != rows[i])
        throw Error(where + ": the model's embed() must give [items, width] tensors with one row per item (" +
                    std::to_string(rows[i]) + " items), got " + c10::str(e.sizes()));
  }
  // The number of embeddings and their widths: from this rank's data, or, on
  // a rank whose window is empty, from the others' (one small all-reduce).
  std::vector<std::int64_t> widths;
  if (!emb.empty())
    for (const auto& e : emb[0]) widths.push_back(e.size(1));
  if (group) {
    constexpr std::int64_t kMax = 16;
    if (static_cast<std::int64_t>(widths.size()) > kMax) throw Error(where + ": embed() gave more than 16 embeddings");
    std::vector<at::Tensor> meta{at::zeros({world, kMax + 1}, at::TensorOptions().dtype(at::kLong).device(group->device()))};
    if (!emb.empty()) {
      meta[0][group->rank()][0] = static_cast<std::int64_t>(widths.size());
      for (std::size_t k = 0; k < widths.size(); ++k) meta[0][group->rank()][static_cast<std::int64_t>(k) + 1] = widths[k];
    }
    group->all_reduce(meta, "the embedding sizes of " + where);
    const at::Tensor m = meta[0].cpu();
    for (int r = 0; r < world; ++r) {
      const auto n = m[r][0].item<std::int64_t>();
      if (n == 0) continue;
      std::vector<std::int64_t> theirs;
      for (std::int64_t k = 0; k < n; ++k) theirs.push_back(m[r][k + 1].item<std::int64_t>());
      if (widths.empty()) widths = theirs;
      else if (widths != theirs)
        throw Error(where + ": rank " + std::to_string(r) + "'s embeddings differ in number or width from rank " +
                    std::to_string(group->rank()) + "'s");
    }
  }
  // 2. the loss over the window on every rank; gradients of the embeddings
  std::vector<at::Tensor> all;
  std::int64_t offset = 0;
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  for (std::size_t k = 0; k < widths.size(); ++k) {
    std::vector<at::Tensor> parts;
    for (const auto& e : emb) parts.push_back(e[k].to(at::kFloat));
    at::Tensor local = parts.empty() ? at::zeros({0, widths[k]}, f32) : at::cat(parts);
    if (group) std::tie(local, offset) = group->all_gather_rows(local, widths[k], "the embeddings of " + where);
    all.push_back(local.detach().requires_grad_(true));
  }
  for (auto& e : emb) e.clear();  // only the rows in `all` are needed now
  gather_root("the all-gather of the weights in no block, for the loss over " + where);
  ForwardResult r = coupled.window_loss(all);
  if (r.items != s.items)
    throw Error(where + ": the model's window_loss() counted " + std::to_string(r.items) + " items, the window holds " +
                std::to_string(s.items));
  if (!r.loss_sum.defined() || r.loss_sum.numel() != 1)
    throw Error("the model's window_loss() must return a one-element loss sum");
  // Every rank computes the same loss: its gradient for the parameters the
  // loss uses directly (a temperature) is divided by the rank count, as the
  // all-reduce sums it; the embeddings' gradients are taken whole.
  at::Tensor l = r.loss_sum.reshape({}) * (1.0 / static_cast<double>(s.items) / world);
  if (scaling()) l = l * scale_;
  l.backward();
  fold_grads();
  std::vector<at::Tensor> grads;
  for (auto& a : all) grads.push_back(a.grad() * static_cast<double>(world));
  all.clear();
  if (!group || group->rank() == 0) {  // the window's loss, counted once over the ranks
    add_to(loss_sum, r.loss_sum.detach().to(at::kDouble).reshape({}));
    for (auto& [k, v] : r.metrics) metric_sums[k] = metric_value(v);
  } else {
    for (auto& [k, v] : r.metrics) metric_sums[k] = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  }
  r = ForwardResult();
  // 3. each micro-batch again, with its graph, taking the cached gradients
  std::int64_t row = offset;
  for (i = 0; i < runs; ++i) {
    for (auto& [gen, state] : states[i]) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
    const bool stand_in = i >= pieces.size();
    std::vector<at::Tensor> e;
    if (block_runner_) block_runner_->reset_runs();
    gather_root("the all-gather of the weights in no block, for micro-batch " + std::to_string(i + 1) + " of " + where);
    {
      std::optional<StandInMode> mode;
      if (stand_in) mode.emplace(*model_);
      AutocastScope autocast(cfg_.precision, device, /*cache=*/!zero3);
      e = coupled.embed(to_device(stand_in ? stand_in_ : pieces[i], device));
    }
    std::vector<at::Tensor> g;
    for (std::size_t k = 0; k < e.size(); ++k)
      g.push_back(stand_in ? at::zeros_like(e[k]) : grads[k].narrow(0, row, rows[i]).to(e[k].scalar_type()));
    if (!stand_in) row += rows[i];
    const bool last = i + 1 == runs;
    if (last && agreed) {
      *agreed = true;
      if (group->sum(0, "the out-of-memory check of " + where) > 0) return false;
    }
    if (group && (last || cfg_.sync_every_micro_batch || zero3)) reducer_->arm(/*early=*/!repeated_blocks());
    torch::autograd::backward(e, g);
    fold_grads();
    check_late_gradients();
    if (group && !last && cfg_.sync_every_micro_batch) finish_early_sync(*reducer_, params_, *group, step_ + 1);
    if (zero3) reducer_->finish(step_ + 1);  // this micro-batch's sums (the loss's own gradients with the first)
  }
  if (group && runs == 0) {  // at the point where the others check before their last backward
    if (agreed) {
      *agreed = true;
      if (group->sum(0, "the out-of-memory check of " + where) > 0) return false;
    }
    reducer_->arm();  // nothing to backpropagate: this rank sends zeros (and its temperature's share)
    if (zero3) reducer_->finish(step_ + 1);
  }
  return true;
}

StepStats Trainer::step(const std::vector<Batch>& window, bool resolve_now) {
  check_not_finished("step " + std::to_string(step_ + 1));
  const auto t0 = std::chrono::steady_clock::now();
  Group* group = cfg_.group.get();
  if (window.empty() && !group) throw Error("a window needs at least one micro-batch");
  StepStats s;
  // The window's item count over all ranks, before any backward: every
  // micro-batch's loss is divided by it, so the summed gradients equal the
  // full batch's whatever the split and the rank count.
  std::int64_t largest = 0;
  for (const auto& b : window) {
    if (b.empty()) throw Error("a micro-batch holds no tensors");
    s.items += model_->count_items(b);
    largest = std::max<std::int64_t>(largest, b.begin()->second.dim() ? b.begin()->second.size(0) : 1);
  }
  if (group) s.items = group->sum(s.items, "the item count of step " + std::to_string(step_ + 1));
  if (s.items <= 0)
    throw Error("step " + std::to_string(step_ + 1) + ": the window of " + std::to_string(window.size()) +
                " micro-batch" + (window.size() == 1 ? "" : "es") + " (" + (window.empty() ? "none" : describe(window.front())) +
                (window.size() > 1 ? ", ..." : "") +
                ") holds no items to learn from (every label masked, or samples of a single token): the data set "
                "should leave such samples out");
  const at::Device device(cfg_.device);
  model_->train(true);
  const auto opts = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor loss_sum;
  std::map<std::string, at::Tensor> metric_sums;
  // The random state at the window's start: a window redone after running out
  // of memory draws the same numbers again.
  std::vector<std::pair<at::Generator, at::Tensor>> rng;
  if (cfg_.split_on_oom)
    for (auto& [name, gen] : generators(device)) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      rng.emplace_back(gen, gen.get_state());
    }
  bool agreed_largest = false;
  for (;;) {
    clear_grads();
    loss_sum = at::Tensor();  // zero until a micro-batch adds to it
    metric_sums.clear();
    std::string oom;
    if (run_window(window, s, loss_sum, metric_sums, oom)) {
      if (!loss_sum.defined()) loss_sum = at::zeros({}, opts);  // no micro-batch here (a rank without data)
      break;
    }
    // Out of memory here or on another rank: free what the attempt held,
    // split every micro-batch in two and redo the window from its start.
    clear_grads();
    loss_sum = at::Tensor();
    metric_sums.clear();
    if (device.is_cuda()) cuda_empty_cache();
    // every rank decides alike (a rank with a short window, or none, would
    // stop while the others halve on)
    if (group && !agreed_largest) {
      const auto all = group->all_gather_ints({largest}, "the largest micro-batches of step " + std::to_string(step_ + 1));
      largest = *std::max_element(all.begin(), all.end());
      agreed_largest = true;
    }
    if ((largest + split_ - 1) / split_ <= 1)
      throw Error("step " + std::to_string(step_ + 1) + ": out of memory even at micro_batch 1 (halved " +
                  std::to_string(s.oom_retries) + " times to micro-batches of one sample)" +
                  (oom.empty() ? std::string(" on another rank") : ": " + oom) +
                  "; lower the memory the step needs (precision = \"bf16-mixed\", checkpointing = true, lora, a "
                  "shorter max_length or a smaller image_size) or raise the limit");
    split_ *= 2;
    ++s.oom_retries;
    for (auto& [gen, state] : rng) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
    }
  }
  s.split = split_;
  try {
    finish_step(s, loss_sum, metric_sums);
  } catch (const c10::OutOfMemoryError& e) {
    throw Error("step " + std::to_string(step_ + 1) + ": out of memory after the forward and backward passes (gradient "
                "reduction, unscaling, clipping or the optimizer step), which a smaller micro-batch does not help: " +
                e.what_without_backtrace() +
                "; the weights, gradients and optimizer state alone need more than there is: train fewer parameters "
                "(lora), keep them in bf16 (precision = \"bf16-true\") or raise the limit");
  }
  if (resolve_now) resolve(s);
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

void Trainer::finish_step(StepStats& s, at::Tensor& loss_sum, std::map<std::string, at::Tensor>& metric_sums) {
  Group* group = cfg_.group.get();
  const at::Device device(cfg_.device);
  const auto opts = at::TensorOptions().dtype(at::kDouble).device(device);
  for (const auto& [k, v] : metric_sums)
    if (std::find(metric_names_.begin(), metric_names_.end(), k) == metric_names_.end()) metric_names_.push_back(k);
  if (group) {
    if (partitioned()) check_gathers();  // each micro-batch finished its reduction
    else reducer_->finish(step_ + 1);
    if (sharded()) {
      // this rank's pieces take their reduced gradients (views of the chunks)
      const auto& pieces = reducer_->my_pieces();
      for (std::size_t i = 0; i < pieces.size(); ++i) {
        at::Tensor& p = stepped_[i].second;
        p.mutable_grad() = reducer_->piece_grad(pieces[i]).view(p.sizes());
      }
    }
  }
  // fp16: unscale the gradients and look for inf/nan (PyTorch's GradScaler
  // kernels), on the reduced ones: this rank's pieces when sharded
  at::Tensor found_inf;
  if (scaling()) {
    found_inf = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
    const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
    std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
    for (auto& [name, p] : stepped_)
      if (p.grad().defined()) by_dtype[p.grad().scalar_type()].push_back(p.mutable_grad());
    for (auto& [dtype, grads] : by_dtype) at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
  }
  // The gradient norm over what this rank holds: the whole gradient, or its
  // pieces, whose squares are summed over the ranks below. One multi-tensor
  // call for every gradient's norm, in fp32 whatever the gradients' dtype (a
  // fused kernel on CUDA; on a CPU it still saves a dispatch per tensor).
  at::Tensor local_norm;
  {
    at::NoGradGuard no_grad;
    if (cfg_.clip_grad_value > 0)
      for (auto& [name, p] : stepped_)
        if (p.grad().defined()) p.mutable_grad().clamp_(-cfg_.clip_grad_value, cfg_.clip_grad_value);
    std::vector<at::Tensor> grads;
    for (auto& [name, p] : stepped_)
      if (p.grad().defined()) grads.push_back(p.grad().detach());
    if (!grads.empty()) local_norm = at::stack(at::_foreach_norm(grads, 2, at::kFloat)).norm(2);
  }
  if (group) {
    // The loss and metric sums over all ranks, in one small all-reduce.
    // The stop flag and the overflow flag ride along, so every rank stops
    // after, and skips, the same steps.
    std::vector<at::Tensor> parts{loss_sum.reshape({1}), at::full({1}, interrupted() ? 1.0 : 0.0, opts),
                                  found_inf.defined() ? found_inf.to(at::kDouble).reshape({1}) : at::zeros({1}, opts)};
    // sharded: the squared norm of this rank's pieces, summed into the global one
    const std::int64_t first_metric = sharded() ? 4 : 3;
    if (sharded())
      parts.push_back(local_norm.defined() ? local_norm.to(at::kDouble).square().reshape({1}) : at::zeros({1}, opts));
    for (const auto& k : metric_names_) {
      auto it = metric_sums.find(k);
      parts.push_back(it == metric_sums.end() ? at::zeros({1}, opts) : it->second.reshape({1}));
    }
    std::vector<at::Tensor> packed{at::cat(parts)};
    group->all_reduce(packed, "the loss of step " + std::to_string(step_ + 1));
    loss_sum = packed[0][0];
    if (sharded()) local_norm = packed[0][3].sqrt().to(at::kFloat);
    // the stop and overflow flags: one read, which every rank needs now
    const at::Tensor flags = packed[0].slice(0, 1, 3).cpu();
    ++host_reads_;
    s.stop = flags[0].item<double>() > 0;
    s.skipped = flags[1].item<double>() > 0;
    for (std::size_t k = 0; k < metric_names_.size(); ++k)
      metric_sums[metric_names_[k]] = packed[0][static_cast<std::int64_t>(k) + first_metric];
  } else {
    s.stop = interrupted();
    if (found_inf.defined()) {
      // fp16: whether the optimizer steps depends on it (GradScaler reads it too)
      s.skipped = found_inf.item<float>() > 0;
      ++host_reads_;
    }
  }
  at::Tensor scale_used;
  if (scaling()) {
    scale_used = scale_.to(at::kDouble).reshape({1});  // a copy: the update below changes scale_
    if (cfg_.loss_scale.dynamic) {
      const at::Tensor agreed = at::full({}, s.skipped ? 1.0f : 0.0f, found_inf.options());
      at::_amp_update_scale_(scale_, growth_tracker_, agreed, cfg_.loss_scale.growth, cfg_.loss_scale.backoff,
                             cfg_.loss_scale.interval);
    }
  }
  // the global norm; clipping as torch.nn.utils.clip_grad_norm_ does
  at::Tensor grad_norm;
  if (local_norm.defined()) {
    at::NoGradGuard no_grad;
    grad_norm = local_norm.to(at::kDouble).reshape({1});
    if (cfg_.clip_grad_norm > 0 && !s.skipped) {
      at::Tensor coef = (cfg_.clip_grad_norm / (local_norm + 1e-6)).clamp_max(1.0);
      for (auto& [name, p] : stepped_)
        if (p.grad().defined()) p.mutable_grad().mul_(coef.to(p.grad().dtype()));
    }
  }
  const double factor = factor_at(step_);
  s.lr = optim_->base_lr() * factor;
  // parameter groups: each at its own base rate, scaled by the schedule
  auto* groups = dynamic_cast<ParamGroups*>(optim_.get());
  if (s.skipped) {
    ++skipped_;  // the window is consumed and the schedule moves on; the weights do not change
  } else {
    at::NoGradGuard no_grad;
    if (groups) groups->step_scaled(factor);
    else optim_->step(s.lr);
    if (divided_masters_ && partitioned()) {
      // ZeRO-3: this rank's masters rounded into its pieces of the weights,
      // gathered whole when their blocks next run
      const auto& pieces = reducer_->my_pieces();
      for (std::size_t i = 0; i < pieces.size(); ++i)
        reducer_->piece_view(pieces[i]).copy_(stepped_[i].second.detach().reshape({-1}));
    } else if (divided_masters_) {
      // every rank's updated masters, rounded into the weights as they arrive;
      // the average, kept in fp32, follows the masters as unsharded
      std::vector<at::Tensor> mine;
      for (auto& [name, p] : stepped_) mine.push_back(p.detach());
      const bool copy = step_ + 1 <= cfg_.ema_start;
      reducer_->gather_params(step_ + 1, &mine, [&](std::size_t k, const at::Tensor& master) {
        model_params_[k].copy_(master);
        if (k < ema_.size()) copy ? ema_[k].second.copy_(master) : ema_[k].second.lerp_(master, 1.0 - cfg_.ema);
      });
    } else {
      // every rank's updated pieces, everywhere (ZeRO-3: gathered when a block next runs)
      if (sharded() && !partitioned()) reducer_->gather_params(step_ + 1);
      if (cfg_.master_weights)
        for (std::size_t i = 0; i < model_params_.size(); ++i) model_params_[i].copy_(params_[i].second);
    }
  }
  if (groups)
    for (const auto& g : groups->groups()) s.group_lrs.emplace_back(g.log_name, g.optim->base_lr() * factor);
  ++step_;
  s.step = step_;
  if (!ema_.empty() && !s.skipped && (!divided_masters_ || divided_ema_)) update_ema();
  // The numbers stay on the device until resolve(): one read for many steps.
  if (!zero_.defined() || zero_.device() != device) zero_ = at::zeros({1}, opts);
  std::vector<at::Tensor> parts{loss_sum.to(at::kDouble).reshape({1}), grad_norm.defined() ? grad_norm : zero_,
                                scale_used.defined() ? scale_used : zero_};
  for (auto& [k, v] : metric_sums) {
    s.pending_metrics.push_back(k);
    parts.push_back(v.to(at::kDouble).reshape({1}));
  }
  s.pending = at::cat(parts);
  s.resolved = false;
  if (cfg_.empty_cache_every > 0 && step_ % cfg_.empty_cache_every == 0 && device.is_cuda()) cuda_empty_cache();
}

void Trainer::resolve(const std::vector<StepStats*>& steps) {
  std::vector<at::Tensor> parts;
  for (auto* s : steps)
    if (!s->resolved) parts.push_back(s->pending);
  if (parts.empty()) return;
  const at::Tensor all = at::cat(parts).cpu();
  ++host_reads_;
  const double* v = all.data_ptr<double>();
  for (auto* s : steps) {
    if (s->resolved) continue;
    const double inv_items = 1.0 / static_cast<double>(s->items);
    s->loss = v[0] * inv_items;
    s->grad_norm = v[1];
    s->loss_scale = v[2];
    for (std::size_t k = 0; k < s->pending_metrics.size(); ++k) s->metrics[s->pending_metrics[k]] = v[3 + k] * inv_items;
    v += 3 + s->pending_metrics.size();
    s->pending = at::Tensor();
    s->pending_metrics.clear();
    s->resolved = true;
  }
}

EvalStats evaluate(Model& model, std::shared_ptr<const Dataset> data, const EvalConfig& cfg) {
  LoaderConfig lc;
  lc.micro_batch = cfg.micro_batch;
  lc.shuffle = false;
  Loader loader(std::move(data), lc);
  const at::Device device(cfg.device);
  const bool was_training = model.is_training();
  model.train(false);
  at::NoGradGuard no_grad;
  EvalStats s;
  at::Tensor loss;
  std::map<std::string, at::Tensor> sums;
  std::int64_t index = 0;  // micro-batches so far, for messages
  std::int64_t cap = std::max<std::int64_t>(cfg.micro_batch, 1);  // samples a forward may take
  try {
    while (auto w = loader.next_window()) {
      for (const auto& b : *w) {
        ++index;
        // this micro-batch in parts of at most `cap` samples; a part that
        // runs out of memory halves the cap, down to one sample
        std::deque<Batch> todo{b};
        while (!todo.empty()) {
          const Batch piece = std::move(todo.front());
          todo.pop_front();
          const std::int64_t rows = piece.begin()->second.size(0);
          if (rows > cap) {
            auto parts = split_window({piece}, (rows + cap - 1) / cap);
            for (auto it = parts.rbegin(); it != parts.rend(); ++it) todo.push_front(std::move(*it));
            continue;
          }
          ForwardResult r;
          try {
            AutocastScope autocast(cfg.precision, device, cfg.autocast_cache);
            r = model.forward(to_device(piece, device));
          } catch (const c10::OutOfMemoryError& e) {
            const std::string what = cfg.where + ", micro-batch " + std::to_string(index) + " (" + describe(piece) +
                                     "): out of memory: " + e.what_without_backtrace();
            if (!cfg.split_on_oom) throw Error(what + " (recovery is off: on_oom = \"fail\")");
            if (rows <= 1)
              throw Error(cfg.where + ": out of memory even at micro-batch 1 (" + e.what_without_backtrace() +
                          "): one sample's forward does not fit; lower its memory (precision = \"bf16-mixed\", shorter inputs)");
            if (device.is_cuda()) cuda_empty_cache();
            ++s.oom_retries;
            cap = (rows + 1) / 2;
            todo.push_front(piece);
            continue;
          } catch (const c10::Error& e) {
            throw Error(cfg.where + ", micro-batch " + std::to_string(index) + ": the model's forward failed on " +
                        describe(piece) + ": " + e.what_without_backtrace());
          }
          add_to(loss, r.loss_sum.detach().to(at::kDouble).reshape({}));
          s.items += r.items;
          for (auto& [k, v] : r.metrics) add_to(sums[k], metric_value(v));
        }
      }
    }
  } catch (...) {
    model.train(was_training);
    throw;
  }
  model.train(was_training);
  s.split = (cfg.micro_batch + cap - 1) / cap;
  if (s.items > 0) {
    // one read for the whole evaluation
    std::vector<at::Tensor> parts{loss};
    for (auto& [k, v] : sums) parts.push_back(v.reshape({1}));
    parts[0] = parts[0].reshape({1});
    const at::Tensor host = at::cat(parts).to(at::kCPU);
    const double* p = host.data_ptr<double>();
    s.loss = p[0] / static_cast<double>(s.items);
    std::size_t i = 1;
    for (auto& [k, v] : sums) s.metrics[k] = p[i++] / static_cast<double>(s.items);
  }
  return s;
}

EvalStats Trainer::evaluate(std::shared_ptr<const Dataset> data, std::int64_t micro_batch) {
  check_not_finished("evaluation");
  EvalConfig ec;
  ec.micro_batch = micro_batch;
  ec.device = cfg_.device;
  ec.precision = cfg_.precision;
  ec.split_on_oom = cfg_.split_on_oom;
  ec.where = "evaluation after step " + std::to_string(step_);
  if (!partitioned()) return wick::evaluate(*model_, std::move(data), ec);
  // ZeRO-3: every rank evaluates the same batches, its blocks gathering their
  // weights as in training; halving a batch on one rank would unpair them
  ec.split_on_oom = false;
  ec.autocast_cache = false;
  {  // the same batches on every rank, or their gathers would not pair (a custom loop's data per rank)
    Group& group = *cfg_.group;
    const auto n = static_cast<std::int64_t>(data->size());
    const auto a = group.all_gather_ints({n}, "the sample counts of the " + ec.where);
    for (int r = 0; r < group.size(); ++r)
      if (a[static_cast<std::size_t>(r)] != n)
        throw Error(ec.where + ": rank " + std::to_string(r) + " evaluates " + std::to_string(a[static_cast<std::size_t>(r)]) +
                    " samples and rank " + std::to_string(group.rank()) + " " + std::to_string(data->size()) +
                    "; under shard = \"parameters\" every rank evaluates the same data (its blocks' gathers pair up)");
  }
  ReleaseUnits release{reducer_.get()};
  gather_root("the all-gather of the weights in no block, for the " + ec.where);
  return wick::evaluate(*model_, std::move(data), ec);
}

}  // namespace wick
