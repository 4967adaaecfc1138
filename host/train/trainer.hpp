#pragma once
// The training engine: one optimizer step per window of micro-batches, with
// the loss normalised by the window's item count known before the first
// backward, so gradients equal those of one full batch whatever the split.

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "distributed/reducer.hpp"
#include "train/precision.hpp"
#include "train/partition.hpp"
#include "wick/data.hpp"
#include "wick/model.hpp"
#include "wick/optim.hpp"

namespace wick {

class CheckpointRunner;
struct WindowPass;
class Group;
class GradReducer;

/// Which declared blocks to checkpoint: none, all, every k-th, or by name.
struct CheckpointingConfig {
  enum class Mode { None, All, EveryK, Names } mode = Mode::None;
  std::int64_t k = 1;
  std::vector<std::string> names;
  bool offload = false;  // the checkpointed blocks' inputs wait in host memory
};

struct TrainerConfig {
  double clip_grad_norm = 0;      // 0: no clipping (the norm is still measured)
  double clip_grad_value = 0;     // 0: off; else gradients clamped to [-v, v] (after unscaling)
  Precision precision = Precision::FP32;
  LossScaleConfig loss_scale;
  CheckpointingConfig checkpointing;
  /// Out of memory inside a window: true splits every micro-batch in two
  /// (accumulating twice as many) and redoes the window from its start.
  bool split_on_oom = true;
  std::int64_t empty_cache_every = 0;  // CUDA: release cached blocks every N steps (0: never)
  double memory_fraction = 0;          // CUDA: cap this process's share of the device (0: no cap)
  std::int64_t total_steps = 0;   // for the schedule
  std::string device = "cpu";
  std::shared_ptr<Group> group;   // several ranks: items, gradients and stats are summed over them
  double bucket_mb = 25;          // gradient all-reduce bucket size
  /// false: gradients cross ranks once per window, with the last backward.
  /// true: after every micro-batch, as DDP does without no_sync (the same
  /// result, more traffic; kept to measure what the default saves).
  bool sync_every_micro_batch = false;
  /// Several ranks: partition the optimizer state (ZeRO-1) or the optimizer
  /// state and the reduced gradients (ZeRO-2) across them; each rank steps
  /// its pieces and the updated weights are all-gathered. Or the weights too
  /// (ZeRO-3, Parameters): each rank keeps its pieces of them, and a block's
  /// whole weights exist only while it computes. One rank: no effect.
  ShardMode shard = ShardMode::None;
  /// bf16-true / fp16-true only: the optimizer steps fp32 copies of the
  /// trainable weights, whose fp32 gradients sum every micro-batch's; the
  /// model's half-precision weights are rounded from them after each step.
  bool master_weights = false;
  /// A model built deferred and not divided here is made whole without the
  /// note on stderr (wick plan's rows, which make it again each row).
  bool quiet_deferred = false;
  /// An exponential moving average of the trainable weights, in fp32, updated
  /// after every optimizer step: ema = decay * ema + (1 - decay) * weight,
  /// from step ema_start on (before it, a copy of the weights). 0: none.
  double ema = 0;
  std::int64_t ema_start = 0;
  /// The model's frozen input embedding tables (wick::HostLookups) stay in
  /// host memory; their lookups run there and only the rows reach the device.
  bool offload_embeddings = false;
};

struct StepStats {
  std::int64_t step = 0;          // optimizer steps taken, this one included
  double loss = 0;                // sum of item losses / items, over the window
  std::int64_t items = 0;
  std::int64_t micro_batches = 0;
  double lr = 0;
  std::vector<std::pair<std::string, double>> group_lrs;  // parameter groups: each group's lr ("lr_<name>")
  double grad_norm = 0;           // before clipping, after unscaling
  bool skipped = false;           // fp16: inf/nan gradients on some rank, the optimizer did not step
  double loss_scale = 0;          // fp16: the scale this step's loss was multiplied by (0: no scaling)
  std::int64_t split = 1;         // micro-batches are split in this many parts (out-of-memory recovery)
  std::int64_t oom_retries = 0;   // times this window was redone after running out of memory
  std::map<std::string, double> metrics;  // metric sums / items
  double seconds = 0;
  bool stop = false;              // SIGINT/SIGTERM reached this or any other rank
  /// loss, grad_norm, loss_scale and metrics are read from the device only
  /// when asked (Trainer::resolve): until then they sit in `pending`
  /// (float64: loss sum, norm, scale, then the metric sums in
  /// `pending_metrics` order) and `resolved` is false.
  bool resolved = true;
  at::Tensor pending;
  std::vector<std::string> pending_metrics;
};

struct EvalStats {
  double loss = 0;
  std::int64_t items = 0;
  std::map<std::string, double> metrics;
  std::int64_t oom_retries = 0;  // micro-batches halved after running out of memory
  std::int64_t split = 1;        // micro-batches were cut in this many parts at the end
};

/// How evaluation runs: the training run passes its own micro-batch,
/// precision and out-of-memory policy (Trainer::evaluate).
struct EvalConfig {
  std::int64_t micro_batch = 32;
  std::string device = "cpu";
  Precision precision = Precision::FP32;  // autocast for the mixed modes; true modes are the weights' dtype
  bool split_on_oom = true;               // halve a micro-batch that runs out of memory, down to one sample
  std::string where = "evaluation";       // error messages start with this
  bool autocast_cache = true;              // false: no half-precision weight copies kept through a forward (ZeRO-3)
};

/// Master weights ride in optimizer.safetensors under this prefix (and the
/// weights' average under "wick.ema/").
inline const std::string kMasterPrefix = "wick.master/";
inline const std::string kEmaPrefix = "wick.ema/";


class Trainer {
 public:
  Trainer(std::shared_ptr<Model> model, std::shared_ptr<Optimizer> optim,
          std::shared_ptr<Schedule> schedule, TrainerConfig cfg);
  ~Trainer();

