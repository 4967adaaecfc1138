#include "distributed/reducer.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "distributed/group.hpp"
#include "wick/kit/deferral.hpp"

namespace wick {

ShardMode parse_shard(const std::string& s) { return parse_enum(kShardModeNames, s, "shard", /*quoted=*/true); }

std::string to_string(ShardMode m) { return std::string(enum_name(kShardModeNames, m)); }

namespace {
std::int64_t round_up(std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; }

// A storage's bytes given back, and taken again from the allocator it came
// from: every tensor viewing it keeps its shape, its version counter and its
// autograd history (what the backward saved of a parameter sees the data of
// the next gather).
void free_storage(const at::Tensor& t) {
  auto* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}
// A frozen tensor's place in its unit's byte buffer: its dtype and shape,
// contiguous, at `offset` bytes (a multiple of kFrozenAlign).
at::Tensor frozen_view(const at::Tensor& bytes, std::int64_t offset, const at::Tensor& t) {
  const std::int64_t n = t.numel() * static_cast<std::int64_t>(t.element_size());
  return bytes.narrow(0, offset, n).view(t.scalar_type()).view(t.sizes());
}
void allocate_storage(const at::Tensor& t, std::size_t nbytes) {
  auto* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}
}  // namespace

GradReducer::GradReducer(std::shared_ptr<Group> group, std::vector<at::Tensor> params, double bucket_mb,
                         ShardMode shard, const std::vector<std::vector<std::size_t>>& units,
                         at::ScalarType grad_dtype, const std::vector<std::vector<at::Tensor>>& frozen,
                         bool free_as_divided)
    : group_(std::move(group)), params_(std::move(params)), shard_(shard), grad_dtype_(grad_dtype),
      alive_(std::make_shared<std::atomic<bool>>(true)) {
  const std::int64_t align = sharded() ? kShardAlign : 1;
  const std::int64_t world = group_->size();
  for (const auto& p : params_)
    if (sharded() && !p.is_contiguous())
      throw Error("shard: a trainable parameter of shape " + c10::str(p.sizes()) +
                  " is not contiguous; its pieces could not be views of it");
  // Backward produces gradients roughly in reverse order of the parameters:
  // fill buckets from the end so the first bucket is ready first.
  const std::int64_t cap = std::max<std::int64_t>(1, static_cast<std::int64_t>(bucket_mb * 1024 * 1024));
  bucket_of_.resize(params_.size());
  if (!frozen.empty() && (!partitioned() || frozen.size() != units.size()))
    throw Error("shard = \"parameters\": frozen tensors are divided with the units, one list per unit");
  if (partitioned()) lay_out_units(units, frozen);
  for (std::size_t k = params_.size(); k-- > 0 && !partitioned();) {
    const auto& p = params_[k];
    const std::int64_t bytes = p.numel() * p.element_size();
    if (buckets_.empty() || buckets_.back().numel * p.element_size() + bytes > cap ||
        params_[buckets_.back().params.front()].scalar_type() != p.scalar_type())
      buckets_.emplace_back();
    Bucket& b = buckets_.back();
    b.params.push_back(k);
    b.offsets.push_back(round_up(b.numel, align));
    b.numel = b.offsets.back() + p.numel();
    bucket_of_[k] = buckets_.size() - 1;
  }
  if (sharded()) {
    // every chunk a multiple of kShardAlign: each piece starts at one in its parameter
    for (auto& b : buckets_) b.numel = round_up(b.numel, world * align);
    mine_ = pieces(group_->rank());
  }
  if (partitioned()) {
    // each unit's weights into one flat buffer the parameters view; this
    // rank keeps its chunk. The buffers stay whole until release_all() (the
    // caller frees them once nothing can fail any more: a failure before
    // leaves the model its weights), or go unit by unit (free_as_divided)
    at::NoGradGuard no_grad;
    const std::int64_t rank = group_->rank();
    for (auto& b : buckets_) {
      b.gathered = true;
      if (!b.params.empty()) {
        b.whole = at::zeros({b.numel}, buffer_options(b));
        for (std::size_t j = 0; j < b.params.size(); ++j) {
          at::Tensor& p = params_[b.params[j]];
          at::Tensor view = b.whole.narrow(0, b.offsets[j], p.numel());
          if (!is_hollow(p)) view.copy_(p.detach().reshape({-1}));  // (a deferred one: fill() brings it)
          p.set_data(view.view(p.sizes()));
        }
        const std::int64_t chunk = b.numel / world;
        b.shard = b.whole.narrow(0, rank * chunk, chunk).clone();
      }
      if (!b.frozen.empty()) lay_in_frozen(b, rank, world);
      if (free_as_divided) release_unit(static_cast<std::size_t>(&b - buckets_.data()));
    }
  }
  for (std::size_t k = 0; k < params_.size(); ++k) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[k]);
    if (!acc) continue;
    std::weak_ptr<std::atomic<bool>> alive = alive_;
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, k, alive](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto a = alive.lock(); a && *a && armed_) ready(k);
          return outputs;
        }));
    accumulators_.push_back(std::move(acc));
  }
}

