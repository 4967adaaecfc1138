#include "train/trainer.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <ATen/ops/_foreach_norm.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "distributed/group.hpp"
#include "distributed/reducer.hpp"
#include "distributed/zero3.hpp"
#include "train/activation_checkpoint.hpp"
#include "train/deferred.hpp"
#include "train/device_feed.hpp"
#include "train/param_groups.hpp"
#include "train/run_options.hpp"
#include "train/trainer_internal.hpp"
#include "util/system.hpp"
#include "wick/kit/deferral.hpp"
#include "wick/kit/safetensors.hpp"
#include "wick/kit/weights.hpp"

namespace fs = std::filesystem;

namespace wick {
using namespace trainer_internal;

namespace trainer_internal {

std::vector<std::pair<std::string, at::Generator>> generators(const at::Device& device) {
  std::vector<std::pair<std::string, at::Generator>> g{{"cpu", at::detail::getDefaultCPUGenerator()}};
  if (device.is_cuda()) g.emplace_back("cuda", at::globalContext().defaultGenerator(device));
  return g;
}

RngState rng_state(const at::Device& device) {
  RngState out;
  for (auto& [name, gen] : generators(device)) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.emplace_back(gen, gen.get_state());
  }
  return out;
}

void set_rng_state(const RngState& state) {
  for (auto [gen, s] : state) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(s);
  }
}

std::string step_dir_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

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

std::int64_t bytes_of(const at::Tensor& t) { return t.defined() ? static_cast<std::int64_t>(t.nbytes()) : 0; }

void add_to(at::Tensor& sum, const at::Tensor& x) { sum = sum.defined() ? sum + x : x; }

at::Tensor metric_value(const at::Tensor& v) {
  at::Tensor d = v.detach().to(at::kDouble);
  return d.numel() == 1 ? d.reshape({}) : d.sum();
}

}  // namespace trainer_internal

