// The ranks joined: rank 0's weights everywhere, the gradient reducer, and
// under shard = "parameters" (ZeRO-3) the division of the weights (a
// deferred model made as it is divided) and its end (the weights gathered
// back into the model, or written to a file a unit at a time).
#include "train/trainer.hpp"

#include <ATen/ATen.h>

#include <cstdio>
#include <set>

#include "distributed/group.hpp"
#include "distributed/reducer.hpp"
#include "distributed/zero3.hpp"
#include "train/activation_checkpoint.hpp"
#include "train/deferred.hpp"
#include "train/trainer_internal.hpp"
#include "wick/kit/crc32c.hpp"
#include "wick/kit/deferral.hpp"
#include "wick/kit/nf4.hpp"
#include "wick/kit/weights.hpp"

namespace fs = std::filesystem;

namespace wick {
using namespace trainer_internal;

// Several ranks: rank 0's weights everywhere, the gradient reducer, and under
// shard the division of masters (ZeRO-1/2 with master_weights) or of the
// weights themselves (ZeRO-3).
void Trainer::join_ranks() {
  {  // Every rank starts from rank 0's weights. (Their detached handles
     // go here: kept, they would keep the storages ZeRO-3 replaces below.)
    // (a deferred model's hollow tensors are made alike on every rank: make_divided checks)
    std::vector<at::Tensor> state;
    for (auto& [name, t] : module_state(*model_))
      if (!is_hollow(t)) state.push_back(t.detach());
    if (cfg_.master_weights)
      for (auto& [name, p] : params_)
        if (!is_hollow(p)) state.push_back(p.detach());
    cfg_.group->broadcast(state, "broadcasting rank 0's initial weights");
  }
  {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < ema_.size(); ++i) ema_[i].second.copy_(params_[i].second);
  }
  // Sharded fp32 masters are divided: the reducer lays out shapes only (on
  // the meta device), each rank keeps its pieces' masters (below) and the
  // gathered updates go straight into the half-precision weights.
  sharded_masters_ = cfg_.master_weights && cfg_.shard != ShardMode::None && cfg_.group->size() > 1;
  const bool zero3 = cfg_.shard == ShardMode::Parameters && cfg_.group->size() > 1;
  // ZeRO-3 divides the model's own (half-precision) weights, whose
  // gradients it sums in fp32 with masters; the others lay out the masters'
  // shapes (divided) or what the optimizer steps
  std::vector<at::Tensor> trainable;
  for (std::size_t k = 0; k < params_.size(); ++k) {
    const at::Tensor& p = params_[k].second;
    trainable.push_back(zero3 && cfg_.master_weights ? model_params_[k]
                        : sharded_masters_ ? at::empty(p.sizes(), p.options().device(at::kMeta)).requires_grad_(true)
                                           : p);
  }
  // ZeRO-3 divides what takes no gradient too (a LoRA's base, QLoRA's 4-bit
  // codes): no rank keeps the whole model
  const NamedTensorList frozen = zero3 ? frozen_tensors() : NamedTensorList{};
  const Zero3Units z = zero3 ? zero3_units(params_, model_->blocks(), frozen) : Zero3Units{};
  root_unit_ = z.root;
  std::vector<std::vector<at::Tensor>> frozen_of_unit;
  for (const auto& unit : z.frozen) {
    std::set<const c10::TensorImpl*> seen;  // a tensor reached by two names is divided once
    auto& list = frozen_of_unit.emplace_back();
    for (auto k : unit)
      if (seen.insert(frozen[k].second.unsafeGetTensorImpl()).second) list.push_back(frozen[k].second);
  }
  // ZeRO-3 frees each unit's whole weights as soon as this rank's chunks are
  // taken (the division holds the model and one unit, not 1.5 models), so a
  // failure from here on loses them, and the model says so when read
  if (zero3)
    mark_partitioned(model_, "its trainer failed while dividing its weights across the ranks (shard = "
                             "\"parameters\"): they are lost in this process; build or load the model again");
  try {
    reducer_ = std::make_unique<GradReducer>(cfg_.group, trainable, cfg_.bucket_mb, cfg_.shard, z.units,
                                             zero3 && cfg_.master_weights ? at::kFloat : at::ScalarType::Undefined,
                                             frozen_of_unit, /*free_as_divided=*/zero3);
  } catch (...) {
    // a unit that cannot be laid out is refused before any weight moves
    if (zero3 && !weights_moved(trainable, frozen_of_unit)) mark_partitioned(model_, "");
    throw;
  }
  if (partitioned()) {
    // model_ shares each parameter's TensorImpl, so a tensor reached by two
    // names (tied) is one unit's or the run reads it freed
    check_tied_units(params_, z, frozen);
    partition_runner_ = std::make_unique<PartitionRunner>(reducer_.get(), z.unit_of_block, block_runner_.get());
    model_->set_block_runner(partition_runner_.get());
  }
  if (!sharded_masters_) return;
  for (const auto& piece : reducer_->my_pieces()) {  // this rank's masters, copied out of the whole ones
    const at::Tensor p = params_[piece.param].second.detach();
    if (is_hollow(p))  // deferred: make_divided fills it
      stepped_.emplace_back(params_[piece.param].first, piece.numel == p.numel() ? at::zeros(p.sizes(), p.options())
                                                                                : at::zeros({piece.numel}, p.options()));
    else
      stepped_.emplace_back(params_[piece.param].first, piece.numel == p.numel()
                                                            ? p.clone()
                                                            : p.reshape({-1}).narrow(0, piece.start, piece.numel).clone());
  }
  // the whole ones go (ZeRO-3 keeps their shapes: the reducer holds the model's weights)
  for (std::size_t k = 0; k < params_.size(); ++k)
    params_[k].second = zero3 ? at::empty(params_[k].second.sizes(), params_[k].second.options().device(at::kMeta))
                              : trainable[k];
}