// A unit's frozen tensors' bytes, whatever their dtypes (4-bit codes, their
// constants, a half-precision base), in one flat buffer: one gather of bytes
// per unit. This rank keeps its chunk.
void GradReducer::lay_in_frozen(Bucket& b, std::int64_t rank, std::int64_t world) {
  b.frozen_whole = at::zeros({b.frozen_bytes}, b.frozen.front().options().dtype(at::kByte));
  for (std::size_t j = 0; j < b.frozen.size(); ++j) {
    at::Tensor& t = b.frozen[j];
    at::Tensor view = frozen_view(b.frozen_whole, b.frozen_offsets[j], t);
    if (!is_hollow(t)) view.copy_(t.detach());
    t.set_data(view);
  }
  const std::int64_t chunk = b.frozen_bytes / world;
  b.frozen_shard = b.frozen_whole.narrow(0, rank * chunk, chunk).clone();
}

GradReducer::~GradReducer() { *alive_ = false; }

void GradReducer::lay_out_units(const std::vector<std::vector<std::size_t>>& units,
                                const std::vector<std::vector<at::Tensor>>& frozen) {
  std::vector<bool> placed(params_.size(), false);
  for (std::size_t u = 0; u < units.size(); ++u) {
    const auto& unit = units[u];
    if (unit.empty() && (frozen.empty() || frozen[u].empty())) continue;
    Bucket& b = buckets_.emplace_back();
    if (!frozen.empty()) lay_out_frozen(b, frozen[u]);
    for (auto k : unit) {
      if (k >= params_.size() || placed[k]) throw Error("shard = \"parameters\": a parameter in no unit or in two");
      if (params_[k].scalar_type() != params_[unit.front()].scalar_type())
        throw Error("shard = \"parameters\": the trainable parameters of one unit (a block, or the weights in no "
                    "block) differ in dtype (" +
                    std::string(c10::toString(params_[k].scalar_type())) + " and " +
                    c10::toString(params_[unit.front()].scalar_type()) + ")");
      placed[k] = true;
      b.params.push_back(k);
      b.offsets.push_back(round_up(b.numel, kShardAlign));
      b.numel = b.offsets.back() + params_[k].numel();
      bucket_of_[k] = buckets_.size() - 1;
    }
  }
  if (std::find(placed.begin(), placed.end(), false) != placed.end())
    throw Error("shard = \"parameters\": a parameter in no unit");
}

void GradReducer::lay_out_frozen(Bucket& b, std::vector<at::Tensor> tensors) {
  const std::int64_t world = group_->size();
  for (auto& t : tensors) {
    b.frozen_offsets.push_back(round_up(b.frozen_bytes, kFrozenAlign));
    b.frozen_bytes = b.frozen_offsets.back() + static_cast<std::int64_t>(t.numel() * t.element_size());
    b.frozen.push_back(std::move(t));
  }
  b.frozen_bytes = round_up(b.frozen_bytes, world * kFrozenAlign);
}