std::string describe(const Batch& b) {
  std::string s = "{";
  for (const auto& [k, v] : b) {
    std::ostringstream o;
    o << (s.size() > 1 ? ", " : "") << k << " " << c10::toString(v.scalar_type()) << " " << v.sizes();
    s += o.str();
  }
  return s + "}";
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
  check_config();
  choose_host_tables();
  const at::Device device(cfg_.device);
  // a deferred model (built without its weights) is made as it is divided
  // when the weights are (ZeRO-3 on several ranks; make_divided), else whole here
  if (is_deferred(*model_)) {
    if (cfg_.group && cfg_.group->size() > 1 && cfg_.shard == ShardMode::Parameters) {
      for (const auto& [name, t] : module_state(*model_))
        if (is_hollow(t)) hollow_.emplace(t.unsafeGetTensorImpl(), name);
    } else {
      materialize_whole(*model_, "wick.train", !cfg_.quiet_deferred);
    }
  }
  std::map<std::string, at::Tensor> originals;  // the trainable weights before rounding, for the masters
  if (cfg_.master_weights)
    for (const auto& p : model_->named_parameters(/*recurse=*/true))
      if (p.value().requires_grad() && at::isFloatingType(p.value().scalar_type()))
        originals[p.key()] = is_hollow(p.value())
                                 ? moved(p.value(), at::kFloat, device)
                                 : p.value().detach().to(device, at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  to_half_precision(*model_, cfg_.precision);
  move_hollow(*model_, device);
  {
    // offload_embeddings: the tables go to host memory, never through the device
    const auto kept = tables_to_host();
    try {
      model_->to(device);
    } catch (...) {
      for (const auto& [table, host] : kept) table.set_data(host);
      return_tables();
      throw;
    }
    for (const auto& [table, host] : kept) table.set_data(host);
  }
  // a failure from here on (the constructor's end runs no destructor) puts
  // them back where the model's other weights are, as the end of a run does
  struct TablesBackOnThrow {
    Trainer* t;
    bool done = false;
    ~TablesBackOnThrow() {
      if (!done) t->return_tables();
    }
  } tables_back{this};
  if (device.is_cuda() && cfg_.memory_fraction > 0)
    cuda_set_memory_fraction(cfg_.memory_fraction, device.index() < 0 ? 0 : device.index());
  set_checkpointing();
  for (const auto& p : model_->named_parameters(/*recurse=*/true))
    if (p.value().requires_grad()) {
      model_params_.push_back(p.value());
      at::Tensor stepped = p.value();
      if (cfg_.master_weights) {
        auto it = originals.find(p.key());
        stepped = (it != originals.end() ? it->second : moved(p.value().detach(), at::kFloat)).requires_grad_(true);
      }
      params_.emplace_back(p.key(), stepped);
    }
  originals.clear();
  if (params_.empty()) throw Error("the model has no trainable parameters");
  // ZeRO-3 keeps the average divided as the weights are: made below, from this rank's pieces
  sharded_ema_ = cfg_.ema > 0 && cfg_.group && cfg_.group->size() > 1 && cfg_.shard == ShardMode::Parameters;
  if (cfg_.ema > 0 && !sharded_ema_) {
    // the average starts at the weights the run starts from (rank 0's, after the broadcast below)
    at::NoGradGuard no_grad;
    for (auto& [name, p] : params_)
      ema_.emplace_back(name, p.detach().to(device, at::kFloat, /*non_blocking=*/false, /*copy=*/true));
  }
  if (scaling()) {
    scale_ = at::full({}, cfg_.loss_scale.init, at::TensorOptions().dtype(at::kFloat).device(device));
    growth_tracker_ = at::zeros({}, at::TensorOptions().dtype(at::kInt).device(device));
  }
  if (cfg_.group && cfg_.shard != ShardMode::None) check_shardable_optimizer();
  if (cfg_.group) join_ranks();
  if (!hollow_.empty()) make_divided();
  attach_optimizer();
  if (sharded_ema_) {
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
  tables_back.done = true;
}

// The objects, then the configuration through wick.train's schema (one
// implementation of its ranges and rules): wick.train and wick.trainer checked
// their options already, a TrainerConfig built in C++ (the tests', a custom
// host's) is checked here.
void Trainer::check_config() const {
  if (!model_) throw Error("wick.train: 'model' is required");
  if (!optim_) throw Error("wick.train: 'optim' is required");
  if (const std::string why = weights_partitioned(*model_); !why.empty())
    throw Error("wick.train: the model cannot be trained: " + why);
  check_trainer_config(cfg_);
}

// Activation checkpointing of the blocks the model declares.
void Trainer::set_checkpointing() {
  const auto blocks = model_->blocks();
  std::set<std::string> chosen;
  const auto& ck = cfg_.checkpointing;
  if (ck.mode != CheckpointingConfig::Mode::None && blocks.empty())
    throw Error("checkpointing: the model declares no blocks to checkpoint");
  if (ck.mode == CheckpointingConfig::Mode::All) chosen.insert(blocks.begin(), blocks.end());
  // (k >= 1, and offload_activations only with blocks chosen: check_config has checked both)
  if (ck.mode == CheckpointingConfig::Mode::EveryK)
    for (std::size_t i = 0; i < blocks.size(); i += static_cast<std::size_t>(ck.k)) chosen.insert(blocks[i]);
  if (ck.mode == CheckpointingConfig::Mode::Names)
    for (const auto& n : ck.names) {
      if (std::find(blocks.begin(), blocks.end(), n) == blocks.end()) {
        std::string known;
        for (const auto& b : blocks) known += (known.empty() ? "" : ", ") + b;
        throw Error("checkpointing: the model has no block '" + n + "' (its blocks: " + known + ")");
      }
      chosen.insert(n);
    }
  if (!chosen.empty()) block_runner_ = std::make_unique<CheckpointRunner>(chosen, ck.offload);
  model_->set_block_runner(block_runner_.get());
}

// The optimizer takes what it steps: every trainable tensor, or (sharded)
// this rank's pieces of them.
void Trainer::attach_optimizer() {
  if (!sharded()) {
    stepped_ = params_;
    optim_->attach(params_);
    return;
  }
  // this rank's pieces: a whole parameter as itself (its shape kept), a
  // split one as a flat view of its part; both share the weights' storage
  // (divided masters: tensors of their own, made by join_ranks)
  std::vector<std::int64_t> whole;
  for (const auto& piece : reducer_->my_pieces()) {
    const auto& [name, p] = params_[piece.param];
    if (sharded_masters_) {
      // made by join_ranks
    } else if (partitioned()) {  // its pieces are the weights: tensors of their own
      stepped_.emplace_back(name, piece.numel == p.numel() ? reducer_->piece_view(piece).view(p.sizes())
                                                           : reducer_->piece_view(piece));
    } else {
      stepped_.emplace_back(name, piece.numel == p.numel() ? p.detach() : reducer_->piece_view(piece));
    }
    whole.push_back(p.numel());
  }
  optim_->attach_shard(stepped_, whole);
}

// Pieces only to an optimizer that updates them as it would the whole:
// checked before the ranks divide anything (ZeRO-3 would lose the weights).
void Trainer::check_shardable_optimizer() const {
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
}

Trainer::~Trainer() {
  // the model may outlive this trainer (and be trained by another)
  if (model_ && (model_->block_runner() == block_runner_.get() || model_->block_runner() == partition_runner_.get()))
    model_->set_block_runner(nullptr);
  // offload_embeddings held the tables in host memory for this run: they go
  // back beside the model's other weights, where a run without it leaves them
  if (model_) return_tables();
  // ZeRO-3 without gather_weights_back(): a run that failed (a collective
  // here could wait on ranks gone or elsewhere), and the model says so when read
  if (partitioned() && !gathered_back_)
    mark_partitioned(model_, "its trainer ended while its weights were divided across the ranks (shard = "
                             "\"parameters\": a run that failed, or a custom loop that did not call trainer:finish() "
                             "on every rank): they are lost in this process; load the last checkpoint");
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

std::map<std::string, std::int64_t> Trainer::memory_breakdown() const {
  std::int64_t weights = 0, grads = 0, opt = 0, trainable = 0, host_weights = 0;
  std::set<const c10::TensorImpl*> counted;  // a tied tensor once
  for (const auto& [name, t] : module_state(*model_))
    if (counted.insert(t.unsafeGetTensorImpl()).second) {
      auto host = host_data_.find(t.unsafeGetTensorImpl());
      (host != host_data_.end() && t.data_ptr() == host->second ? host_weights : weights) += bytes_of(t);
    }
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
    for (const auto& [name, p] : sharded_masters_ ? stepped_ : params_) master += bytes_of(p);
  }
  return {{"weights", weights + master},
          {"master_weights", master},
          {"gradients", grads},
          {"optimizer", opt},
          {"ema", ema},
          {"trainable", trainable},
          // offload_embeddings: the tables held in host memory, not on the device
          {"host_weights", host_weights},
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
      fold_grads();  // as a window does after each backward
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
  unalias_grads();
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

// PyTorch's AccumulateGrad keeps an arriving gradient as the parameter's
// grad, without a copy, when no other tensor object holds it, even a view
// whose memory another parameter's gradient shares: a class token and a
// position table added to one frame's patches (a batch of one) got two views
// of one buffer. The next micro-batch's accumulation in place, clipping's
// scale or a reduction would then write both (a ViT's cls token trained
// apart at micro-batch 1 and 4). A gradient that shares memory with an
// earlier parameter's gets its own copy: a look per parameter, a copy only
// where they share.
void Trainer::unalias_grads() {
  at::NoGradGuard no_grad;
  std::set<const c10::StorageImpl*> seen;
  for (auto& p : model_params_) {
    if (!p.defined()) continue;
    at::Tensor& g = p.mutable_grad();
    if (!g.defined() || !g.has_storage()) continue;
    if (!seen.insert(g.storage().unsafeGetStorageImpl()).second) g = at::empty_like(p).copy_(g);
  }
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
  const RngState rng = cfg_.split_on_oom ? rng_state(device) : RngState();
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
    set_rng_state(rng);
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

// After the window: gradients reduced and unscaled, flags agreed over the
// ranks, the norm clipped, the optimizer's step, the average; the step's
// numbers stay on the device until resolve().
void Trainer::finish_step(StepStats& s, at::Tensor& loss_sum, std::map<std::string, at::Tensor>& metric_sums) {
  RECORD_USER_SCOPE("wick::optimizer");
  const at::Device device(cfg_.device);
  for (const auto& [k, v] : metric_sums)
    if (std::find(metric_names_.begin(), metric_names_.end(), k) == metric_names_.end()) metric_names_.push_back(k);
  if (cfg_.group) take_reduced_gradients();
  // fp16: unscale the gradients and look for inf/nan (PyTorch's GradScaler
  // kernels), on the reduced ones: this rank's pieces when sharded
  at::Tensor found_inf;
  if (scaling()) found_inf = unscale_gradients(stepped_, scale_);
  at::Tensor local_norm = clamped_local_norm();
  agree_step(s, loss_sum, metric_sums, found_inf, local_norm);
  at::Tensor scale_used;
  if (scaling()) {
    scale_used = scale_.to(at::kDouble).reshape({1});  // a copy: the update below changes scale_
    update_loss_scale(scale_, growth_tracker_, s.skipped, cfg_.loss_scale);
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
    round_into_weights();
  }
  if (groups)
    for (const auto& g : groups->groups()) s.group_lrs.emplace_back(g.log_name, g.optim->base_lr() * factor);
  ++step_;
  s.step = step_;
  if (!ema_.empty() && !s.skipped && (!sharded_masters_ || sharded_ema_)) update_ema();
  // The numbers stay on the device until resolve(): one read for many steps.
  const auto opts = at::TensorOptions().dtype(at::kDouble).device(device);
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


// Several ranks: the window's reduction finished (ZeRO-3: checked, each
// micro-batch finished its own) and, sharded, this rank's pieces given their
// reduced gradients (views of the chunks).
void Trainer::take_reduced_gradients() {
  if (partitioned()) check_gathers();
  else reducer_->finish(step_ + 1);
  if (!sharded()) return;
  const auto& pieces = reducer_->my_pieces();
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    at::Tensor& p = stepped_[i].second;
    p.mutable_grad() = reducer_->piece_grad(pieces[i]).view(p.sizes());
  }
}

// The gradient norm over what this rank holds (after clip_grad_value): the
// whole gradient, or its pieces, whose squares are summed over the ranks in
// agree_step. One multi-tensor call for every gradient's norm, in fp32
// whatever the gradients' dtype (a fused kernel on CUDA; on a CPU it still
// saves a dispatch per tensor). Undefined when no gradient is.
at::Tensor Trainer::clamped_local_norm() {
  at::NoGradGuard no_grad;
  if (cfg_.clip_grad_value > 0)
    for (auto& [name, p] : stepped_)
      if (p.grad().defined()) p.mutable_grad().clamp_(-cfg_.clip_grad_value, cfg_.clip_grad_value);
  std::vector<at::Tensor> grads;
  for (auto& [name, p] : stepped_)
    if (p.grad().defined()) grads.push_back(p.grad().detach());
  return grads.empty() ? at::Tensor() : at::stack(at::_foreach_norm(grads, 2, at::kFloat)).norm(2);
}

// The stop and overflow flags (s.stop, s.skipped) and, over several ranks,
// the loss and metric sums and a sharded norm summed in one small all-reduce,
// so that every rank stops after, and skips, the same steps.
void Trainer::agree_step(StepStats& s, at::Tensor& loss_sum, std::map<std::string, at::Tensor>& metric_sums,
                         const at::Tensor& found_inf, at::Tensor& local_norm) {
  Group* group = cfg_.group.get();
  const auto opts = at::TensorOptions().dtype(at::kDouble).device(at::Device(cfg_.device));
  if (group) {
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
}

// The optimizer stepped: its updates into the model's weights where it
// stepped something else (fp32 masters, this rank's pieces).
void Trainer::round_into_weights() {
  if (sharded_masters_ && partitioned()) {
    // ZeRO-3: this rank's masters rounded into its pieces of the weights,
    // gathered whole when their blocks next run
    const auto& pieces = reducer_->my_pieces();
    for (std::size_t i = 0; i < pieces.size(); ++i)
      reducer_->piece_view(pieces[i]).copy_(stepped_[i].second.detach().reshape({-1}));
  } else if (sharded_masters_) {
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

}  // namespace wick
