// `wick plan`: one optimizer step per setting on the recipe's data, the peak
// memory held by tensors and the time of each, then the fastest setting that
// fits the device.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <set>

#include "observe/format.hpp"
#include "observe/progress.hpp"
#include "train/deferred.hpp"
#include "train/partition.hpp"
#include "train/run_internal.hpp"
#include "train/run_options.hpp"
#include "train/trainer_internal.hpp"
#include "util/memory.hpp"
#include "util/system.hpp"
#include "wick/kit/deferral.hpp"
#include "wick/kit/weights.hpp"

namespace wick {
namespace {

// What a row changes of the recipe.
struct Setting {
  std::string precision;
  Value checkpointing;
  std::int64_t micro;
  std::string shard;
  bool host_tables = false;  // offload_embeddings
  bool same(const Setting& o) const {
    return precision == o.precision && checkpointing.repr() == o.checkpointing.repr() && micro == o.micro &&
           shard == o.shard && host_tables == o.host_tables;
  }
};

struct Row {
  std::string name;
  Setting o;
  bool ok = false;
  std::string err;
  double peak = 0, seconds = 0;
  // the peak while the trainer starts (the model moved to the device and,
  // under shard = "parameters", divided) or ends (gathered back): a run must
  // fit there too
  double edge_peak = 0;
  double run_peak() const { return std::max(peak, edge_peak); }
  std::map<std::string, std::int64_t> breakdown;
  // a row whose settings an earlier row has (the "all of these" row of a
  // recipe that sets them all already): that row's figures, not measured
  // again (a second measurement only showed two timings of one setting)
  std::string same_as;
};

// Runs `fn` for `row`; an error marks the row failed with the error's text.
template <class F>
void attempt(Row& row, F&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    row.ok = false;
    row.err = e.what_without_backtrace();
  } catch (const std::exception& e) {
    row.ok = false;
    row.err = e.what();
  }
}

// state: weights, gradients and optimizer state held at the step (what shard divides)
double state_of(const Row& row) {
  const auto& b = row.breakdown;
  if (const auto it = b.find("state"); it != b.end()) return static_cast<double>(it->second);
  return static_cast<double>(b.at("weights") + b.at("gradients") + b.at("optimizer"));
}

class Planner {
 public:
  Planner(const RunRequest& req, std::int64_t device_memory_given);
  void run();

 private:
  Row& add_row(const std::string& name, Setting o);
  void measure(Row& row);
  void gather_ranks(Row& row);
  void print_rows() const;
  void choose();