void GradReducer::allocate_whole(Bucket& b) {
  if (b.whole.defined()) allocate_storage(b.whole, static_cast<std::size_t>(b.numel) * b.whole.element_size());
  if (b.frozen_whole.defined()) allocate_storage(b.frozen_whole, static_cast<std::size_t>(b.frozen_bytes));
  b.gathered = true;  // a failed gather leaves storage that a release frees
}

void GradReducer::gather_unit(std::size_t unit, const std::string& what) {
  Bucket& b = buckets_[unit];
  if (b.gathered) return;
  if (finished_) throw std::logic_error("GradReducer: a unit gathered after gather_all(last)");
  allocate_whole(b);
  b.input_done = false;
  at::NoGradGuard no_grad;
  if (b.whole.defined()) group_->all_gather(b.whole, b.shard, what);
  if (b.frozen_whole.defined()) group_->all_gather(b.frozen_whole, b.frozen_shard, what + " (its frozen weights)");
  trace_ = trace_ * 1000003u + unit + 1;
  record(true, unit);
}

namespace {
// dst[lo, lo + dst.numel()) := the part of the flat src placed at `offset`
// that falls there, cut before it is converted to dst's dtype (and device):
// of a tensor read from a mapped file, only this rank's bytes are read
void copy_overlap(const at::Tensor& dst, std::int64_t lo, const at::Tensor& src, std::int64_t offset) {
  const std::int64_t s = std::max(lo, offset), e = std::min(lo + dst.numel(), offset + src.numel());
  if (s < e) dst.narrow(0, s - lo, e - s).copy_(src.narrow(0, s - offset, e - s));
}
}  // namespace

std::optional<GradReducer::Place> GradReducer::place(const at::Tensor& tensor) const {
  const auto* impl = tensor.unsafeGetTensorImpl();
  for (std::size_t u = 0; u < buckets_.size(); ++u) {
    const auto& b = buckets_[u];
    for (std::size_t j = 0; j < b.params.size(); ++j)
      if (params_[b.params[j]].unsafeGetTensorImpl() == impl) return Place{u, j, false};
    for (std::size_t j = 0; j < b.frozen.size(); ++j)
      if (b.frozen[j].unsafeGetTensorImpl() == impl) return Place{u, j, true};
  }
  return std::nullopt;
}

std::optional<std::pair<std::int64_t, std::int64_t>> GradReducer::kept(const at::Tensor& tensor) const {
  const auto p = place(tensor);
  if (!p) return std::nullopt;
  const Bucket& b = buckets_[p->unit];
  const std::int64_t rank = group_->rank(), world = group_->size(), n = tensor.numel();
  if (!p->frozen) {
    const std::int64_t chunk = b.numel / world, off = b.offsets[p->index];
    const std::int64_t lo = std::max(rank * chunk, off), hi = std::min((rank + 1) * chunk, off + n);
    return lo < hi ? std::make_pair(lo - off, hi - off) : std::make_pair<std::int64_t, std::int64_t>(0, 0);
  }
  // bytes of the tensor's own dtype: an element cut by the chunk's end is kept in part
  const std::int64_t chunk = b.frozen_bytes / world, off = b.frozen_offsets[p->index];
  const std::int64_t size = static_cast<std::int64_t>(c10::elementSize(b.frozen[p->index].scalar_type()));
  const std::int64_t lo = std::max(rank * chunk, off), hi = std::min((rank + 1) * chunk, off + n * size);
  if (lo >= hi) return std::make_pair<std::int64_t, std::int64_t>(0, 0);
  return std::make_pair((lo - off) / size, (hi - off + size - 1) / size);
}

