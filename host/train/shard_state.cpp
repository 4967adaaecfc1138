// Sharded optimizer state in checkpoints: one rank's state, whatever the rank
// count or the shard setting. Saving joins every rank's pieces on rank 0;
// resuming cuts the whole state into this rank's pieces. The rule for an
// entry "<parameter>.<key>" follows the SDK's contract (wick/optim.hpp):
// elementwise entries are concatenated (and take the parameter's shape),
// entries equal on every piece are kept once, per-block entries are
// concatenated.

#include <ATen/ATen.h>
#include <algorithm>
#include <set>
#include <nlohmann/json.hpp>

#include "distributed/group.hpp"
#include "train/trainer.hpp"

namespace wick {
namespace {

// The entries of `state` that belong to parameter `name` ("<name>.<key>"), by key.
std::map<std::string, at::Tensor> entries_of(const std::map<std::string, at::Tensor>& state, const std::string& name) {
  std::map<std::string, at::Tensor> out;
  const std::string prefix = name + ".";
  for (auto it = state.lower_bound(prefix); it != state.end() && it->first.starts_with(prefix); ++it)
    out.emplace(it->first.substr(prefix.size()), it->second);
  return out;
}

// A counter every piece keeps (a step count): 0-dimensional, the same value
// everywhere. (A one-element 1-D entry is per block: a piece of one block.)
bool equal_scalars(const std::vector<at::Tensor>& parts) {
  for (const auto& t : parts)
    if (t.dim() != 0 || !at::equal(t, parts.front())) return false;
  return true;
}

// The block size b (a power of two up to kShardAlign) with ceil(n / b) == m, or 0.
std::int64_t block_of(std::int64_t n, std::int64_t m) {
  std::int64_t block = 0;
  for (std::int64_t b = 1; b <= kShardAlign; b *= 2)
    if ((n + b - 1) / b == m) block = b;
  return block;
}

}  // namespace

namespace {
// Divided fp32 masters (and ZeRO-3's divided average) travel with the
// optimizer state as the elementwise entry "<parameter>.<kMasterKey>"
// ("<parameter>.<kEmaKey>") and leave it as "wick.master/<parameter>"
// ("wick.ema/<parameter>").
const std::string kMasterKey = "wick.master";
const std::string kEmaKey = "wick.ema";
}  // namespace

std::map<std::string, at::Tensor> Trainer::joined_state() {
  auto mine = optim_->state();
  if (sharded_masters_)
    for (const auto& [name, p] : stepped_) mine[name + "." + kMasterKey] = p.detach();
  if (sharded_ema_)
    for (const auto& [name, t] : ema_) mine[name + "." + kEmaKey] = t;
  auto out = join_pieces(std::move(mine), "gathering the sharded optimizer state at step " + std::to_string(step_));
  for (const auto& [name, p] : params_)
    for (const auto& [key, prefix] : {std::pair{kMasterKey, kMasterPrefix}, std::pair{kEmaKey, kEmaPrefix}}) {
      auto it = out.find(name + "." + key);
      if (it == out.end()) continue;
      out.emplace(prefix + name, it->second);
      out.erase(it);
    }
  return out;
}

std::map<std::string, at::Tensor> Trainer::joined_ema() {
  std::map<std::string, at::Tensor> mine, out;
  for (const auto& [name, t] : ema_) mine[name + "." + kEmaKey] = t;
  auto joined = join_pieces(std::move(mine), "gathering the average of the weights at step " + std::to_string(step_));
  for (const auto& [name, p] : params_)
    if (auto it = joined.find(name + "." + kEmaKey); it != joined.end()) out.emplace(name, it->second);
  return out;
}

std::map<std::string, at::Tensor> Trainer::join_pieces(std::map<std::string, at::Tensor> mine, const std::string& what) {
  Group& group = *cfg_.group;
  // 1. names, dtypes and shapes through the store; 2. the bytes, each rank's
  // in one message to rank 0
  nlohmann::json meta = nlohmann::json::array();
  std::vector<at::Tensor> bytes;
  std::int64_t total = 0;
  for (const auto& [k, t] : mine) {
    meta.push_back({k, static_cast<int>(t.scalar_type()), t.sizes().vec()});
    bytes.push_back(t.detach().contiguous().reshape({-1}).view(at::kByte).to(group.device()));
    total += static_cast<std::int64_t>(t.nbytes());
  }
  const auto metas = group.gather_strings(meta.dump(), what);
  if (group.rank() != 0) {
    if (total > 0) {
      at::Tensor flat = at::cat(bytes);
      group.send(flat, 0, what);
    }
    return {};
  }
  bytes.clear();
  std::vector<std::map<std::string, at::Tensor>> by_rank(static_cast<std::size_t>(group.size()));
  by_rank[0] = mine;
  for (int r = 1; r < group.size(); ++r) {
    const auto m = nlohmann::json::parse(metas[static_cast<std::size_t>(r)]);
    std::int64_t n = 0;
    for (const auto& e : m) {
      std::int64_t numel = 1;
      for (const auto d : e[2]) numel *= d.get<std::int64_t>();
      n += numel * static_cast<std::int64_t>(c10::elementSize(static_cast<at::ScalarType>(e[1].get<int>())));
    }
    if (n == 0) continue;
    at::Tensor flat = at::empty({n}, at::TensorOptions().dtype(at::kByte).device(group.device()));
    group.recv(flat, r, what);
    flat = flat.cpu();
    std::int64_t at_byte = 0;
    for (const auto& e : m) {
      const auto dtype = static_cast<at::ScalarType>(e[1].get<int>());
      const auto sizes = e[2].get<std::vector<std::int64_t>>();
      std::int64_t numel = 1;
      for (auto d : sizes) numel *= d;
      const std::int64_t nb = numel * static_cast<std::int64_t>(c10::elementSize(dtype));
      // a copy first: view(dtype) needs an offset that is a multiple of the wider element
      by_rank[static_cast<std::size_t>(r)][e[0].get<std::string>()] =
          flat.narrow(0, at_byte, nb).clone().view(dtype).reshape(sizes);
      at_byte += nb;
    }
  }
  // every parameter's pieces in order (the pieces of all ranks tile it)
  std::map<std::string, at::Tensor> out;
  std::vector<std::vector<std::pair<int, ShardPiece>>> pieces(params_.size());
  for (int r = 0; r < group.size(); ++r)
    for (const auto& p : reducer_->pieces(r)) pieces[p.param].emplace_back(r, p);
  std::set<std::string> claimed;
  for (std::size_t k = 0; k < params_.size(); ++k) {
    const auto& [name, param] = params_[k];
    auto& ps = pieces[k];
    std::sort(ps.begin(), ps.end(), [](const auto& a, const auto& b) { return a.second.start < b.second.start; });
    std::set<std::string> keys;
    for (const auto& [r, p] : ps)
      for (const auto& [key, t] : entries_of(by_rank[static_cast<std::size_t>(r)], name)) keys.insert(key);
    for (const auto& key : keys) {
      std::vector<at::Tensor> parts;
      bool elementwise = true;
      int holder = -1;  // a rank that keeps this entry
      for (const auto& [r, p] : ps)
        if (by_rank[static_cast<std::size_t>(r)].count(name + "." + key)) holder = r;
      for (const auto& [r, p] : ps) {
        auto& st = by_rank[static_cast<std::size_t>(r)];
        auto it = st.find(name + "." + key);
        if (it == st.end())
          throw Error("shard: the optimizer keeps state '" + name + "." + key + "' on rank " + std::to_string(holder) +
                      " but not on rank " + std::to_string(r) + ", which holds another piece of the same parameter");
        parts.push_back(it->second.cpu());
        elementwise = elementwise && it->second.numel() == p.numel;
      }
      at::Tensor joined;
      if (elementwise) joined = at::cat([&] {
                                  std::vector<at::Tensor> flat;
                                  for (auto& t : parts) flat.push_back(t.reshape({-1}));
                                  return flat;
                                }()).view(param.sizes());
      else if (parts.size() == 1 || equal_scalars(parts)) joined = parts.front();
      else {
        std::vector<at::Tensor> flat;
        for (auto& t : parts) flat.push_back(t.reshape({-1}));
        joined = at::cat(flat);  // per block: the pieces' blocks in order
        if (block_of(param.numel(), joined.numel()) == 0)
          throw Error("shard: the optimizer's state '" + name + "." + key + "' holds " +
                      std::to_string(joined.numel()) + " elements over the pieces of a parameter of " +
                      std::to_string(param.numel()) + ": neither one per element, one per block of a power of two up "
                      "to " + std::to_string(kShardAlign) + ", nor a counter every piece keeps, so it cannot be "
                      "joined into one rank's state (this optimizer cannot run sharded)");
      }
      out[name + "." + key] = joined;
      claimed.insert(name + "." + key);
    }
  }
  // entries of no parameter (an optimizer's own counters): rank 0's
  for (const auto& [k, t] : mine)
    if (!claimed.count(k)) out.emplace(k, t);
  return out;
}

std::map<std::string, at::Tensor> Trainer::cut_state(const std::map<std::string, at::Tensor>& whole,
                                                     const std::string& where) const {
  std::map<std::string, at::Tensor> out;
  std::set<std::string> of_params;
  for (const auto& [name, p] : params_)
    for (const auto& [key, t] : entries_of(whole, name)) of_params.insert(name + "." + key);
  for (const auto& [k, t] : whole)
    if (!of_params.count(k)) out.emplace(k, t);  // entries of no parameter go to every rank
  const auto& pieces = reducer_->my_pieces();
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const ShardPiece& piece = pieces[i];
    const auto& [name, param] = params_[piece.param];
    const std::int64_t n = param.numel();
    for (const auto& [key, t] : entries_of(whole, name)) {
      at::Tensor cut;
      if (t.numel() == n) {
        cut = t.reshape({-1}).narrow(0, piece.start, piece.numel);
        if (piece.numel == n) cut = cut.view(param.sizes());
      } else if (piece.numel == n || t.dim() == 0) {
        cut = t;  // a whole parameter's own, or a counter every piece keeps
      } else {
        // per block of b elements, b a power of two dividing kShardAlign: the
        // one b with ceil(n / b) blocks (unique for n > kShardAlign, which a
        // parameter cut across ranks is)
        const std::int64_t block = block_of(n, t.numel());
        if (block == 0)
          throw Error(where + ": optimizer state '" + name + "." + key + "' holds " + std::to_string(t.numel()) +
                      " elements for a parameter of " + std::to_string(n) +
                      ": neither one per element, one per block of a power of two up to " +
                      std::to_string(kShardAlign) + ", nor a single value, so it cannot be cut into this rank's piece");
        cut = t.reshape({-1}).narrow(0, piece.start / block, (piece.numel + block - 1) / block);
      }
      out[name + "." + key] = cut.contiguous();
    }
  }
  return out;
}

}  // namespace wick
