#pragma once
// ZeRO-3 (shard = "parameters") on the model's side: the block runner that
// gathers a block's weights around it, the units the weights are divided
// into, and the stand-in micro-batch a rank with fewer micro-batches runs so
// that its gathers pair up with the other ranks'. The gathering, releasing,
// draining and replaying themselves are the GradReducer's (reducer.hpp).

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "wick/model.hpp"

namespace wick {

class GradReducer;
class Group;
struct Nf4Weight;

/// ZeRO-3's Model::run_block: a block's whole weights gathered before it runs
/// (and again before its backward, or its recomputation), freed once it has;
/// `inner` (the recipe's checkpointing) runs inside.
class PartitionRunner : public BlockRunner {
 public:
  PartitionRunner(GradReducer* reducer, std::map<std::string, std::size_t> units, BlockRunner* inner)
      : reducer_(reducer), units_(std::move(units)), inner_(inner) {}
  std::vector<at::Tensor> run(const std::string& block, const Fn& fn, const std::vector<at::Tensor>& inputs) override;

 private:
  GradReducer* reducer_;
  std::map<std::string, std::size_t> units_;
  BlockRunner* inner_;
};

/// The units of ZeRO-3: one per declared block (the trainable parameters
/// and the frozen tensors named "<block>.", the longest block name winning),
/// the last block first, and the tensors in no block last (the root unit):
/// the order their gradients complete in backward. `frozen`: the model's
/// tensors that take no gradient (frozen parameters, buffers), divided with
/// the unit they fall in; a block of frozen tensors only is a unit too.
struct Zero3Units {
  std::vector<std::vector<std::size_t>> units;   ///< indices into the parameters
  std::vector<std::vector<std::size_t>> frozen;  ///< indices into the frozen tensors, per unit
  std::map<std::string, std::size_t> unit_of_block;
  std::optional<std::size_t> root;
};
Zero3Units zero3_units(const std::vector<std::pair<std::string, at::Tensor>>& params,
                       const std::vector<std::string>& blocks,
                       const std::vector<std::pair<std::string, at::Tensor>>& frozen = {});

/// Throws Error when one tensor (tied weights, reached by two names) falls
/// in two units: its weights would be freed while the other reads them.
void check_tied_units(const std::vector<std::pair<std::string, at::Tensor>>& params, const Zero3Units& u,
                      const std::vector<std::pair<std::string, at::Tensor>>& frozen = {});

/// A ZeRO-3 stand-in runs in evaluation mode: its collectives are a training
/// micro-batch's, but it moves no running statistics (batch norm) and draws
/// no dropout, and one sample is no batch to normalise over.
class StandInMode {
 public:
  explicit StandInMode(Model& m) : model_(m) { model_.train(false); }
  ~StandInMode() { model_.train(true); }
  StandInMode(const StandInMode&) = delete;
  StandInMode& operator=(const StandInMode&) = delete;

 private:
  Model& model_;
};

/// A deferred 4-bit weight's values made in parts (wick::Emit::nf4): this
/// rank keeps of `hollow`'s tensors what reducer.kept says, so it reads and
/// quantizes of `w` (the float weight) only the values its packed codes come
/// from, and the absmax constants of an even share of the blocks. The ranks
/// all-gather those constants (4 bytes per 64 values), so that the double
/// quantization's mean is the whole weight's: the bits nf4_quantize(w)
/// gives, on every rank count. Every rank calls it for each such weight, in
/// the same order (it is a collective). False when `hollow`'s tensors are
/// none of the units'.
bool fill_nf4(GradReducer& reducer, Group& group, const Nf4Weight& hollow, const at::Tensor& w);

/// One sample of a micro-batch (its tensors' first rows, copied), or the
/// micro-batch itself when its tensors differ in their first dimension: what
/// a ZeRO-3 rank runs at loss x 0 to pair its collectives with the others'.
Batch one_sample(const Batch& b);

}  // namespace wick