bool GradReducer::fill(const at::Tensor& tensor, const at::Tensor& value, std::int64_t first) {
  const auto p = place(tensor);
  if (!p) return false;
  Bucket& b = buckets_[p->unit];
  if (b.gathered) throw std::logic_error("GradReducer::fill: the unit is gathered");
  const std::int64_t rank = group_->rank(), world = group_->size();
  at::NoGradGuard no_grad;
  if (!p->frozen) {
    const std::int64_t chunk = b.numel / world;
    copy_overlap(b.shard, rank * chunk, value.reshape({-1}), b.offsets[p->index] + first);  // (copy_ converts)
    return true;
  }
  // bytes of the tensor's own dtype: only the elements whose bytes fall in
  // this rank's chunk are converted (and, of a mapped file, read)
  const std::int64_t chunk = b.frozen_bytes / world;
  const at::ScalarType dtype = b.frozen[p->index].scalar_type();
  const std::int64_t size = static_cast<std::int64_t>(c10::elementSize(dtype));
  const std::int64_t off = b.frozen_offsets[p->index] + first * size, lo = std::max(rank * chunk, off),
                     hi = std::min((rank + 1) * chunk, off + value.numel() * size);
  if (lo >= hi) return true;
  const std::int64_t a = (lo - off) / size, z = (hi - off + size - 1) / size;
  const at::Tensor bytes = value.reshape({-1}).slice(0, a, z).to(dtype).contiguous().view(at::kByte);
  copy_overlap(b.frozen_shard, rank * chunk, bytes, off + a * size);
  return true;
}

void GradReducer::input_grad_ready(std::size_t unit) {
  std::lock_guard<std::mutex> lock(mu_);
  Bucket& b = buckets_[unit];
  b.input_done = true;
  // a block run several times in one forward (early_ false) has more backward to come
  if (early_ && armed_ && b.pending == 0) release_unit(unit);
}

void GradReducer::record(bool gather, std::size_t unit) {
  std::lock_guard<std::mutex> lock(ops_mu_);
  if (recording_) ops_.push_back({gather, unit});
}

void GradReducer::begin_micro_batch() {
  std::lock_guard<std::mutex> lock(ops_mu_);
  ops_.clear();
  recording_ = true;
}

void GradReducer::end_micro_batch() {
  std::lock_guard<std::mutex> lock(ops_mu_);
  last_ops_ = ops_;
  have_last_ = recording_;
  recording_ = false;
}

bool GradReducer::drain(std::int64_t step) {
  armed_ = false;
  std::size_t done = 0;
  {
    std::lock_guard<std::mutex> lock(ops_mu_);
    recording_ = false;
    if (!have_last_ || ops_.size() > last_ops_.size() || !std::equal(ops_.begin(), ops_.end(), last_ops_.begin()))
      return false;
    done = ops_.size();
  }
  const std::string what = "the collectives of a micro-batch given up at step " + std::to_string(step) +
                           " (out of memory), finished with the other ranks";
  {
    std::lock_guard<std::mutex> lock(mu_);
    // what was issued completes: the other ranks issue it too
    for (auto& b : buckets_) {
      if (b.work) group_->wait(b.work, what);
      b.work.reset();
      b.flat = b.chunk = at::Tensor();
      b.launched = true;  // a gradient arriving now goes nowhere
    }
    in_flight_.clear();
    next_ = buckets_.size();
  }
  for (auto& p : params_) p.mutable_grad() = at::Tensor();
  release_all();
  issue_rest(done, what);
  return true;
}

void GradReducer::replay(std::int64_t step) {
  {
    std::lock_guard<std::mutex> lock(ops_mu_);
    ops_.clear();
    recording_ = false;
  }
  release_all();
  issue_rest(0, "the collectives of a micro-batch at step " + std::to_string(step) +
                    " on a rank that ran out of memory, issued with the other ranks'");
}

void GradReducer::issue_rest(std::size_t from, const std::string& what) {
  at::NoGradGuard no_grad;
  for (std::size_t k = from; k < last_ops_.size(); ++k) {
    const Op& op = last_ops_[k];
    Bucket& b = buckets_[op.unit];
    if (op.gather) {
      gather_unit(op.unit, what);
      release_unit(op.unit);
      continue;
    }
    auto opts = buffer_options(b);
    if (grad_dtype_ != at::ScalarType::Undefined) opts = opts.dtype(grad_dtype_);
    at::Tensor flat = at::zeros({b.numel}, opts);
    at::Tensor chunk = at::empty({b.numel / group_->size()}, opts);
    auto work = group_->reduce_scatter_async(chunk, flat);
    group_->wait(work, what);
  }
}

