#pragma once
// Gradient reduction for the last micro-batch of a window: parameters are
// grouped into buckets of about bucket_mb; when every gradient of a bucket
// has been accumulated during the backward, the bucket is flattened and its
// sum over ranks starts, overlapping the rest of the backward. finish()
// launches what is left (missing gradients count as zero), waits, and writes
// the sums back.
//
// Partitioned (ZeRO stage 3, shard = "parameters"): the buckets are the
// model's units (a declared block's trainable parameters, and the rest), each
// rank keeps only its chunk of each unit's weights (a tensor of its own, what
// the optimizer steps), and a unit's parameters are views of one flat buffer
// whose storage is all-gathered before the unit computes and freed after
// (gather_unit / release_unit). Every backward reduce-scatters, each unit as
// soon as its gradients are complete, and the chunks add up over the window.
// A unit's frozen tensors (frozen parameters such as a LoRA's base, and
// buffers such as QLoRA's 4-bit codes and constants) are divided too, as the
// bytes of a second flat buffer of their own: gathered and freed with the
// unit, never reduced (FSDP-QLoRA's sharded quantized base).
//
// Sharded (ZeRO stages 1 and 2): the same buckets are reduce-scattered, not
// all-reduced. Each bucket's flat layout places every parameter at a multiple
// of kShardAlign elements and is cut into one equal chunk per rank; a rank
// owns the pieces of parameters that fall in its chunks and receives only
// their summed gradients. After its optimizer stepped those pieces (views of
// the parameters' own storage), gather_params() all-gathers every rank's
// chunks back into every rank's parameters.

#include <ATen/core/Tensor.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "wick/kit/enum_names.hpp"
#include "wick/optim.hpp"

namespace torch::autograd {
struct Node;
}
namespace c10d {
class Work;
}

namespace wick {

class Group;

/// What ranks partition: nothing (every rank holds everything), the
/// optimizer state (ZeRO-1), the optimizer state and the reduced gradients
/// (ZeRO-2), or those and the weights themselves (ZeRO-3).
enum class ShardMode { None, Optimizer, Gradients, Parameters };
inline constexpr EnumName<ShardMode> kShardModeNames[] = {{ShardMode::None, "none"},
                                                           {ShardMode::Optimizer, "optimizer"},
                                                           {ShardMode::Gradients, "gradients"},
                                                           {ShardMode::Parameters, "parameters"}};
static_assert(enum_names_distinct(kShardModeNames));
ShardMode parse_shard(const std::string& s);
std::string to_string(ShardMode m);

/// A rank's part of one parameter: elements [start, start + numel) of the
/// flattened parameter `param` (an index into the reducer's parameters).
struct ShardPiece {
  std::size_t param = 0;
  std::int64_t start = 0, numel = 0;
  std::size_t bucket = 0;
  std::int64_t chunk_offset = 0;  // where it sits in this rank's chunk of the bucket
};

class GradReducer {
 public:
  /// `units` (Parameters only): the parameter indices of each unit, in the
  /// order their backwards end (the last block first, the rest last); every
  /// parameter in exactly one. The parameters become views of the units' flat
  /// buffers, whole until the caller's release_all().
  /// `grad_dtype` (sharded; Undefined: the parameters' own): the dtype the
  /// gradients are summed in across ranks (fp32 for half-precision weights
  /// stepped through fp32 masters).
  /// `frozen` (Parameters only; empty, or one list per unit): each unit's
  /// tensors that take no gradient, divided with it; they become views of the
  /// unit's frozen buffer. A unit may hold frozen tensors only.
  /// `free_as_divided` (Parameters): each unit's whole buffers are freed as
  /// soon as this rank's chunks are taken, so the division never holds more
  /// than the model and one unit; a failure partway then loses the weights
  /// (the caller says so). Otherwise they stay whole until release_all().
  GradReducer(std::shared_ptr<Group> group, std::vector<at::Tensor> params, double bucket_mb,
              ShardMode shard = ShardMode::None, const std::vector<std::vector<std::size_t>>& units = {},
              at::ScalarType grad_dtype = at::ScalarType::Undefined,
              const std::vector<std::vector<at::Tensor>>& frozen = {}, bool free_as_divided = false);
  ~GradReducer();

