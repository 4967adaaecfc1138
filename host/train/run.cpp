#include "train/run.hpp"

// wick.train's loop, read top to bottom in Run::go(): the options resolved
// (run_resolve.cpp), the run folder claimed (run_folder.cpp), the steps
// counted, the trainer made, a checkpoint resumed (resume.cpp), then epochs
// of windows with their records, checkpoints, evaluations (monitor.cpp) and
// callbacks, and at the end the summary.

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <tuple>

#include "observe/profile.hpp"
#include "observe/progress.hpp"
#include "observe/runlog.hpp"
#include "train/freeze.hpp"
#include "train/loader.hpp"
#include "observe/format.hpp"
#include "train/run_internal.hpp"
#include "util/memory.hpp"
#include "util/system.hpp"

namespace fs = std::filesystem;

namespace wick {
namespace {

// The step record's memory fields: allocated, reserved and peak on CUDA;
// resident and peak resident, and the bytes held by tensors, on the CPU.
void add_memory(nlohmann::json& rec, std::map<std::string, std::int64_t>& m, bool cuda) {
  if (cuda) {
    rec["mem_allocated"] = m["cuda_allocated"];
    rec["mem_reserved"] = m["cuda_reserved"];
    rec["mem_peak"] = m["cuda_peak"];
    if (m.count("cuda_device_used")) rec["mem_device"] = m["cuda_device_used"];
  } else {
    rec["mem_resident"] = m["resident"];
    rec["mem_peak_resident"] = m["peak_resident"];
    rec["mem_tensors"] = m["cpu_tensors"];
    rec["mem_tensors_peak"] = m["cpu_tensors_peak"];
  }
}

// A step whose numbers may still be on the device, with what the host knew
// when it ended.
struct PendingStep {
  StepStats stats;
  std::int64_t epoch = 0;
  double time = 0;
  std::map<std::string, std::int64_t> memory;
};

nlohmann::json record_of(const PendingStep& p, bool cuda) {
  const StepStats& s = p.stats;
  nlohmann::json rec = {{"step", s.step},   {"loss", s.loss},   {"items", s.items},       {"micro_batches", s.micro_batches},
                        {"lr", s.lr},       {"grad_norm", s.grad_norm}, {"seconds", s.seconds}, {"epoch", p.epoch},
                        {"skipped", s.skipped}, {"time", p.time},
                        {"items_per_s", static_cast<double>(s.items) / std::max(s.seconds, 1e-9)}};
  if (s.loss_scale > 0) rec["loss_scale"] = s.loss_scale;
  if (s.split > 1) rec["split"] = s.split;
  if (s.oom_retries > 0) rec["oom_retries"] = s.oom_retries;
  for (const auto& [k, v] : s.metrics) rec[k] = v;
  for (const auto& [k, v] : s.group_lrs) rec[k] = v;
  auto mem = p.memory;
  add_memory(rec, mem, cuda);
  return rec;
}


// A run of wick.train: its objects, the state of its loop, and the records it
// hands to observers and returns.
class Run {
 public:
  explicit Run(const RunRequest& req);
  nlohmann::json go();

 private:
  // the stages, in the order go() runs them
  void claim_folder();
  void count_steps();
  void choose_profile();
  void make_trainer();
  std::optional<nlohmann::json> resume();
  void make_observers();
  void train_epochs();
  void finish(bool interrupted);
  void summarize();
  // within the loop
  void profile_before_step();
  void profile_after_step(bool ended);
  void train_step(std::vector<Batch> window, std::int64_t log_every, bool& stop);
  void flush();
  void save(const char* why, std::optional<double> value = std::nullopt);
  void evaluate();
  void take_reply(const CallbackReply& reply, const char* by, nlohmann::json* rec);
  bool agreed_stop();
  LoaderConfig loader_config(std::int64_t micro, std::int64_t acc) const;
  nlohmann::json summary_so_far() const;