  /// One optimizer step over `window` (its micro-batches in order). With
  /// several ranks a window may be empty on some: that rank contributes zero.
  /// `resolve_now = false` leaves its numbers on the device until resolve()
  /// (one read for many steps; the engine's run does this).
  StepStats step(const std::vector<Batch>& window, bool resolve_now = true);
  /// Reads the pending numbers of `steps` from the device in one copy.
  void resolve(const std::vector<StepStats*>& steps);
  void resolve(StepStats& s) { resolve(std::vector<StepStats*>{&s}); }
  /// Reads from the device to the host (.item(), copies) that step() and
  /// resolve() made: on a GPU each one waits for the queued work.
  std::int64_t host_reads() const { return host_reads_; }

  std::int64_t steps() const { return step_; }
  /// The rank group (nullptr for one process).
  Group* group() const { return cfg_.group.get(); }
  /// The schedule's multiplier at optimizer step `step` (1 without a schedule), and the default group's lr.
  double factor_at(std::int64_t step) const;
  double lr_at(std::int64_t step) const;
  const TrainerConfig& config() const { return cfg_; }
  Model& model() { return *model_; }
  std::int64_t skipped_steps() const { return skipped_; }
  double loss_scale() const;
  std::int64_t split() const { return split_; }
  /// The checkpointed blocks, in the model's order.
  std::vector<std::string> checkpointed_blocks() const;

  /// Forward and backward of one micro-batch, `times` times in a row without
  /// an optimizer step, from no gradients to none: for probing memory (a
  /// second pass holds the first's gradients, as accumulation does). Throws
  /// c10::OutOfMemoryError when it does not fit.
  void probe(const Batch& batch, int times = 1);

  /// Loss and metrics over all of `data` without gradients, under the
  /// training precision and out-of-memory policy.
  EvalStats evaluate(std::shared_ptr<const Dataset> data, std::int64_t micro_batch);

  /// The averaged weights (ema), by name: fp32, one per trainable parameter.
  /// (ZeRO-3: on every rank, one without pieces of its own too)
  bool has_ema() const { return !ema_.empty() || sharded_ema_; }
  /// ZeRO-3: the weights themselves divided (shard = "parameters" on several ranks).
  bool partitioned() const { return reducer_ && reducer_->partitioned(); }
  const std::vector<std::pair<std::string, at::Tensor>>& ema() const { return ema_; }
  /// Runs `fn` with the averaged weights in the model, then puts the trained
  /// ones back (a copy of the trainable weights held meanwhile).
  void with_ema(const std::function<void()>& fn);
  /// Writes the model's state with the averaged weights in place of the
  /// trainable ones (fp32), loadable by Model::load.
  void save_ema(const std::filesystem::path& file);