void GradReducer::make_unit(std::size_t unit) {
  Bucket& b = buckets_[unit];
  if (b.gathered) return;
  allocate_whole(b);
  at::NoGradGuard no_grad;
  // the alignment's gaps
  if (b.whole.defined()) b.whole.zero_();
  if (b.frozen_whole.defined()) b.frozen_whole.zero_();
}

void GradReducer::release_unit(std::size_t unit) {
  Bucket& b = buckets_[unit];
  if (!b.gathered || finished_) return;  // finished: the whole weights are the model's for good
  if (b.whole.defined()) free_storage(b.whole);
  if (b.frozen_whole.defined()) free_storage(b.frozen_whole);
  b.gathered = false;
}

void GradReducer::gather_all(const std::string& what, bool last) {
  for (std::size_t u = 0; u < buckets_.size(); ++u) {
    gather_unit(u, what);
    if (last) buckets_[u].frozen_shard = at::Tensor();
  }
  if (last) finished_ = true;
}

std::vector<const c10::StorageImpl*> GradReducer::unit_storages(std::size_t unit) const {
  std::vector<const c10::StorageImpl*> out;
  for (const at::Tensor* t : {&buckets_[unit].whole, &buckets_[unit].frozen_whole})
    if (t->defined()) out.push_back(t->storage().unsafeGetStorageImpl());
  return out;
}

void GradReducer::release_all() {
  for (std::size_t u = 0; u < buckets_.size(); ++u) release_unit(u);
}

void GradReducer::keep_chunks_of_gathered() {
  at::NoGradGuard no_grad;
  const std::int64_t world = group_->size();
  for (auto& b : buckets_) {
    if (!b.gathered) continue;
    if (b.whole.defined()) b.shard.copy_(b.whole.narrow(0, group_->rank() * (b.numel / world), b.numel / world));
    if (b.frozen_whole.defined())
      b.frozen_shard.copy_(b.frozen_whole.narrow(0, group_->rank() * (b.frozen_bytes / world), b.frozen_bytes / world));
  }
}

std::int64_t GradReducer::held_weight_bytes() const {
  auto bytes = [](const at::Tensor& t) { return t.defined() ? static_cast<std::int64_t>(t.nbytes()) : 0; };
  std::int64_t n = 0;
  for (const auto& b : buckets_)
    n += bytes(b.shard) + bytes(b.frozen_shard) + (b.gathered ? bytes(b.whole) + bytes(b.frozen_whole) : 0);
  return n;
}

std::int64_t GradReducer::whole_weight_bytes() const {
  std::int64_t n = 0;
  for (const auto& b : buckets_) {
    for (auto k : b.params) n += params_[k].numel() * static_cast<std::int64_t>(params_[k].element_size());
    for (const auto& t : b.frozen) n += t.numel() * static_cast<std::int64_t>(t.element_size());
  }
  return n;
}

std::uint64_t GradReducer::take_gather_trace() {
  const std::uint64_t t = trace_;
  trace_ = 0;
  return t;
}

std::vector<ShardPiece> GradReducer::pieces(int rank) const {
  std::vector<ShardPiece> out;
  if (!sharded()) return out;
  const std::int64_t world = group_->size();
  for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
    const Bucket& b = buckets_[bi];
    const std::int64_t chunk = b.numel / world, lo = rank * chunk, hi = lo + chunk;
    for (std::size_t j = 0; j < b.params.size(); ++j) {
      const std::int64_t begin = std::max(lo, b.offsets[j]);
      const std::int64_t end = std::min(hi, b.offsets[j] + params_[b.params[j]].numel());
      if (begin >= end) continue;
      out.push_back({b.params[j], begin - b.offsets[j], end - begin, bi, begin - lo});
    }
  }
  return out;
}