  /// The next backward is the window's last: reduce as gradients become ready.
  /// `early = false`: only in finish(), for a backward in which a parameter's
  /// gradient may arrive more than once (a checkpointed block run several
  /// times in one forward backpropagates each run on its own: its parameters
  /// would look complete after the first).
  void arm(bool early = true);
  /// A parameter whose gradient arrived after its bucket was reduced in the
  /// last backward (that part of it would be lost), or -1.
  std::int64_t late_param() const { return late_; }
  /// After the last backward (or with no backward at all on this rank): every
  /// bucket reduced. Unsharded: every parameter's .grad the sum over ranks.
  /// Sharded: piece_grad() the sums of this rank's pieces; the parameters'
  /// own .grad are released: as each bucket is copied out during the
  /// backward (gradients), or here, once every bucket is reduced (optimizer).
  /// A sharded bucket's whole-length buffer (its local sums, the
  /// reduce-scatter's input) goes during the backward, waited for before the
  /// kInFlight-th bucket after it makes its own: at most kInFlight of them
  /// exist at once, so a rank
  /// never holds the whole model's gradient, only its chunks (FSDP frees
  /// its unsharded gradient after each reduce-scatter too).
  void finish(std::int64_t step);
  /// Sharded: the most reduce-scatters in flight during a backward (each
  /// holding its bucket's whole-length buffer); a bucket launched beyond it
  /// waits for the oldest first, before its buffer is made.
  static constexpr std::size_t kInFlight = 2;
  /// Sharded: the most whole-length bucket buffers held at once during the
  /// last backward (a test's view of kInFlight).
  std::size_t most_in_flight() const { return most_in_flight_; }
  std::size_t buckets() const { return buckets_.size(); }
  /// Buckets of the last window launched from gradient hooks, during the backward.
  std::size_t launched_during_backward() const { return launched_early_; }

  ShardMode shard() const { return shard_; }
  bool sharded() const { return shard_ != ShardMode::None; }
  /// Sharded: the pieces rank `rank` owns, in bucket order (at most one per
  /// parameter and rank).
  std::vector<ShardPiece> pieces(int rank) const;
  /// This rank's pieces as flat views of the parameters (what its optimizer
  /// steps) and, after finish(), their reduced gradients (views of the chunks).
  const std::vector<ShardPiece>& my_pieces() const { return mine_; }
  at::Tensor piece_view(const ShardPiece& p) const;
  at::Tensor piece_grad(const ShardPiece& p) const;  // undefined before finish() or after release_chunks()
  /// Sharded, after the optimizer step: every rank's updated pieces into every
  /// rank's parameters, one all-gather per bucket. With `values` (this rank's
  /// pieces as tensors of their own, in my_pieces() order) and `sink`, the
  /// pieces come from `values` and each parameter's gathered value goes to
  /// sink(parameter, value) instead (divided fp32 masters: the parameters
  /// given to the reducer are then shapes on the meta device, holding nothing).
  void gather_params(std::int64_t step, const std::vector<at::Tensor>* values = nullptr,
                     const std::function<void(std::size_t, const at::Tensor&)>& sink = {});
  /// Sharded: drops the reduced chunks (and with them the pieces' gradients).
  void release_chunks();

  // ---- Parameters (ZeRO-3) ----
  bool partitioned() const { return shard_ == ShardMode::Parameters; }
  std::size_t units() const { return buckets_.size(); }
  /// The unit's whole weights into its parameters (one all-gather of every
  /// rank's chunk), unless they are there already; `what` names it in errors.
  void gather_unit(std::size_t unit, const std::string& what);
  /// The unit's whole weights freed (the parameters keep their shapes and
  /// hold no data until the next gather_unit).
  void release_unit(std::size_t unit);
  /// Every unit gathered. `last`: for good (the end of training): each
  /// unit's chunk of frozen tensors is dropped once its whole is there, so
  /// the end holds the model and one unit's chunk more, not 1.5 models; no
  /// unit may be gathered or released after.
  void gather_all(const std::string& what, bool last = false);
  /// The unit's whole buffer made, its contents undefined, with no collective
  /// (each rank about to fill it alike, from a file).
  void make_unit(std::size_t unit);
  /// A deferred tensor's value (wick/kit/deferral.hpp; the tensor was
  /// hollow when laid out), `value` its flat elements [first, first +
  /// value.numel()) (the whole value by default): this rank's part of them
  /// into its chunk, converted to the tensor's dtype. False when `tensor` is
  /// none of the units'. The unit must be released (nothing gathered yet).
  bool fill(const at::Tensor& tensor, const at::Tensor& value, std::int64_t first = 0);
  /// The flat elements [first, last) of `tensor` that fill keeps on this
  /// rank (empty when none; an element cut by the chunk's edge counts);
  /// nullopt when `tensor` is none of the units'.
  std::optional<std::pair<std::int64_t, std::int64_t>> kept(const at::Tensor& tensor) const;
  /// The storages unit `unit`'s tensors view (its trainable parameters' and
  /// its frozen tensors'; to tell which tensors are its).
  std::vector<const c10::StorageImpl*> unit_storages(std::size_t unit) const;
  /// The gradient with respect to the input of the unit's block has been
  /// computed: nothing of the block's backward is left. A unit with frozen
  /// tensors is freed then (and once its own gradients are in); its
  /// gradients alone cannot say so (a frozen weight's product for the
  /// input's gradient may come after the adapters' gradients).
  void input_grad_ready(std::size_t unit);
  /// Whether the unit holds frozen tensors.
  bool has_frozen(std::size_t unit) const { return !buckets_[unit].frozen.empty(); }
  void release_all();
  /// After the whole weights were written (a checkpoint loaded into gathered
  /// units): this rank's chunks taken from them.
  void keep_chunks_of_gathered();
  /// Bytes of weights this rank holds now (its chunks and the gathered
  /// units, alignment included), and the units' parameters' own bytes.
  std::int64_t held_weight_bytes() const;
  std::int64_t whole_weight_bytes() const;
  /// The units gathered since the last call, in order, as one number: equal
  /// on every rank when their forwards ran the same blocks.
  std::uint64_t take_gather_trace();
  /// A micro-batch's collectives (its gathers and reduce-scatters, in the
  /// order issued), recorded between begin and end. After a micro-batch
  /// failed partway (out of memory), drain() issues the rest of the last
  /// whole micro-batch's, with nothing in them (each unit gathered and freed,
  /// zeros reduce-scattered and dropped), so they pair with the other ranks'
  /// collectives of their micro-batch; false, issuing nothing, when there is
  /// no whole micro-batch yet or the failed one did not begin as it did.
  /// replay(): a whole micro-batch's, the same way. Both drop this rank's
  /// gradients and leave every unit freed.
  void begin_micro_batch();
  void end_micro_batch();
  bool can_replay() const { return have_last_; }
  bool drain(std::int64_t step);
  void replay(std::int64_t step);