  const RunRequest& req_;
  Resolved r_;
  const std::string& L_;
  const bool cuda_;
  const int world_;
  const fs::path out_, ckpt_dir_;
  RunFolderLock lock_;
  PriorRun prior_;
  ResumePoint from_;
  std::int64_t per_rank_batch_ = 0, per_epoch_ = 0, epochs_ = 0, total_ = 0, eval_micro_ = 0;
  std::optional<Trainer> trainer_;
  std::optional<TrainedParameters> trained_;
  std::optional<Loader> loader_;
  Group* group_ = nullptr;
  std::int64_t coll0_ = 0, bytes0_ = 0, sent0_ = 0;
  std::int64_t epoch_ = 0, first_window_ = 0;
  bool coupled_ = false;
  std::optional<Monitor> mon_;
  // the recipe's callbacks: on rank 0 unless asked for on every rank
  bool call_here_ = true;
  std::optional<nlohmann::json> stop_request_;           // {by, reason, step} from a callback or patience
  std::vector<std::pair<std::string, double>> save_log_;  // on_save's scalars, for the next step's record
  // observers: the run folder (rank 0), the progress line, the caller's
  std::vector<std::shared_ptr<Observer>> observers_;
  std::shared_ptr<ProgressObserver> progress_;
  bool every_step_ = false;  // on_step sees each step as it ends: its numbers are read every step
  RunStart start_;
  nlohmann::json run_ = {{"status", "running"}, {"history", nlohmann::json::array()}};
  double t_start_ = 0;
  std::int64_t peak_ = 0, step_peak_ = 0, offload_peak_ = 0, held_before_ = 0, start_peak_ = 0;
  std::pair<std::int64_t, std::int64_t> resident_now_{0, 0};  // the last read of the process's memory
  std::vector<PendingStep> pending_;
  nlohmann::json last_;
  std::optional<double> best_;
  bool started_ = false, interrupted_ = false;
  int signal_ = 0;
  // profile: the steps [first, last] recorded (0: none)
  StepProfiler profiler_;
  std::int64_t prof_first_ = 0, prof_last_ = 0, prof_from_ = 0;
  bool prof_after_start_ = false;
};

Run::Run(const RunRequest& req)
    : req_(req),
      r_(resolve(req)),
      L_(r_.label),
      cuda_(is_cuda(r_.device)),
      world_(r_.dist.world_size),
      out_(r_.o.has("out") ? fs::path(r_.o.get_string("out")) : fs::path()),
      ckpt_dir_(out_.empty() ? fs::path() : out_ / "checkpoints") {}

nlohmann::json Run::go() {
  // the steps first: an error in them (the data fill no window, a profile
  // past the end) leaves a folder that overwrite would replace as it was
  count_steps();
  choose_profile();
  claim_folder();
  from_ = find_resume_point(r_, prior_, ckpt_dir_, static_cast<std::int64_t>(r_.obj.data->size()));
  if (world_ > 1)
    if (auto g = Group::world(r_.device)) g->check_same("recipe and wick.train options", fingerprint(r_, req_.recipe));
  at::manual_seed(static_cast<std::uint64_t>(r_.o.get_int("seed")));
  reset_peaks();  // the start's peak: the model moved to the device, divided, a checkpoint read
  make_trainer();
  if (auto done = resume()) return *done;
  start_peak_ = tensor_peak(cuda_);
  mon_ = Monitor::of(r_.o, from_.state);
  make_observers();
  try {
    for (auto& o : observers_) o->on_start(start_);
    started_ = true;
    train_epochs();
    finish(interrupted_);
  } catch (const c10::Error& e) {
    if (started_)
      for (auto& o : observers_) o->on_failure(e.what_without_backtrace(), summary_so_far());
    throw Error(e.what_without_backtrace());
  } catch (const std::exception& e) {
    if (started_)
      for (auto& o : observers_) o->on_failure(e.what(), summary_so_far());
    throw;
  }
  summarize();
  reset_peaks();
  // shard = "parameters": every rank, here, at once
  if (r_.o.get_string("return_weights") == "file") {
    trainer_->write_weights_back(out_ / "model.safetensors");
    run_["weights"] = (out_ / "model.safetensors").string();
  } else {
    trainer_->gather_weights_back();
  }
  // the whole run's peak on this rank: the start, every step and the end
  run_["memory"]["start_peak"] = start_peak_;
  const std::int64_t end_peak = tensor_peak(cuda_);
  run_["memory"]["end_peak"] = end_peak;
  run_["memory"]["run_peak"] = std::max({start_peak_, step_peak_, end_peak});
  for (auto& o : observers_) o->on_end(run_);
  return run_;
}

// A folder that holds a run is refused unless the recipe continues it
// (resume) or replaces it (overwrite): nothing of a run is lost by reuse. One
// writer per folder for the whole run: a second run (another process, or one
// started from this run's callback) is refused, not interleaved.
void Run::claim_folder() {
  if (out_.empty()) return;
  if (r_.rank0) lock_ = RunFolderLock(out_, L_);
  prior_ = prior_run(out_);
  if (prior_.holds && !r_.o.get_bool("resume") && !r_.o.get_bool("overwrite"))
    throw Error(L_ + ": out '" + out_.string() + "' holds a run (" + prior_.what +
                "); resume = true continues it, overwrite = true replaces it, or give another out");
  if (prior_.holds && r_.o.get_bool("overwrite")) {
    if (r_.rank0) {
      remove_run(out_, req_.recipe);
      err_line(L_ + ": overwrite = true: removed the run that was in " + out_.string() + " (" + prior_.what + ")");
    }
    prior_ = PriorRun();
  }
}

LoaderConfig Run::loader_config(std::int64_t micro, std::int64_t acc) const {
  LoaderConfig c;
  c.micro_batch = micro;
  c.accumulate = acc;
  c.shuffle = r_.o.get_bool("shuffle");
  c.seed = static_cast<std::uint64_t>(r_.o.get_int("seed"));
  c.drop_last = r_.o.get_bool("drop_last");
  c.workers = static_cast<int>(r_.o.get_int("workers"));
  c.prefetch = static_cast<int>(r_.o.get_int("prefetch"));
  c.rank = r_.dist.rank;
  c.world_size = world_;
  c.pin_memory = cuda_;
  return c;
}

// The windows of an epoch and the steps of the run.
void Run::count_steps() {
  if (r_.micro_auto) {
    const std::int64_t bs = r_.o.get_int("batch_size");
    if (bs % world_ != 0)
      throw Error(strf("%s: option 'batch_size': %lld is not a multiple of the %d ranks", L_.c_str(),
                       static_cast<long long>(bs), world_));
    per_rank_batch_ = bs / world_;
  }
  // windows per epoch depend on the effective batch only, not on its split
  per_epoch_ = Loader(r_.obj.data, loader_config(r_.micro_auto ? per_rank_batch_ : r_.micro_batch,
                                                 r_.micro_auto ? 1 : r_.accumulate))
                   .windows_per_epoch();
  if (per_epoch_ == 0)
    throw Error(strf("%s: the data (%lld samples) fill no window of %s x %lld with drop_last = true", L_.c_str(),
                     static_cast<long long>(r_.obj.data->size()),
                     r_.micro_auto ? "auto" : std::to_string(r_.micro_batch).c_str(),
                     static_cast<long long>(r_.accumulate)));
  epochs_ = r_.o.get_int("epochs");
  total_ = per_epoch_ * epochs_;
  if (r_.o.get_int("max_steps") > 0 && r_.o.get_int("max_steps") < total_) total_ = r_.o.get_int("max_steps");
}

// profile: true records steps 2 to 4 (after a warm-up step; fewer in a
// shorter run), {first, last} those; a step past the run's last is refused.
void Run::choose_profile() {
  const Value& p = r_.o.at("profile");
  if (p.is_nil() || (p.is_bool() && !p.as_bool())) return;
  if (profiler_in_use())
    throw Error(L_ + ": option 'profile': another run in this process is being profiled (a callback's wick.train "
                "inside a profiled run?); PyTorch's profiler records one at a time: profile one of them");
  if (!cuda_) quiet_kineto_on_cpu();
  if (p.is_bool()) {
    prof_after_start_ = true;  // 2 to 4 counted from the step the run starts at (a resume's)
    prof_first_ = std::min<std::int64_t>(2, total_);
    prof_last_ = std::min<std::int64_t>(4, total_);
  } else {
    const auto steps = r_.o.get_int_list("profile");
    prof_first_ = steps.at(0);
    prof_last_ = steps.at(1);
    if (prof_first_ > total_)
      throw Error(strf("%s: option 'profile': step %lld is past the run's last step (%lld); give steps within 1 to %lld",
                       L_.c_str(), static_cast<long long>(prof_first_), static_cast<long long>(total_),
                       static_cast<long long>(total_)));
    prof_last_ = std::min(prof_last_, total_);
  }
}

// The trainer, its micro-batch (measured with "auto") and the loader.
void Run::make_trainer() {
  Model& model = *r_.obj.model;
  trainer_.emplace(r_.obj.model, r_.optim, r_.schedule, make_trainer_config(r_, total_));
  // the parameters its optimizer holds: model:unfreeze in a callback may not
  // add one, which would report itself trainable and never train
  std::vector<at::Tensor> held;
  for (const auto& p : model.parameters())
    if (p.requires_grad()) held.push_back(p);
  trained_.emplace(model, held);
  if (!cuda_ && (r_.o.get_int("empty_cache_every") > 0 || r_.o.get_number("memory_fraction") > 0) && !r_.quiet)
    err_line(L_ + ": empty_cache_every and memory_fraction act on CUDA memory; on " + r_.device + " they have no effect");
  coupled_ = coupled_windows(model) != nullptr;
  if (coupled_ && !r_.quiet)
    err_line(strf("%s: the model's loss couples the samples of a window: computed exactly over each window of "
                  "micro_batch x accumulate x %d ranks, embeddings first, then backward per micro-batch (two forward "
                  "passes each)",
                  L_.c_str(), world_));
  if (r_.micro_auto)
    std::tie(r_.micro_batch, r_.accumulate) =
        fit_micro_batch(*trainer_, r_, per_rank_batch_, r_.o.get_int("batch_size"));
  // evaluation holds no gradients, but runs the training micro-batch unless told
  eval_micro_ = r_.o.has("eval_micro_batch") ? r_.o.get_int("eval_micro_batch") : r_.micro_batch;
  loader_.emplace(r_.obj.data, loader_config(r_.micro_batch, r_.accumulate));
  group_ = trainer_->group();
  if (group_) coll0_ = group_->collectives(), bytes0_ = group_->bytes(), sent0_ = group_->sent();
  if (!out_.empty() && r_.rank0) {
    std::error_code ec;
    fs::create_directories(out_, ec);
    if (ec) throw Error(L_ + ": cannot create run folder " + out_.string() + ": " + ec.message());
  }
}

// The checkpoint's weights, state and position; a run that had already ended
// is handed back as it was.
std::optional<nlohmann::json> Run::resume() {
  if (!r_.o.get_bool("resume")) return std::nullopt;
  if (from_.checkpoint.empty()) {
    if (!r_.quiet) err_line("wick: resume = true but " + ckpt_dir_.string() + " holds no checkpoint; starting fresh");
    return std::nullopt;
  }
  const auto extra = trainer_->load(from_.checkpoint, from_.state);
  epoch_ = extra.value("epoch", std::int64_t{0});
  first_window_ = extra.value("window", std::int64_t{0});
  if (auto done = already_ended(r_, prior_, *trainer_, from_, out_, total_)) return done;
  if (!r_.quiet)
    err_line(strf("wick: resuming from %s (step %lld)", from_.checkpoint.c_str(),
                  static_cast<long long>(trainer_->steps())));
  return std::nullopt;
}

void Run::make_observers() {
  call_here_ = r_.rank0 || r_.o.get_bool("callbacks_every_rank");
  if (!out_.empty() && r_.rank0) observers_.push_back(std::make_shared<RunLogObserver>(out_.string()));
  if (!r_.quiet) {
    progress_ = std::make_shared<ProgressObserver>(r_.o.get_int("log_every"));
    observers_.push_back(progress_);
  }
  for (const auto& o : req_.observers) observers_.push_back(o);
  every_step_ = static_cast<bool>(req_.callbacks.on_step) ||
                std::any_of(observers_.begin(), observers_.end(), [](const auto& o) { return o->wants_every_step(); });
  const Model& model = *r_.obj.model;
  start_.total_steps = total_;
  start_.start_step = trainer_->steps();
  start_.item_name = model.item_name();
  start_.device = r_.device;
  start_.recipe = req_.recipe;
  start_.options = options_json(r_);
  std::int64_t params = 0;
  for (const auto& p : model.parameters()) params += p.numel();
  start_.options["micro_batch"] = r_.micro_batch;
  start_.options["accumulate"] = r_.accumulate;
  start_.options["parameters"] = params;
  start_.options["samples"] = r_.obj.data->size();
  start_.options["world_size"] = world_;
  start_.extra = {{"device", r_.device}, {"precision", r_.o.get_string("precision")}, {"world_size", world_},
                  {"item_name", model.item_name()}, {"loss_scope", coupled_ ? "window" : "micro_batch"}};
  if (!out_.empty()) run_["out"] = out_.string();
  t_start_ = now_seconds();
}

void Run::take_reply(const CallbackReply& reply, const char* by, nlohmann::json* rec) {
  for (const auto& [k, v] : reply.log) {
    if (!rec) {
      save_log_.emplace_back(k, v);
      continue;
    }
    if (rec->contains(k))
      throw Error(strf("%s: %s logged '%s', which the record holds already (its own %s)", L_.c_str(), by, k.c_str(),
                       k.c_str()));
    (*rec)[k] = v;
  }
  if (reply.stop && !stop_request_)
    stop_request_ = nlohmann::json{{"by", by}, {"reason", reply.reason}, {"step", trainer_->steps()}};
}

// A stop asked on one rank (a callback's; patience's, from evaluations each
// rank makes alike), agreed by all: every rank calls this at the same points.
bool Run::agreed_stop() {
  bool s = stop_request_.has_value();
  if (world_ > 1) s = group_->sum(s ? 1 : 0, "agreeing on a stop (a callback's, or patience's)") > 0;
  if (s && !stop_request_)
    stop_request_ = nlohmann::json{{"by", "another rank's callback"}, {"reason", ""}, {"step", trainer_->steps()}};
  return s;
}

// Reads the pending steps' numbers in one device read and hands their
// records to the observers, in order.
void Run::flush() {
  if (pending_.empty()) return;
  std::vector<StepStats*> ptrs;
  for (auto& p : pending_) ptrs.push_back(&p.stats);
  trainer_->resolve(ptrs);
  for (auto& p : pending_) {
    nlohmann::json rec = record_of(p, cuda_);
    if (!p.stats.skipped && std::isfinite(p.stats.loss) && (!best_ || p.stats.loss < *best_)) best_ = p.stats.loss;
    for (const auto& [k, v] : save_log_)
      if (!rec.contains(k)) rec[k] = v;
    save_log_.clear();
    if (req_.callbacks.on_step && call_here_) take_reply(req_.callbacks.on_step(rec), "on_step", &rec);
    for (auto& o : observers_) o->on_step(rec);
    run_["history"].push_back(std::move(rec));
  }
  last_ = run_["history"].back();
  for (auto& o : observers_) o->on_steps_delivered();
  pending_.clear();
}

// value: the monitored metric of an evaluation just made (a checkpoint after it)
void Run::save(const char* why, std::optional<double> value) {
  if (ckpt_dir_.empty()) return;
  RECORD_USER_SCOPE("wick::save");
  flush();
  std::int64_t e = loader_->epoch(), w = loader_->window();
  if (w >= per_epoch_) e += 1, w = 0;
  nlohmann::json extra = {{"epoch", e}, {"window", w}, {"reason", why}, {"world_size", world_},
                          {"micro_batch", r_.micro_batch}, {"accumulate", r_.accumulate},
                          {"samples", static_cast<std::int64_t>(r_.obj.data->size())},
                          {"shuffle", r_.o.get_bool("shuffle")}, {"seed", r_.o.get_int("seed")}};
  if (mon_) extra["monitor"] = mon_->state(value);
  run_["checkpoint"] =
      trainer_->save(ckpt_dir_, extra, static_cast<int>(r_.o.get_int("keep_checkpoints")), mon_ ? mon_->keep_best : 0)
          .string();
  if (req_.callbacks.on_save && call_here_)
    take_reply(req_.callbacks.on_save(run_["checkpoint"].get<std::string>()), "on_save", nullptr);
}

void Run::evaluate() {
  RECORD_USER_SCOPE("wick::eval");
  flush();
  const auto& eval_data = r_.obj.eval_data;
  EvalStats s = trainer_->evaluate(eval_data, eval_micro_);
  nlohmann::json rec = {{"loss", s.loss}, {"items", s.items}, {"step", trainer_->steps()}, {"eval", true}};
  if (s.oom_retries > 0) {
    rec["oom_retries"] = s.oom_retries;
    if (!r_.quiet)
      err_line(strf("%s: evaluation ran out of memory at micro-batch %lld: it ran in %lld parts of each", L_.c_str(),
                    static_cast<long long>(eval_micro_), static_cast<long long>(s.split)));
  }
  for (const auto& [k, v] : s.metrics) rec[k] = v;
  if (r_.o.get_bool("eval_ema")) {
    // the same data with the averaged weights
    EvalStats e;
    trainer_->with_ema([&] { e = trainer_->evaluate(eval_data, eval_micro_); });
    rec["ema_loss"] = e.loss;
    for (const auto& [k, v] : e.metrics) rec["ema_" + k] = v;
  }
  if (req_.callbacks.on_eval && call_here_) take_reply(req_.callbacks.on_eval(rec), "on_eval", &rec);
  run_["eval"] = rec;
  for (auto& o : observers_) o->on_eval(rec);
  if (!mon_) return;
  // the monitored metric: a checkpoint with it, and patience
  const double v = mon_->value_in(rec, L_);
  mon_->record(v, trainer_->steps());
  save("eval", v);
  if (mon_->out_of_patience() && !stop_request_)
    stop_request_ = nlohmann::json{{"by", "patience"}, {"reason", mon_->patience_reason()}, {"step", trainer_->steps()}};
}

nlohmann::json Run::summary_so_far() const {
  nlohmann::json s = {{"steps", trainer_ ? trainer_->steps() : 0}, {"seconds", now_seconds() - t_start_}};
  if (last_.is_object()) s["final_loss"] = last_["loss"];
  return s;
}

void Run::train_epochs() {
  // a resumed run: profile = true counts from where it starts; steps given
  // that ran before the resume are said, not silently skipped
  if (const std::int64_t at = trainer_->steps(); prof_first_ > 0 && at > 0) {
    if (prof_after_start_) {
      prof_first_ = std::min(at + 2, total_);
      prof_last_ = std::min(at + 4, total_);
    } else if (prof_last_ <= at) {
      if (r_.rank0)
        err_line(strf("%s: option 'profile': steps %lld to %lld ran before the resume (from step %lld): nothing profiled",
                      L_.c_str(), static_cast<long long>(prof_first_), static_cast<long long>(prof_last_),
                      static_cast<long long>(at)));
      prof_first_ = 0;
    }
  }
  reset_peaks();  // the run's peak, from its first step
  {
    // tensors held before the first step besides weights and optimizer
    // state (data sets loaded in memory, ...): not activations
    const auto bd = trainer_->memory_breakdown();
    auto m = memory_stats(cuda_);
    held_before_ = std::max<std::int64_t>(0, (cuda_ ? m["cuda_allocated"] : m["cpu_tensors"]) - bd.at("weights") -
                                                 bd.at("gradients") - bd.at("optimizer"));
    auto m0 = memory_stats(false);
    resident_now_ = {m0["resident"], m0["peak_resident"]};
  }
  const std::int64_t log_every = r_.o.get_int("log_every");
  const std::int64_t save_every = r_.o.get_int("save_every"), eval_every = r_.o.get_int("eval_every");
  while (trainer_->steps() < total_ && epoch_ < epochs_) {
    loader_->start_epoch(epoch_, first_window_);
    first_window_ = 0;
    while (trainer_->steps() < total_) {
      profile_before_step();
      std::optional<std::vector<Batch>> window;
      {
        RECORD_USER_SCOPE("wick::data");
        window = loader_->next_window();
      }
      if (!window) break;
      bool stop = false;
      {
        RECORD_USER_SCOPE("wick::step");
        train_step(std::move(*window), log_every, stop);
      }
      window.reset();  // now: a window can be large
      profile_after_step(false);
      // agreed over all ranks inside trainer.step, so every rank stops after the same step
      if (stop) {
        interrupted_ = true;
        signal_ = interrupt_signal();
        break;
      }
      const std::int64_t step = trainer_->steps();
      const bool eval_now = r_.obj.eval_data && eval_every > 0 && step % eval_every == 0 && step < total_;
      // with a monitor, the evaluation saves (with its metric) in place of a plain save
      if (save_every > 0 && step % save_every == 0 && step < total_ && !(mon_ && eval_now)) save("every");
      if (eval_now) evaluate();
      // every rank reaches this with the same condition: the agreement is a collective
      if ((req_.callbacks.any() || (mon_ && eval_now)) && agreed_stop()) break;
    }
    if (interrupted_ || stop_request_) break;
    ++epoch_;
  }
  profile_after_step(true);
  flush();
  if (progress_) progress_->finish_line();
}

void Run::profile_before_step() {
  const std::int64_t next = trainer_->steps() + 1;
  if (prof_first_ > 0 && !profiler_.active() && prof_from_ == 0 && next >= prof_first_ && next <= prof_last_) {
    profiler_.start(cuda_);
    prof_from_ = next;
  }
}

// After a recorded step: at the last one (or the run's end, `ended`), the
// trace written and the summary in the run's table, said on rank 0.
void Run::profile_after_step(bool ended) {
  if (!profiler_.active()) return;
  const std::int64_t done = trainer_->steps();
  if (!ended && done < prof_last_) return;
  const std::int64_t steps = done - prof_from_ + 1;
  const fs::path trace = out_ / (r_.dist.rank == 0 ? std::string("profile.json")
                                                   : "profile-rank" + std::to_string(r_.dist.rank) + ".json");
  nlohmann::json summary = profiler_.stop(trace.string(), steps);
  summary["first"] = prof_from_;
  summary["last"] = done;
  if (summary.contains("trace_error"))  // said on every rank, quiet or not: the run goes on
    err_line(L_ + ": option 'profile': " + summary["trace_error"].get<std::string>() + " (the summary is in run.json)");
  else if (r_.rank0 && !r_.quiet) {
    if (progress_) progress_->finish_line();
    err_line(strf("%s: profile of step%s %lld%s%s: %s (open it in https://ui.perfetto.dev)", L_.c_str(),
                  steps == 1 ? "" : "s", static_cast<long long>(prof_from_), steps == 1 ? "" : " to ",
                  steps == 1 ? "" : std::to_string(done).c_str(), trace.string().c_str()));
    std::string lines = profile_lines(summary, 8);
    if (!lines.empty() && lines.back() == '\n') lines.pop_back();
    err_line(lines);
  }
  run_["profile"] = std::move(summary);
}

// One window: the step, its memory figures, and its record (now, or with the
// next read of the device's numbers).
void Run::train_step(std::vector<Batch> window, std::int64_t log_every, bool& stop) {
  const std::int64_t split_before = trainer_->split();
  reset_peaks();  // each step's own peak; evaluation and saving between steps are not training memory
  PendingStep p;
  p.stats = trainer_->step(window, /*resolve_now=*/false);
  window.clear();
  window.shrink_to_fit();
  p.epoch = epoch_;
  p.time = now_seconds() - t_start_;
  // the process's figures (a read of /proc) only on steps whose numbers are read now
  const std::int64_t n = p.stats.step;
  const bool read_now = every_step_ || n % log_every == 0 || n == 1 || p.stats.stop || n == total_;
  p.memory = memory_stats(cuda_, read_now || cuda_);
  if (!cuda_) {
    if (read_now) resident_now_ = {p.memory["resident"], p.memory["peak_resident"]};
    p.memory["resident"] = resident_now_.first;
    p.memory["peak_resident"] = resident_now_.second;
  }
  peak_ = std::max(peak_, cuda_ ? p.memory["cuda_peak"] : p.memory["peak_resident"]);
  step_peak_ = std::max(step_peak_, cuda_ ? p.memory["cuda_peak"] : p.memory["cpu_tensors_peak"]);
  offload_peak_ = std::max(offload_peak_, host_offload_memory().peak);
  const StepStats& s = p.stats;
  if (s.split > split_before && r_.rank0) {
    const std::int64_t mb = r_.micro_batch;
    note(strf("%s: out of memory in step %lld: micro_batch %lld -> %s, accumulate %lld -> %lld (the same batch); "
              "the window was redone from its start",
              L_.c_str(), static_cast<long long>(s.step), static_cast<long long>(mb),
              mb % s.split == 0 ? std::to_string(mb / s.split).c_str()
                                : ("~" + std::to_string((mb + s.split - 1) / s.split)).c_str(),
              static_cast<long long>(r_.accumulate), static_cast<long long>(r_.accumulate * s.split)));
  }
  stop = s.stop;
  const std::int64_t step = s.step;
  const bool skipped = s.skipped;
  pending_.push_back(std::move(p));
  if (read_now) flush();
  if (skipped && r_.rank0 && !r_.quiet) {
    flush();
    note(strf("%s: step %lld skipped: inf/nan gradients at loss scale %g", L_.c_str(), static_cast<long long>(step),
              last_.value("loss_scale", 0.0)));
  }
}

// After the last step: the checkpoint and evaluation of the end (or of an
// interruption), the status, the averaged weights and the best checkpoint.
void Run::finish(bool interrupted) {
  if (interrupted) {
    signal_honoured();
    save("interrupted");
    run_["status"] = "interrupted";
    if (r_.rank0)
      err_line(strf("wick: %s at step %lld%s",
                    signal_ == 15 ? "SIGTERM" : signal_ == 2 ? "SIGINT" : "a signal on another rank",
                    static_cast<long long>(trainer_->steps()),
                    run_.contains("checkpoint")
                        ? ("; checkpoint saved to " + run_["checkpoint"].get<std::string>()).c_str()
                        : ""));
  } else if (stop_request_ && (*stop_request_)["by"] == "patience") {
    // the evaluation that ran out of patience saved its checkpoint
    run_["status"] = "stopped";
  } else {
    const bool stopped = stop_request_.has_value();
    if (r_.obj.eval_data) evaluate();
    if (!mon_) save("end");  // with a monitor the evaluation saved
    if (!stopped) stop_request_.reset();  // at the end, patience and callbacks have nothing left to stop
    run_["status"] = stopped ? "stopped" : "finished";
  }
  for (const auto& [k, v] : save_log_) run_["logged"][k] = v;  // on_save's, after the last step
  if (stop_request_) {
    const auto& s = *stop_request_;
    run_["stopped"] = s;
    if (r_.rank0 && !r_.quiet) {
      const std::string reason = s["reason"].get<std::string>();
      err_line(strf("%s: stopped after step %lld by %s%s%s", L_.c_str(), static_cast<long long>(s["step"].get<std::int64_t>()),
                    s["by"].get<std::string>().c_str(), reason.empty() ? "" : ": ", reason.c_str()));
    }
  }
  if (trainer_->has_ema() && !out_.empty()) {
    // the averaged weights, loadable by model:load (fp32 where they train)
    // (ZeRO-3: every rank sends its pieces of the average, rank 0 writes)
    if (r_.rank0 || trainer_->partitioned()) trainer_->save_ema(out_ / "ema.safetensors");
    run_["ema"] = (out_ / "ema.safetensors").string();
  }
  if (mon_ && mon_->best) {
    run_["best"] = {{"metric", mon_->name}, {"mode", mon_->mode}, {"value", *mon_->best}, {"step", mon_->best_step}};
    std::error_code ec;
    std::string name;
    if (std::ifstream in(ckpt_dir_ / "best"); in && std::getline(in, name) && fs::exists(ckpt_dir_ / name, ec))
      run_["best"]["checkpoint"] = (ckpt_dir_ / name).string();
    run_["best_step"] = mon_->best_step;
  }
}

// The summary's figures: steps, the micro-batch actually used, where the
// memory went, communication, and what the data skipped.
void Run::summarize() {
  Trainer& t = *trainer_;
  run_["steps"] = t.steps();
  run_["skipped_steps"] = t.skipped_steps();
  if (t.loss_scale() > 0) run_["loss_scale"] = t.loss_scale();
  // after out-of-memory splits: the micro-batch and accumulation actually used
  run_["micro_batch"] = (r_.micro_batch + t.split() - 1) / t.split();
  run_["accumulate"] = r_.accumulate * t.split();
  if (t.split() > 1) run_["split"] = t.split();
  {
    // Where the peak went: weights, gradients, optimizer state, data buffers,
    // and activations (the rest of the peak).
    const auto bd = t.memory_breakdown();
    auto m = memory_stats(cuda_);
    const std::int64_t data_bytes = loader_->buffered_bytes();
    const std::int64_t held =
        bd.at("weights") + bd.at("gradients") + bd.at("optimizer") + (cuda_ ? 0 : data_bytes) + held_before_;
    run_["memory"] = {{"device", r_.device},           {"peak", step_peak_},
                      {"weights", bd.at("weights")},   {"master_weights", bd.at("master_weights")},
                      {"gradients", bd.at("gradients")},
                      {"optimizer", bd.at("optimizer")}, {"data", data_bytes},
                      {"other", held_before_},         {"activations", std::max<std::int64_t>(0, step_peak_ - held)},
                      // offload_activations: the block inputs that waited in host memory, at their most
                      {"offloaded", std::max<std::int64_t>(0, offload_peak_ - bd.at("host_weights"))},
                      // offload_embeddings: the input embedding tables held in host memory
                      {"host_weights", bd.at("host_weights")},
                      {"resident_peak", m["peak_resident"]},
                      // CUDA: the allocator's most reserved, and the process's whole device
                      // memory at that moment (context and workspaces outside the allocator
                      // counted as they stand at the end of the run)
                      {"reserved_peak", m["cuda_reserved_peak"]},
                      {"device_peak", m.count("cuda_device_used")
                                          ? m["cuda_device_used"] - m["cuda_reserved"] + m["cuda_reserved_peak"]
                                          : 0},
                      // one rank's own figures: with shard, its part of the optimizer state and gradients
                      {"rank", group_ ? group_->rank() : 0},
                      {"ranks", group_ ? group_->size() : 1}};
  }
  // media data sets count the files they skipped (each named once when it
  // happened), the text data set the documents with nothing to learn from
  const auto attrs = r_.obj.data->attributes();
  for (const char* k : {"skipped_files", "skipped_items"})
    if (auto it = attrs.find(k); it != attrs.end() && it->second.is_number() && it->second.as_number() > 0)
      run_[k] = it->second.as_number();
  if (last_.is_object()) run_["final_loss"] = last_["loss"];
  if (best_) run_["best_loss"] = *best_;
  run_["peak_memory"] = peak_;
  run_["seconds"] = now_seconds() - t_start_;
  run_["interrupted"] = interrupted_;
  run_["comm"] = {{"collectives", group_ ? group_->collectives() - coll0_ : 0},
                  {"bytes", group_ ? group_->bytes() - bytes0_ : 0},
                  {"sent", group_ ? group_->sent() - sent0_ : 0}};
  run_["shard"] = group_ ? to_string(t.config().shard) : "none";
  run_["epochs"] = epochs_;
  run_["seed"] = r_.o.get_int("seed");
  const auto ck = t.checkpointed_blocks();
  run_["checkpointing"] = ck.empty() ? nlohmann::json(false) : nlohmann::json(ck);
  run_["host_reads"] = t.host_reads();
}

}  // namespace

nlohmann::json run_training(const RunRequest& req) {
  // the first signal from here on stops the run after its step, with a checkpoint
  const StepLoopScope owns_signals;
  Run run(req);
  return run.go();
}

}  // namespace wick
