// Evaluation: loss and metrics over a data set without gradients, under the
// training precision, halving a micro-batch that runs out of memory.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <deque>

#include "distributed/group.hpp"
#include "train/loader.hpp"
#include "train/trainer.hpp"
#include "train/trainer_internal.hpp"
#include "util/system.hpp"

namespace wick {
using namespace trainer_internal;

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