  /// shard = "parameters": the whole weights back in the model, gathered by
  /// every rank at once (the run's end; each rank calls it at the same
  /// point). Until then, and for good if the trainer ends without it, reading
  /// the model is refused by name (train/partition.hpp). Else nothing.
  void gather_weights_back();
  /// shard = "parameters": the end of write_weights_back (every unit gathered
  /// in turn and released), with nothing written: of the divided weights only
  /// the tensors in `keep` are whole after it, the others gone (wick plan's
  /// rows measure a run that ends in a file, then make the deferred model
  /// again; `keep` holds what the deferral does not make). Else nothing.
  void drop_weights_back(const std::set<const c10::TensorImpl*>& keep);
  /// shard = "parameters" on several ranks, in place of gather_weights_back:
  /// the weights written to `file` a unit at a time (rank 0 writing, every
  /// rank gathering), none gathered into the model, which every rank then
  /// holds deferred from the file (train/deferred.hpp): no rank, device or
  /// host, ever holds the whole model. On one rank, the whole model saved.
  void write_weights_back(const std::filesystem::path& file);

  /// Bytes held by weights (parameters and buffers), gradients and optimizer state.
  std::map<std::string, std::int64_t> memory_breakdown() const;

  /// Writes a checkpoint folder atomically: model and optimizer state, RNG,
  /// step and `extra` (the loop's own position). Returns the folder. Keeps
  /// the newest `keep` checkpoints and, with keep_best > 0, the best
  /// keep_best by extra.monitor {name, mode ("min"|"max"), value} among the
  /// checkpoints that carry the same monitor; checkpoints/best names the best.
  std::filesystem::path save(const std::filesystem::path& checkpoints_dir, const nlohmann::json& extra,
                             int keep = 3, int keep_best = 0);
  /// Restores from a checkpoint folder; returns its `extra`.
  nlohmann::json load(const std::filesystem::path& checkpoint);
  /// The same with its state.json already read (read_checkpoint_state).
  nlohmann::json load(const std::filesystem::path& checkpoint, const nlohmann::json& state);