// Whether the division began: a tensor given to the reducer lost its storage
// (a deferred one had none).
bool Trainer::weights_moved(const std::vector<at::Tensor>& trainable,
                            const std::vector<std::vector<at::Tensor>>& frozen) const {
  auto freed = [this](const at::Tensor& t) { return is_hollow(t) && !hollow_.count(t.unsafeGetTensorImpl()); };
  for (const auto& t : trainable)
    if (freed(t)) return true;
  for (const auto& unit : frozen)
    for (const auto& t : unit)
      if (freed(t)) return true;
  return false;
}

// A deferred model's values, made one tensor at a time (wick::Deferred): this
// rank keeps its chunks of each (GradReducer::fill) and its pieces of the
// fp32 masters, so no rank holds the whole model. Every rank makes the same
// values (the same random states or files): a digest of each value's first
// bytes is compared across the ranks.
void Trainer::make_divided() {
  std::map<const c10::TensorImpl*, std::vector<std::size_t>> masters;  // a parameter's pieces in stepped_
  if (sharded_masters_) {
    const auto& mine = reducer_->my_pieces();
    for (std::size_t i = 0; i < mine.size(); ++i)
      masters[model_params_[mine[i].param].unsafeGetTensorImpl()].push_back(i);
  }
  std::set<const c10::TensorImpl*> made;
  std::uint32_t digest = 0;
  auto digest_head = [&digest](const at::Tensor& value) {
    const at::Tensor head = value.contiguous().reshape({-1}).narrow(0, 0, std::min<std::int64_t>(value.numel(), 1024));
    digest = crc32c(head.data_ptr(), static_cast<std::size_t>(head.nbytes()), digest);
  };
  at::NoGradGuard no_grad;
  Emit emit(
      [&](const at::Tensor& t, const at::Tensor& value) {
        const auto* impl = t.unsafeGetTensorImpl();
        if (auto host = host_tables_.find(impl); host != host_tables_.end()) {
          // offload_embeddings: a table kept whole in host memory, never divided
          at::Tensor made_there = host_table(value.to(t.scalar_type()), host->second);
          host_data_[impl] = made_there.data_ptr();
          t.set_data(made_there);
          digest_head(value);
          made.insert(impl);
          return;
        }
        if (!reducer_->fill(t, value))
          throw Error("wick.train: the deferred model made a value for a tensor of shape " + c10::str(t.sizes()) +
                      " that is not its own (a model plugin's materialize must give only its parameters and buffers)");
        if (auto it = masters.find(impl); it != masters.end())
          for (auto i : it->second) {  // (copy_ converts this piece alone)
            const auto& piece = reducer_->my_pieces()[i];
            stepped_[i].second.reshape({-1}).copy_(value.reshape({-1}).narrow(0, piece.start, piece.numel));
          }
        digest_head(value);
        made.insert(impl);
      },
      // a 4-bit weight: this rank quantizes only what its chunks come from
      [&](const Nf4Weight& hollow, const at::Tensor& w) {
        if (!fill_nf4(*reducer_, *cfg_.group, hollow, w))
          throw Error("wick.train: the deferred model made a 4-bit weight of shape " + c10::str(w.sizes()) +
                      " whose tensors are not its own (a model plugin's materialize must give only its buffers)");
        digest_head(w);
        for (const auto& t : {hollow.packed, hollow.absmax_q, hollow.absmax_scale, hollow.absmax_offset})
          made.insert(t.unsafeGetTensorImpl());
      });
  run_deferred(*model_, emit);
  for (const auto& [impl, name] : hollow_)
    if (!made.count(impl))
      throw Error("wick.train: the model's deferred build made no value for " + name +
                  " (a model plugin's materialize must give every hollow tensor one)");
  char hex[16];
  std::snprintf(hex, sizeof hex, "%08x", digest);
  cfg_.group->check_same("deferred model (made from the random state before wick.model, or from a folder: seed "
                         "every rank alike)",
                         hex);
  hollow_.clear();
}