  const RunRequest& req_;
  Resolved r_;
  const std::string L_ = "wick plan";
  // --ranks N: every rank measures; the figures are those of the rank whose
  // peak is highest, and only rank 0 prints
  std::shared_ptr<Group> group_;
  bool rank0_ = true, cuda_ = false;
  int world_ = 1;
  std::string shard_, precision_, mixed_;
  std::int64_t per_rank_ = 0, micro_ = 0;
  double avail_ = 0;
  std::vector<std::string> blocks_;
  // bf16-true and fp16-true convert the weights as the first row's trainer
  // is made: every row keeps that precision (no row tries another), so the
  // rows after it meet the weights as the recipe would train them
  Value given_ck_, all_ck_;
  // offload_embeddings: as given, and whether the model's input embeddings
  // could stay in host memory (offered, and frozen)
  bool host_given_ = false, tables_offered_ = false;
  std::vector<Row> rows_;
  std::optional<std::int64_t> host_only_;
  // a model built deferred (or left in a file): its hollow tensors, made
  // hollow again after each row so every row starts as the run would; and
  // whether the run ends in a file (return_weights = "file")
  std::vector<at::Tensor> hollow_at_start_;
  // the others (norms, adapters: what the deferral does not make), copied:
  // a row that fails while the weights are divided loses them
  std::vector<std::pair<at::Tensor, at::Tensor>> made_at_start_;
  bool ends_in_file_ = false;
  void make_deferred_again();
};

Planner::Planner(const RunRequest& req, std::int64_t device_memory_given) : req_(req), r_(resolve(req)) {
  group_ = Group::world(r_.device);
  rank0_ = !group_ || group_->rank() == 0;
  world_ = group_ ? group_->size() : 1;
  shard_ = r_.o.get_string("shard");
  cuda_ = is_cuda(r_.device);
  per_rank_ = r_.micro_auto ? r_.o.get_int("batch_size") : r_.micro_batch * r_.accumulate;
  micro_ = r_.micro_auto ? per_rank_ : r_.micro_batch;
  avail_ = static_cast<double>(device_memory_given > 0 ? device_memory_given : device_memory(r_.device));
  blocks_ = r_.obj.model->blocks();
  precision_ = r_.o.get_string("precision");
  mixed_ = precision_ == "fp32" ? "bf16-mixed" : precision_;
  given_ck_ = r_.o.at("checkpointing");
  all_ck_ = blocks_.empty() ? given_ck_ : Value(true);
  host_given_ = r_.o.get_bool("offload_embeddings");
  try {  // the trainer's own check, without its error
    tables_offered_ = !trainer_internal::offered_host_tables(*r_.obj.model).empty();
  } catch (const Error&) {
    tables_offered_ = false;
  }
  rows_.reserve(64);  // rows are handed out by reference while more are added
  if (is_deferred(*r_.obj.model)) {
    at::NoGradGuard no_grad;
    for (const auto& [name, t] : module_state(*r_.obj.model))
      if (is_hollow(t)) hollow_at_start_.push_back(t);
      else made_at_start_.emplace_back(t, t.detach().clone());
  }
  ends_in_file_ = r_.o.get_string("return_weights") == "file";
}

void Planner::make_deferred_again() {
  if (hollow_at_start_.empty()) return;
  for (const auto& t : hollow_at_start_)
    if (!is_hollow(t)) t.set_data(hollow(t.sizes(), t.options()));
  // the others their own storage (a view of a gathered unit's buffer would
  // keep the whole unit), or their first values where a failed row lost them
  at::NoGradGuard no_grad;
  for (const auto& [t, first] : made_at_start_)
    if (is_hollow(t) || !t.has_storage()) t.set_data(first.clone());
    else if (t.storage().nbytes() > t.nbytes()) t.set_data(t.detach().clone());
  for (auto& p : r_.obj.model->parameters()) p.mutable_grad() = at::Tensor();  // (a row's gradients)
  mark_partitioned(r_.obj.model, "");  // (a row's end dropped the weights, or failed: they are made again)
}

Row& Planner::add_row(const std::string& name, Setting o) {
  if (const auto it = std::find_if(rows_.begin(), rows_.end(), [&](const Row& x) { return x.o.same(o); });
      it != rows_.end()) {
    Row copy = *it;
    copy.name = name;
    copy.same_as = it->same_as.empty() ? it->name : it->same_as;
    rows_.push_back(std::move(copy));
    return rows_.back();
  }
  rows_.push_back(Row{name, std::move(o)});
  Row& row = rows_.back();
  attempt(row, [&] { measure(row); });
  // the next row starts without this one's optimizer state (or its start
  // would count it) and, a deferred model, deferred again
  attempt(row, [&] { r_.optim->load_state({}); });
  make_deferred_again();
  return row;
}

void Planner::measure(Row& row) {
  std::map<std::string, Value> opts = r_.o.values();
  opts["precision"] = Value(row.o.precision);
  opts["checkpointing"] = row.o.checkpointing;
  opts["shard"] = Value(row.o.shard);
  opts["offload_embeddings"] = Value(row.o.host_tables);
  opts["on_oom"] = Value("fail");
  if (row.o.shard != "parameters") opts["return_weights"] = Value("gathered");  // (a file is ZeRO-3's end)
  std::map<std::string, Value> given;
  for (const auto& opt : run_options())
    if (opt.run && !opts[opt.name].is_nil()) given[opt.name] = opts[opt.name];
  Resolved rr = r_;
  rr.o = validate_run_options(L_, given, {}, false);
  reset_peaks();
  TrainerConfig tc = make_trainer_config(rr, 1);
  tc.quiet_deferred = true;  // made whole again each row that does not divide it
  Trainer trainer(r_.obj.model, r_.optim, nullptr, tc);
  const auto start_peak = tensor_peak(cuda_);
  // each row from no optimizer state: a shard row's pieces must not meet the
  // whole tensors' state an earlier row left in the shared optimizer
  r_.optim->load_state({});
  if (!host_only_) {
    const auto b0 = trainer.memory_breakdown();
    auto m0 = memory_stats(cuda_);
    host_only_ = cuda_ ? 0 : std::max<std::int64_t>(0, m0["cpu_tensors"] - b0.at("weights") - b0.at("optimizer"));
  }
  // two micro-batches when the recipe accumulates: the second holds the
  // summed gradients beside its own, as in training
  const std::int64_t size = r_.obj.data->size();
  const std::int64_t m = std::min(row.o.micro, size);
  const std::int64_t n = std::min(per_rank_ / row.o.micro > 1 ? 2 * m : m, size);
  const auto window = data_window(*r_.obj.data, n, m);
  trainer.step(window);  // first: allocates the optimizer state
  reset_peaks();
  // the median of five steps: one step's noise (another process on the
  // core) must not decide between settings, nor the slower step after it
  // (caches cold once the other process leaves, measured about 2x on a 10 MB
  // model), which a median of three would take
  constexpr int kTimed = 5;
  std::vector<double> times;
  for (int k = 0; k < kTimed; ++k) {
    const double t0 = now_seconds();
    attempt(row, [&] {
      trainer.step(window);
      row.ok = true;
    });
    times.push_back(now_seconds() - t0);
  }
  std::sort(times.begin(), times.end());
  row.breakdown = trainer.memory_breakdown();
  row.peak = static_cast<double>(tensor_peak(cuda_) - *host_only_);
  reset_peaks();
  // a shard = "parameters" row's end: the model whole again for the next
  // row, or (a deferred model ending in a file) each unit gathered in turn
  // as the run's write does, the model then made deferred again
  if (ends_in_file_ && !hollow_at_start_.empty()) {
    std::set<const c10::TensorImpl*> keep;  // what was not hollow at the start: norms, adapters
    for (const auto& [t, first] : made_at_start_) keep.insert(t.unsafeGetTensorImpl());
    trainer.drop_weights_back(keep);
  }
  else
    trainer.gather_weights_back();
  row.edge_peak = static_cast<double>(std::max(start_peak, tensor_peak(cuda_)) - *host_only_);
  row.seconds = times[kTimed / 2] / static_cast<double>(n) * static_cast<double>(per_rank_);
  if (group_) gather_ranks(row);
}

// Several ranks: the rank holding the most gives the peak and breakdown, the
// slowest rank the time.
void Planner::gather_ranks(Row& row) {
  const auto& bd = row.breakdown;
  at::Tensor mine = at::tensor({row.ok ? 1.0 : 0.0, row.peak, static_cast<double>(bd.at("weights")),
                                static_cast<double>(bd.at("gradients")), static_cast<double>(bd.at("optimizer")),
                                static_cast<double>(bd.at("master_weights")), row.seconds, row.edge_peak},
                               at::kDouble)
                        .to(group_->device());
  at::Tensor all = at::empty({world_ * mine.numel()}, mine.options());
  group_->all_gather(all, mine, "wick plan: gathering the ranks' figures");
  all = all.cpu().view({world_, mine.numel()});
  const auto most = all.select(1, 1).argmax().item<std::int64_t>();
  const auto f = [&](int k) { return all[most][k].item<double>(); };
  const auto failed = all.select(1, 0).argmin().item<std::int64_t>();
  if (all[failed][0].item<double>() == 0 && row.ok) {
    row.ok = false;
    row.err = "failed on rank " + std::to_string(failed);
  }
  row.peak = f(1);
  row.breakdown["weights"] = static_cast<std::int64_t>(f(2));
  row.breakdown["gradients"] = static_cast<std::int64_t>(f(3));
  row.breakdown["optimizer"] = static_cast<std::int64_t>(f(4));
  row.breakdown["master_weights"] = static_cast<std::int64_t>(f(5));
  row.breakdown["rank"] = most;
  // the state column: the most any rank holds (weights + gradients +
  // optimizer), whichever rank had the highest peak (that one varies with
  // transient buffers, and with uneven pieces its state by a few KiB)
  row.breakdown["state"] =
      static_cast<std::int64_t>((all.select(1, 2) + all.select(1, 3) + all.select(1, 4)).max().item<double>());
  row.seconds = all.select(1, 6).max().item<double>();
  row.edge_peak = all.select(1, 7).max().item<double>();
}

void Planner::run() {
  const std::string& S = shard_;
  const bool H = host_given_;
  const Row base = add_row("as given", {precision_, given_ck_, micro_, S, H});
  if (!base.ok) throw Error(L_ + ": one step of the recipe as given failed: " + base.err);
  if (precision_ == "fp32") add_row("precision = \"bf16-mixed\"", {"bf16-mixed", given_ck_, micro_, S, H});
  const bool ck_all = given_ck_.is_bool() && given_ck_.as_bool();
  if (!blocks_.empty() && !ck_all) add_row("checkpointing = true", {precision_, Value(true), micro_, S, H});
  if (tables_offered_ && !H) add_row("offload_embeddings = true", {precision_, given_ck_, micro_, S, true});
  const bool halve = micro_ > 1 && micro_ % 2 == 0;
  if (halve)
    add_row(strf("micro_batch = %lld, accumulate x 2", static_cast<long long>(micro_ / 2)),
            {precision_, given_ck_, micro_ / 2, S, H});
  // several ranks: each setting of shard the recipe does not use
  for (const char* sh : {"none", "optimizer", "gradients", "parameters"})
    if (world_ > 1 && sh != S) add_row(strf("shard = \"%s\"", sh), {precision_, given_ck_, micro_, sh, H});
  // the shard setting that holds the least
  const std::string least = world_ > 1 ? "parameters" : S;
  add_row("all of these", {mixed_, all_ck_, halve ? micro_ / 2 : micro_, least, H || tables_offered_});
  print_rows();
  if (avail_ > 0)
    choose();
  else if (rank0_)
    std::printf("no device memory given: --device-memory 8GiB suggests settings that fit\n");
  std::fflush(stdout);
}

// Every rank measures the same rows (candidates too); rank 0 prints.
void Planner::print_rows() const {
  if (!rank0_) return;
  const Row& base = rows_.front();
  const auto& bd = base.breakdown;
  std::printf("wick plan: %s on %s, micro_batch %lld x accumulate %lld (batch %lld per rank), precision %s\n",
              req_.recipe.empty() ? "recipe" : req_.recipe.c_str(), r_.device.c_str(), static_cast<long long>(micro_),
              static_cast<long long>(per_rank_ / micro_), static_cast<long long>(per_rank_), precision_.c_str());
  if (world_ > 1)
    std::printf("  measured on %d ranks, shard = \"%s\": each figure is the rank holding the most (rank %lld as given)\n",
                world_, shard_.c_str(), static_cast<long long>(bd.at("rank")));
  const auto b = [&](const char* k) { return fmt_bytes(static_cast<double>(bd.at(k))); };
  const double state = static_cast<double>(bd.at("weights") + bd.at("gradients") + bd.at("optimizer"));
  std::printf("  one step as given: peak %s = weights %s + gradients %s + optimizer %s + activations and data %s\n",
              fmt_bytes(base.peak).c_str(), b("weights").c_str(), b("gradients").c_str(), b("optimizer").c_str(),
              fmt_bytes(std::max(0.0, base.peak - state)).c_str());
  const bool deferred = !hollow_at_start_.empty(), divided = world_ > 1 && shard_ == "parameters";
  std::printf("  the run's start and end as given (the model %s, %s): peak %s\n",
              deferred && divided ? "built deferred, each rank making its chunks"
              : divided           ? "moved to the device, divided under shard = \"parameters\""
              : deferred          ? "built deferred, made whole on the device"
                                  : "moved to the device",
              ends_in_file_ && deferred && divided ? "written to a file a unit at a time"
              : ends_in_file_ && divided           ? "gathered back (the run writes a file; measured so for a deferred model)"
                                                   : "gathered back",
              fmt_bytes(base.edge_peak).c_str());
  std::printf("  estimate as given: %lld bytes on the device\n", static_cast<long long>(base.run_peak()));
  std::printf("  %-44s %12s %8s %14s %12s %12s\n", "setting", "peak", "saving", "time per batch", "state",
              "start/end");
  for (const auto& row : rows_) {
    if (row.ok)
      std::printf("  %-44s %12s %7.0f%% %13.2fx %12s %12s%s\n", row.name.c_str(), fmt_bytes(row.peak).c_str(),
                  100 * (1 - row.peak / base.peak), row.seconds / base.seconds, fmt_bytes(state_of(row)).c_str(),
                  fmt_bytes(row.edge_peak).c_str(),
                  row.same_as.empty() ? "" : ("  (the settings of \"" + row.same_as + "\")").c_str());
    else
      std::printf("  %-44s failed: %s%s\n", row.name.c_str(), row.err.substr(0, row.err.find('\n')).c_str(),
                  row.same_as.empty() ? "" : ("  (the settings of \"" + row.same_as + "\")").c_str());
  }
}

// Every candidate that keeps the batch, measured; the fastest that fits wins.
void Planner::choose() {
  const double budget = 0.9 * avail_;
  std::vector<Setting> cands;
  // each with the recipe's shard, then (several ranks) with ZeRO-2's (no
  // more traffic than none) and ZeRO-3's (the least memory)
  auto cand = [&](const std::string& prec, const Value& ck, std::int64_t m, bool host = false) {
    host = host || host_given_;
    cands.push_back({prec, ck, m, shard_, host});
    for (const std::string sh : {"gradients", "parameters"})
      if (world_ > 1 && sh != shard_) cands.push_back({prec, ck, m, sh, host});
  };
  cand(precision_, given_ck_, micro_);
  cand(mixed_, given_ck_, micro_);
  if (!blocks_.empty()) {
    cand(precision_, Value(true), micro_);
    cand(mixed_, Value(true), micro_);
  }
  // the input embedding in host memory: the same micro-batch, a little slower
  if (tables_offered_ && !host_given_) cand(mixed_, all_ck_, micro_, true);
  for (std::int64_t m = micro_; m > 1;) {
    m = m / 2;
    while (per_rank_ % m != 0) --m;
    cand(precision_, given_ck_, m);
    cand(mixed_, all_ck_, m);
  }
  const Row base = rows_.front();
  if (rank0_ && base.ok && base.run_peak() <= budget)
    std::printf("the recipe as given fits %s (90%%: %s): peak %s\n", fmt_bytes(avail_).c_str(),
                fmt_bytes(budget).c_str(), fmt_bytes(base.run_peak()).c_str());
  std::optional<Row> choice;
  for (const auto& o : cands) {
    const auto it = std::find_if(rows_.begin(), rows_.end(), [&](const Row& x) { return x.o.same(o); });
    const Row x = it != rows_.end() ? *it : add_row("candidate", o);
    // another setting wins only when clearly faster: the settings as given
    // (the first candidate) keep a tie
    if (x.ok && x.run_peak() <= budget && (!choice || x.seconds < 0.9 * choice->seconds)) choice = x;
    // smaller micro-batches only get slower: stop once one fits
    if (choice && o.micro < micro_) break;
  }
  if (!rank0_) return;
  if (!choice) {
    std::printf("nothing tried fits %s: even one sample with bf16-mixed and checkpointing needs more; train fewer "
                "parameters (lora), shorten sequences or shrink images\n",
                fmt_bytes(avail_).c_str());
    return;
  }
  const Value& ck = choice->o.checkpointing;
  std::string cks = ck.is_list() ? "{ " : ck.repr();
  if (ck.is_list()) {
    for (std::size_t i = 0; i < ck.as_list().size(); ++i) cks += (i ? ", " : "") + ck.as_list()[i].as_string();
    cks += " }";
  }
  const std::string shard_text = (world_ > 1 ? ", shard = \"" + choice->o.shard + "\"" : "") +
                                 (choice->o.host_tables ? ", offload_embeddings = true" : "");
  std::printf("fastest that fits %s (90%%: %s): precision = \"%s\", checkpointing = %s, micro_batch = %lld, "
              "accumulate = %lld%s (peak %s, the batch of %lld kept)\n",
              fmt_bytes(avail_).c_str(), fmt_bytes(budget).c_str(), choice->o.precision.c_str(), cks.c_str(),
              static_cast<long long>(choice->o.micro), static_cast<long long>(per_rank_ / choice->o.micro),
              shard_text.c_str(), fmt_bytes(choice->run_peak()).c_str(), static_cast<long long>(per_rank_));
}

}  // namespace

void plan_training(const RunRequest& req, std::int64_t device_memory_given) {
  Planner(req, device_memory_given).run();
}

}  // namespace wick