 private:
  /// Sharded: every rank's optimizer state joined into one rank's (on rank 0;
  /// the others get an empty map), and a whole state cut to this rank's pieces.
  std::map<std::string, at::Tensor> joined_state();
  /// ZeRO-3's divided average, joined: the whole of each trainable tensor's
  /// on rank 0 (the others get an empty map).
  std::map<std::string, at::Tensor> joined_ema();
  /// Entries "<parameter>.<key>" of this rank's pieces joined on rank 0.
  std::map<std::string, at::Tensor> join_pieces(std::map<std::string, at::Tensor> mine, const std::string& what);
  std::map<std::string, at::Tensor> cut_state(const std::map<std::string, at::Tensor>& whole,
                                              const std::string& where) const;
  bool sharded() const { return reducer_ && reducer_->sharded(); }
  /// A checkpointed block ran more than once in this micro-batch's forward:
  /// its parameters' gradients arrive once per run, so buckets wait for the
  /// backward's end. And an error if a gradient came after its bucket left.
  bool repeated_blocks() const;
  /// ZeRO-3 after gather_weights_back(): `what` refused (its units would free the model's weights again).
  void check_not_finished(const std::string& what) const;
  void check_late_gradients();
  /// ZeRO-3: the root unit (trainable weights in no block) gathered for a forward.
  void gather_root(const std::string& what);
  /// ZeRO-3: every rank ran the same blocks in the same order this window
  /// (a rank whose forward differed would have paired its gathers with
  /// others' of other blocks); an error naming the ranks otherwise.
  void check_gathers();
  /// How a checkpoint's model.safetensors is written when not from the
  /// model's own weights (ZeRO-3: streamed unit by unit): `write` makes the
  /// file (rank 0); `pair` then runs on every rank and makes the gathers
  /// `write` did not (all of them on the others, or on rank 0 after a failure
  /// before its gathers began), so they pair up.
  struct ModelWriter {
    std::function<void(const std::filesystem::path&)> write;
    std::function<void()> pair;
  };
  /// save() once the weights are at hand: the model's own, or through `model`.
  std::filesystem::path save_gathered(const std::filesystem::path& checkpoints_dir, const nlohmann::json& extra,
                                      int keep, int keep_best, const ModelWriter* model = nullptr);
  /// ZeRO-3: every unit gathered in turn on every rank and released; with
  /// `put` (rank 0), each of the model's tensors put as its unit is there. A
  /// failed put is kept in `error` and the gathers go on (the other ranks
  /// wait in them).
  void stream_divided_weights(const std::function<void(const std::string&, const at::Tensor&)>* put,
                              std::string& error);
  /// Rank 0: the divided weights into `file` as they are gathered;
  /// `streamed` is set once the gathers begin (a failure before them, as an
  /// unwritable file, leaves it false: the rank then pairs with
  /// stream_divided_weights(nullptr) so the others are not left waiting).
  void write_divided_weights(const std::filesystem::path& file, std::string& error, bool& streamed);
  void end_divided();
  /// load()'s parts: ZeRO-3's weights read unit by unit; masters and average.
  void load_divided_weights(const std::filesystem::path& file);
  void restore_kept(const std::filesystem::path& checkpoint, const std::map<std::string, at::Tensor>& masters,
                    const std::map<std::string, at::Tensor>& averages);
  std::filesystem::path write_checkpoint(const std::filesystem::path& dir, const nlohmann::json& extra, int keep,
                                         int keep_best, const std::map<std::string, at::Tensor>& opt_state,
                                         const ModelWriter* model = nullptr);
  /// Forward and backward of every micro-batch of the window (each split in
  /// split_ parts); false when this or another rank ran out of memory.
  bool run_window(const std::vector<Batch>& window, StepStats& s, at::Tensor& loss_sum,
                  std::map<std::string, at::Tensor>& metric_sums, std::string& oom_message);
  /// The same for a model whose loss couples the window (Model::window_coupled):
  /// embeddings, the loss over all of them, then backward micro-batch by
  /// micro-batch. `i` tracks the micro-batch for error messages; `agreed`,
  /// when given, is set once the ranks agreed that none ran out of memory.
  /// `runs`: how many micro-batches every rank runs (ZeRO-3 pads with its stand-in).
  bool run_coupled(const std::vector<Batch>& pieces, std::size_t runs, StepStats& s, at::Tensor& loss_sum,
                   std::map<std::string, at::Tensor>& metric_sums, std::size_t& i, bool* agreed);
  /// After the window: unscale, agree on flags across ranks, clip, step.
  void finish_step(StepStats& s, at::Tensor& loss_sum, std::map<std::string, at::Tensor>& metric_sums);
  // finish_step's parts
  void take_reduced_gradients();
  at::Tensor clamped_local_norm();
  void agree_step(StepStats& s, at::Tensor& loss_sum, std::map<std::string, at::Tensor>& metric_sums,
                  const at::Tensor& found_inf, at::Tensor& local_norm);
  void round_into_weights();
  // run_window's parts (window.cpp)
  std::size_t agree_runs(const std::vector<Batch>& pieces);
  bool pass_micro_batch(WindowPass& w, const Batch& batch, bool stand_in, bool last);
  void trace_stand_in(WindowPass& w);
  bool window_out_of_memory(WindowPass& w, const std::string& oom);
  bool scaling() const;
  // the constructor's parts, in its order
  void check_config() const;
  void set_checkpointing();
  void join_ranks();
  std::vector<std::pair<std::string, at::Tensor>> frozen_tensors() const;
  /// offload_embeddings: the model's tables (wick::HostLookups), checked
  /// before anything of the model changes (a refusal leaves it as given).
  void choose_host_tables();
  /// offload_embeddings: the model's tables that stay in host memory, each
  /// paired with its copy there, the table itself left empty so that
  /// Module::to moves nothing of it (a hollow one is placed when made).
  std::vector<std::pair<at::Tensor, at::Tensor>> tables_to_host();
  /// The end of a run with offload_embeddings: each table back on the
  /// run's device (a CPU run: into memory counted as the device's); one that
  /// does not fit there stays in host memory, where lookups still work.
  void return_tables() noexcept;
  bool weights_moved(const std::vector<at::Tensor>& trainable, const std::vector<std::vector<at::Tensor>>& frozen) const;
  void make_divided();
  void attach_optimizer();
  void check_shardable_optimizer() const;
  /// Clears the gradients of the model's trainable tensors and, with master
  /// weights, of their fp32 copies.
  void clear_grads();
  /// After every backward of a window: gives a gradient that shares memory
  /// with another parameter's its own copy (unalias_grads), then with
  /// master_weights adds each half-precision gradient to its fp32 copy's and
  /// frees it.
  void fold_grads();
  void unalias_grads();
  std::shared_ptr<Model> model_;
  std::shared_ptr<Optimizer> optim_;
  std::shared_ptr<Schedule> schedule_;
  TrainerConfig cfg_;
  std::vector<std::pair<std::string, at::Tensor>> params_;  // what the optimizer steps: trainable, or their fp32 masters
  std::vector<at::Tensor> model_params_;                    // the model's trainable tensors (params_' own without masters)
  std::vector<std::pair<std::string, at::Tensor>> stepped_;  // what the optimizer is attached to: params_, or this rank's pieces of them
  std::vector<std::pair<std::string, at::Tensor>> ema_;     // cfg_.ema: the averaged trainable weights, fp32
  // sharded master_weights: params_ are shapes on the meta device and each
  // rank's fp32 masters are its pieces in stepped_ (tensors of their own)
  bool sharded_masters_ = false;
  // a deferred model (wick::Deferred) made as it is divided (ZeRO-3): the
  // tensors hollow when the trainer got it, by name
  std::map<const c10::TensorImpl*, std::string> hollow_;
  // offload_embeddings: the tables kept in host memory, by name, and the
  // host memory this trainer gave each (what return_tables takes back)
  std::map<const c10::TensorImpl*, std::string> host_tables_;
  std::map<const c10::TensorImpl*, const void*> host_data_;
  bool sharded_ema_ = false;  // ZeRO-3: ema_ holds this rank's pieces (stepped_'s order)
  void update_ema();
  std::int64_t step_ = 0;
  std::unique_ptr<GradReducer> reducer_;
  std::vector<std::string> metric_names_;  // seen so far, summed over ranks in this order
  at::Tensor scale_, growth_tracker_;       // fp16 loss scaling (float32 and int32, on the device)
  at::Tensor zero_;                         // [0.0] in double on the device: a figure a step lacks (read only)
  std::int64_t skipped_ = 0;
  std::int64_t split_ = 1;
  std::int64_t host_reads_ = 0;
  std::unique_ptr<CheckpointRunner> block_runner_;  // the blocks the recipe checkpoints
  std::unique_ptr<BlockRunner> partition_runner_;   // ZeRO-3: gathers each block's weights around block_runner_
  std::optional<std::size_t> root_unit_;            // ZeRO-3: the unit of the weights in no block
  Batch stand_in_;  // ZeRO-3: a micro-batch this rank ran, for the windows where it has fewer than others
  bool gathered_back_ = false;  // ZeRO-3: gather_weights_back() ran
};

/// Loss and metrics of `model` over all of `data`, without gradients. Sums
/// stay on the device and are read once at the end.
EvalStats evaluate(Model& model, std::shared_ptr<const Dataset> data, const EvalConfig& cfg);

/// "{x Float [4, 16], y Long [4]}": a batch in error messages.
std::string describe(const Batch& b);

/// Moves a batch to `device` (non-blocking from pinned memory).
Batch to_device(const Batch& b, const at::Device& device);

/// Model weights (parameters and buffers) to and from safetensors, with the
/// module's names.
void save_model(torch::nn::Module& model, const std::filesystem::path& file,
                const std::map<std::string, std::string>& metadata = {});
void load_model(torch::nn::Module& model, const std::filesystem::path& file);

/// A checkpoint's state.json: step, extra (the loop's position), loss scale.
nlohmann::json read_checkpoint_state(const std::filesystem::path& checkpoint);

/// What is wrong with a checkpoint folder ("" when it is intact): state.json
/// unreadable, a file missing, or a file whose size or CRC-32C differs from
/// what state.json recorded when it was written.
std::string checkpoint_problem(const std::filesystem::path& checkpoint);

/// The newest intact checkpoint under `checkpoints_dir` (empty when none);
/// newer damaged ones are listed in `damaged` ("<folder>: <problem>").
std::filesystem::path find_checkpoint(const std::filesystem::path& checkpoints_dir,
                                      std::vector<std::string>* damaged = nullptr);

/// The newest intact checkpoint under `checkpoints_dir`, or an empty path.
std::filesystem::path latest_checkpoint(const std::filesystem::path& checkpoints_dir);

}  // namespace wick