at::TensorOptions GradReducer::buffer_options(const Bucket& b) const {
  const auto& p = params_[b.params.front()];
  return p.options().device(p.is_meta() ? group_->device() : p.device());
}

at::Tensor GradReducer::piece_view(const ShardPiece& p) const {
  if (partitioned()) return buckets_[p.bucket].shard.narrow(0, p.chunk_offset, p.numel);
  return params_[p.param].detach().view({-1}).narrow(0, p.start, p.numel);
}

void GradReducer::arm(bool early) {
  std::lock_guard<std::mutex> lock(mu_);
  early_ = early;
  late_ = -1;
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.input_done = false;
    b.launched = false;
    b.work.reset();
    b.flat = at::Tensor();
    b.chunk = at::Tensor();
  }
  next_ = 0;
  launched_early_ = 0;
  in_flight_.clear();
  most_in_flight_ = 0;
  armed_ = true;
}

void GradReducer::launch(Bucket& b) {
  b.launched = true;
  if (b.params.empty()) return;  // a unit of frozen tensors: nothing to reduce
  if (!sharded()) {
    std::vector<at::Tensor> parts;
    parts.reserve(b.params.size());
    for (auto k : b.params) {
      const auto& p = params_[k];
      parts.push_back(p.grad().defined() ? p.grad().reshape({-1}) : at::zeros({p.numel()}, buffer_options(b)));
    }
    b.flat = at::cat(parts);
    b.work = group_->all_reduce_async(b.flat);
    return;
  }
  settle(kInFlight - 1);  // room for this bucket's buffer
  auto opts = buffer_options(b);
  if (grad_dtype_ != at::ScalarType::Undefined) opts = opts.dtype(grad_dtype_);
  b.flat = at::zeros({b.numel}, opts);  // the alignment's gaps stay zero
  for (std::size_t j = 0; j < b.params.size(); ++j) {
    at::Tensor& g = params_[b.params[j]].mutable_grad();
    if (!g.defined()) continue;
    b.flat.narrow(0, b.offsets[j], g.numel()).copy_(g.reshape({-1}));
    // ZeRO-2 and 3: the local sums live on only in the flat buffer, until it is reduced
    if (shard_ == ShardMode::Gradients || partitioned()) g = at::Tensor();
  }
  b.chunk = at::empty({b.numel / group_->size()}, opts);
  b.work = group_->reduce_scatter_async(b.chunk, b.flat);
  const auto index = static_cast<std::size_t>(&b - buckets_.data());
  if (partitioned()) record(false, index);
  in_flight_.push_back(index);
  most_in_flight_ = std::max(most_in_flight_, in_flight_.size());
}

void GradReducer::settle(std::size_t keep) {
  // The oldest are waited for until `keep` remain, finished or not: a bucket
  // whose reduce-scatter happens to be done already is not dropped sooner,
  // so the buffers held at each point of the backward, and the step's peak,
  // are the same whatever the collectives' timing (on a GPU the host mostly
  // runs ahead of them anyway; on gloo they finish while the backward
  // computes, early or late by the machine's load, and wick plan measured
  // one peak one run and another the next).
  while (in_flight_.size() > keep) {
    Bucket& b = buckets_[in_flight_.front()];
    // (a failed one throws here, naming it, as finish() would)
    if (b.work) group_->wait(b.work, "the gradient reduce-scatter of a unit during the backward");
    b.work.reset();
    b.flat = at::Tensor();  // the chunk holds this rank's sums; the whole-length local sums go
    in_flight_.pop_front();
  }
}