// The model's tensors that take no gradient and hold data: its frozen
// parameters and its buffers, by name (a tied one under each of its names).
std::vector<std::pair<std::string, at::Tensor>> Trainer::frozen_tensors() const {
  std::set<const c10::TensorImpl*> trainable;
  for (const auto& p : model_params_) trainable.insert(p.unsafeGetTensorImpl());
  NamedTensorList out;
  for (auto& [name, t] : module_state(*model_))
    if (t.defined() && !t.is_meta() && t.numel() > 0 && !trainable.count(t.unsafeGetTensorImpl()) &&
        !host_tables_.count(t.unsafeGetTensorImpl()))  // offload_embeddings: each rank keeps its table whole
      out.emplace_back(name, t);
  return out;
}

void Trainer::gather_weights_back() {
  if (!partitioned() || gathered_back_) return;
  try {
    reducer_->gather_all("gathering the trained weights at the end of the run", /*last=*/true);
  } catch (...) {
    mark_partitioned(model_, "the trained weights could not be gathered at the end of the run (shard = "
                             "\"parameters\"); load the last checkpoint");
    gathered_back_ = true;
    throw;
  }
  end_divided();
}

// The end of a divided run: no unit is gathered or freed any more, and the
// model runs its blocks as before the trainer divided them (the partition
// runner would free each block's weights after it ran).
void Trainer::end_divided() {
  gathered_back_ = true;
  if (model_->block_runner() == partition_runner_.get()) model_->set_block_runner(block_runner_.get());
  mark_partitioned(model_, "");
}

void Trainer::drop_weights_back(const std::set<const c10::TensorImpl*>& keep) {
  if (!partitioned() || gathered_back_) return;
  std::map<std::string, at::Tensor> kept;
  {
    ReleaseUnits release{reducer_.get()};
    reducer_->release_all();
    std::string error;
    const PutTensor put = [&](const std::string& name, const at::Tensor& t) {
      if (keep.count(t.unsafeGetTensorImpl())) kept[name] = t.detach().clone();
    };
    stream_divided_weights(&put, error);
  }
  end_divided();
  for (const auto& [name, t] : module_state(*model_))
    if (auto it = kept.find(name); it != kept.end()) t.set_data(it->second);
}

void Trainer::write_weights_back(const fs::path& file) {
  if (!partitioned()) {
    if (!cfg_.group || cfg_.group->rank() == 0) save_model(*model_, file);
    return;
  }
  if (gathered_back_) throw std::logic_error("write_weights_back after the weights were gathered back");
  ReleaseUnits release{reducer_.get()};
  reducer_->release_all();
  const bool writer = cfg_.group->rank() == 0;
  std::string error;
  bool streamed = false;
  if (writer) try {
      write_divided_weights(file, error, streamed);
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
    }
  if (!streamed) stream_divided_weights(nullptr, error);  // the gathers rank 0's write makes
  // whether rank 0 wrote the file: every rank's model reads it from now on
  at::Tensor ok = at::full({1}, error.empty() ? 1.0f : 0.0f, at::TensorOptions().device(cfg_.group->device()));
  std::vector<at::Tensor> flag{ok};
  cfg_.group->broadcast(flag, "waiting for rank 0 to write " + file.string());
  end_divided();
  if (flag[0].item<float>() == 0.0f) {
    mark_partitioned(model_, "rank 0 could not write its trained weights to " + file.string() +
                                 " at the end of the run (return_weights = \"file\"); load the last checkpoint");
    throw Error(writer ? "writing the trained weights to " + file.string() + ": " + error
                       : "rank 0 could not write the trained weights to " + file.string());
  }
  defer_to_file(model_, file);
}

}  // namespace wick