 private:
  struct Bucket {
    std::vector<std::size_t> params;
    std::vector<std::int64_t> offsets;  // in the flat layout
    std::int64_t numel = 0;             // the flat layout's length (sharded: padded to ranks x kShardAlign)
    std::size_t pending = 0;
    bool launched = false;
    at::Tensor flat, chunk;             // chunk: this rank's reduced part (sharded)
    at::Tensor acc;                     // sharded: the chunks reduced over the window, summed
    c10::intrusive_ptr<c10d::Work> work;
    // Parameters: this rank's chunk of the unit's weights, and the whole
    // buffer the parameters view (its storage freed while not gathered)
    at::Tensor shard, whole;
    bool gathered = false;
    // Parameters: the frozen tensors, their byte offsets in the frozen
    // buffer (each at a multiple of kFrozenAlign), its length (a multiple of
    // ranks x kFrozenAlign), and this rank's chunk of it and the whole
    std::vector<at::Tensor> frozen;
    std::vector<std::int64_t> frozen_offsets;
    std::int64_t frozen_bytes = 0;
    at::Tensor frozen_shard, frozen_whole;
    bool input_done = false;  // the block's input gradient came in this backward
  };
  struct Place {
    std::size_t unit, index;
    bool frozen;  // index into the unit's frozen tensors, else into its params
  };
  /// Where `tensor` lies in the units, or nullopt.
  std::optional<Place> place(const at::Tensor& tensor) const;
  void lay_out_frozen(Bucket& b, std::vector<at::Tensor> tensors);
  void allocate_whole(Bucket& b);
  void lay_in_frozen(Bucket& b, std::int64_t rank, std::int64_t world);
  bool finished_ = false;  // gather_all(last): the units are whole for good
  void lay_out_units(const std::vector<std::vector<std::size_t>>& units,
                     const std::vector<std::vector<at::Tensor>>& frozen);
  // frozen tensors' offsets in bytes: a multiple of any element's size
  static constexpr std::int64_t kFrozenAlign = 64;
  void ready(std::size_t param);
  void launch(Bucket& b);
  /// Sharded, mu_ held: the oldest launched buckets are waited for and drop
  /// their whole-length buffers until at most `keep` remain (done or not:
  /// the buffers held, and so the peak, do not depend on the collectives' timing).
  void settle(std::size_t keep);
  std::deque<std::size_t> in_flight_;  // launched sharded buckets still holding their buffers, oldest first
  std::size_t most_in_flight_ = 0;
  /// The bucket's buffers: its parameters' dtype on the group's device
  /// (parameters on the meta device hold only their shapes).
  at::TensorOptions buffer_options(const Bucket& b) const;

  std::shared_ptr<Group> group_;
  std::vector<at::Tensor> params_;
  ShardMode shard_;
  std::vector<std::size_t> bucket_of_;
  std::vector<Bucket> buckets_;
  std::vector<ShardPiece> mine_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // keep the hooks' nodes alive
  std::mutex mu_;
  std::size_t next_ = 0;  // the next bucket to launch
  std::size_t launched_early_ = 0;
  std::atomic<bool> armed_{false};
  bool early_ = true;
  at::ScalarType grad_dtype_ = at::ScalarType::Undefined;
  std::int64_t late_ = -1;
  std::uint64_t trace_ = 0;
  struct Op {
    bool gather = false;  // else a reduce-scatter
    std::size_t unit = 0;
    bool operator==(const Op&) const = default;
  };
  void record(bool gather, std::size_t unit);
  void issue_rest(std::size_t from, const std::string& what);
  std::mutex ops_mu_;
  bool recording_ = false, have_last_ = false;
  std::vector<Op> ops_, last_ops_;
  std::shared_ptr<std::atomic<bool>> alive_;
};

}  // namespace wick