void GradReducer::ready(std::size_t param) {
  std::lock_guard<std::mutex> lock(mu_);
  Bucket& b = buckets_[bucket_of_[param]];
  if (b.launched) {  // its bucket's sums have left: this part would be lost
    if (late_ < 0) late_ = static_cast<std::int64_t>(param);
    return;
  }
  if (b.pending > 0) --b.pending;
  if (!early_) return;
  // ZeRO-3: every gradient of the unit is in, so nothing in the backward
  // still reads its weights
  // (a unit with frozen tensors: once its block's input gradient is in too)
  if (partitioned() && b.pending == 0 && (b.frozen.empty() || b.input_done)) release_unit(bucket_of_[param]);
  // Buckets start strictly in index order, as on every other rank: collectives
  // must be issued in the same order everywhere.
  while (next_ < buckets_.size() && buckets_[next_].pending == 0) {
    launch(buckets_[next_++]);
    ++launched_early_;
  }
}

void GradReducer::finish(std::int64_t step) {
  armed_ = false;
  std::lock_guard<std::mutex> lock(mu_);
  // Buckets whose gradients never all arrived (unused parameters, or no
  // micro-batch on this rank) go now, in the same order on every rank.
  while (next_ < buckets_.size()) launch(buckets_[next_++]);
  const std::string what = std::string("the gradient ") + (sharded() ? "reduce-scatter" : "all-reduce") + " of step " +
                           std::to_string(step);
  for (auto& b : buckets_) {
    if (b.params.empty()) continue;
    if (b.work) group_->wait(b.work, what);  // (a sharded one done during the backward has none)
    b.work.reset();
    if (sharded()) {
      // the chunk holds what this rank needs; ZeRO-1 drops the local sums
      // now, ZeRO-2 and 3 dropped them as the bucket was copied out. ZeRO-3
      // reduces every micro-batch: the chunks add up over the window.
      b.flat = at::Tensor();
      for (auto k : b.params) params_[k].mutable_grad() = at::Tensor();
      if (b.acc.defined()) b.acc.add_(b.chunk);
      else b.acc = b.chunk;
      b.chunk = at::Tensor();
      continue;
    }
    for (std::size_t j = 0; j < b.params.size(); ++j) {
      auto& p = params_[b.params[j]];
      at::Tensor sum = b.flat.narrow(0, b.offsets[j], p.numel()).view(p.sizes());
      if (p.grad().defined()) p.mutable_grad().copy_(sum);
      else p.mutable_grad() = sum.clone();
    }
    b.flat = at::Tensor();
  }
  in_flight_.clear();
  if (partitioned()) release_all();  // units whose gradients never came (unused, or a rank without data)
}

at::Tensor GradReducer::piece_grad(const ShardPiece& p) const {
  const at::Tensor& acc = buckets_[p.bucket].acc;
  return acc.defined() ? acc.narrow(0, p.chunk_offset, p.numel) : at::Tensor();
}

void GradReducer::release_chunks() {
  for (auto& b : buckets_) b.chunk = b.acc = at::Tensor();
}

void GradReducer::gather_params(std::int64_t step, const std::vector<at::Tensor>* values,
                                const std::function<void(std::size_t, const at::Tensor&)>& sink) {
  const std::string what = "the all-gather of the weights updated at step " + std::to_string(step);
  const std::int64_t world = group_->size();
  at::NoGradGuard no_grad;
  std::size_t next_piece = 0;
  for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
    const Bucket& b = buckets_[bi];
    const auto opts = buffer_options(b);
    at::Tensor in = at::zeros({b.numel / world}, opts);
    for (; next_piece < mine_.size() && mine_[next_piece].bucket == bi; ++next_piece) {
      const ShardPiece& p = mine_[next_piece];
      in.narrow(0, p.chunk_offset, p.numel).copy_(values ? (*values)[next_piece].reshape({-1}) : piece_view(p));
    }
    at::Tensor out = at::empty({b.numel}, opts);
    group_->all_gather(out, in, what);
    for (std::size_t j = 0; j < b.params.size(); ++j) {
      const std::size_t k = b.params[j];
      const at::Tensor whole = out.narrow(0, b.offsets[j], params_[k].numel()).view(params_[k].sizes());
      if (sink) sink(k, whole);
      else params_[k].detach().copy_(whole);
    }
  }
}

}  // namespace wick
