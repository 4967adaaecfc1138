// Run checkpoints: the Trainer's save (ZeRO-3's weights gathered a unit at a
// time, rank 0 writing), the folder it writes (weights, optimizer state, the
// random generators, state.json, written beside and renamed into place, the
// oldest and worst removed), its load with every check of what it reads, and
// finding the newest whole checkpoint of a run. Activation checkpointing is
// train/activation_checkpoint.hpp.
#include "train/trainer.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <limits>
#include <set>

#include "distributed/group.hpp"
#include "distributed/reducer.hpp"
#include "train/deferred.hpp"
#include "train/run_options.hpp"  // kMonitorModeNames: the best checkpoints are the monitor's
#include "train/trainer_internal.hpp"
#include "util/checksum.hpp"
#include "util/system.hpp"
#include "wick/kit/json_fields.hpp"
#include "wick/kit/safetensors.hpp"
#include "wick/kit/weights.hpp"

namespace fs = std::filesystem;

namespace wick {
using namespace trainer_internal;

namespace {
// The entries of a module's state that view each storage: a ZeRO-3 unit's
// parameters all view its one flat buffer.
std::map<const c10::StorageImpl*, std::vector<std::size_t>> entries_by_storage(
    const std::vector<std::pair<std::string, at::Tensor>>& state) {
  std::map<const c10::StorageImpl*, std::vector<std::size_t>> out;
  for (std::size_t j = 0; j < state.size(); ++j) out[state[j].second.storage().unsafeGetStorageImpl()].push_back(j);
  return out;
}

}  // namespace

fs::path Trainer::save(const fs::path& checkpoints_dir, const nlohmann::json& extra, int keep, int keep_best) {
  check_not_finished("saving a checkpoint");
  if (!partitioned()) return save_gathered(checkpoints_dir, extra, keep, keep_best);
  // ZeRO-3: one unit at a time gathered on every rank, rank 0 writing its
  // tensors into the file as they come (FSDP's full state dict, streamed to
  // rank 0): a device holds one block's whole weights more, rank 0's host
  // one tensor, never the model
  ReleaseUnits release{reducer_.get()};
  reducer_->release_all();
  std::string error;
  bool streamed = false;
  ModelWriter writer;
  writer.write = [&](const fs::path& file) { write_divided_weights(file, error, streamed); };
  writer.pair = [&] {
    if (!streamed) stream_divided_weights(nullptr, error);
  };
  return save_gathered(checkpoints_dir, extra, keep, keep_best, &writer);
}

void Trainer::write_divided_weights(const fs::path& file, std::string& error, bool& streamed) {
  std::vector<LazyTensor> declared;
  for (const auto& [name, t] : module_state(*model_)) declared.push_back({name, t.scalar_type(), t.sizes().vec(), {}});
  write_safetensors_placed(
      file, declared,
      [&](const PutTensor& put) {
        streamed = true;  // the gathers begin: from here on this rank pairs with the others
        stream_divided_weights(&put, error);
        if (!error.empty()) throw Error(error);
      },
      {{"format", "pt"}});
}

void Trainer::stream_divided_weights(const PutTensor* put, std::string& error) {
  auto state = module_state(*model_);
  auto of_storage = entries_by_storage(state);  // entries viewing each unit
  std::set<std::size_t> in_units;
  for (std::size_t u = 0; u < reducer_->units(); ++u)
    for (const auto* storage : reducer_->unit_storages(u))
      if (auto it = of_storage.find(storage); it != of_storage.end()) in_units.insert(it->second.begin(), it->second.end());
  auto put_safely = [&](std::size_t j) {
    if (!put || !error.empty()) return;
    try {
      (*put)(state[j].first, state[j].second);
    } catch (const std::exception& e) {
      error = "writing " + state[j].first + " of checkpoint step " + std::to_string(step_) + ": " + e.what();
    }
  };
  for (std::size_t j = 0; j < state.size(); ++j)  // whole on every rank (no data: an empty tensor)
    if (!in_units.count(j)) put_safely(j);
  for (std::size_t u = 0; u < reducer_->units(); ++u) {
    reducer_->gather_unit(u, "gathering the weights of unit " + std::to_string(u) + " for checkpoint step " +
                                 std::to_string(step_));
    for (const auto* storage : reducer_->unit_storages(u))
      if (auto it = of_storage.find(storage); it != of_storage.end())
        for (auto j : it->second) put_safely(j);
    reducer_->release_unit(u);
  }
}

fs::path Trainer::save_gathered(const fs::path& checkpoints_dir, const nlohmann::json& extra, int keep, int keep_best,
                                const ModelWriter* model) {
  if (cfg_.group) {
    // Written once, by rank 0; no rank goes on until it is complete. Sharded,
    // every rank first sends its pieces' state to rank 0, which joins them.
    fs::path dir = checkpoints_dir / step_dir_name(step_);
    std::string error;
    std::map<std::string, at::Tensor> opt_state;
    try {  // every rank takes part in the join; a failure on rank 0 still reaches the barrier below
      opt_state = sharded() ? joined_state() : optim_->state();
    } catch (const std::exception& e) {
      if (error.empty()) error = e.what();
    }
    if (cfg_.group->rank() == 0 && error.empty()) {
      try {
        dir = write_checkpoint(checkpoints_dir, extra, keep, keep_best, opt_state, model);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    if (model) model->pair();  // the gathers rank 0's write makes, on every rank that did not make them
    cfg_.group->barrier("waiting for rank 0 to write checkpoint " + dir.string());
    if (!error.empty()) throw Error(error);
    return dir;
  }
  return write_checkpoint(checkpoints_dir, extra, keep, keep_best, optim_->state());
}

namespace {

// Keeps the newest `keep` checkpoints, by the step recorded inside each, and
// the best `keep_best` by the monitored metric recorded inside each (the one
// just written, `final_dir`, is kept whatever else is there). A removal
// renames first, so a kill halfway leaves no half checkpoint.
void prune_checkpoints(const fs::path& checkpoints_dir, const fs::path& final_dir, std::int64_t step,
                       const nlohmann::json& extra, int keep, int keep_best) {
  if (keep <= 0) return;
  std::error_code ec;
  struct Kept {
    std::int64_t step;
    fs::path path;
    std::optional<double> value;  // the monitored metric, when it is this save's monitor
  };
  const nlohmann::json* monitor = extra.is_object() && extra.contains("monitor") ? &extra["monitor"] : nullptr;
  const bool maximize = monitor && find_enum(kMonitorModeNames, monitor->value("mode", "")).value_or(false);
  std::vector<Kept> all;
  for (const auto& e : fs::directory_iterator(checkpoints_dir, ec)) {
    if (!e.is_directory() || !e.path().filename().string().starts_with("step-")) continue;
    Kept k{-1, e.path(), std::nullopt};
    try {
      const auto st = read_checkpoint_state(e.path());
      k.step = st.at("step").get<std::int64_t>();
      const auto x = st.value("extra", nlohmann::json::object());
      if (monitor && x.contains("monitor") && x["monitor"].value("name", "") == monitor->value("name", "") &&
          x["monitor"].value("mode", "") == monitor->value("mode", "") && x["monitor"]["value"].is_number())
        k.value = x["monitor"]["value"].get<double>();
    } catch (const std::exception&) {
      continue;  // not a checkpoint this run can read: left alone
    }
    all.push_back(std::move(k));
  }
  std::sort(all.begin(), all.end(), [](const Kept& a, const Kept& b) { return a.step < b.step; });
  // The one just written is kept whatever else is there (`last` names it),
  // and the newest are counted up to this step: a folder of a later step is
  // one a resume skipped as damaged, left alone and never counted in the
  // place of an intact one.
  std::set<fs::path> kept{final_dir};
  std::vector<const Kept*> upto;
  for (const auto& k : all)
    if (k.step <= step) upto.push_back(&k);
    else kept.insert(k.path);
  for (std::size_t i = upto.size() > static_cast<std::size_t>(keep) ? upto.size() - keep : 0; i < upto.size(); ++i)
    kept.insert(upto[i]->path);
  if (monitor && keep_best > 0) {
    // the best first; among equals the earliest (the first to reach it)
    std::vector<const Kept*> scored;
    for (const auto& k : all)
      if (k.value && std::isfinite(*k.value)) scored.push_back(&k);
    std::stable_sort(scored.begin(), scored.end(), [&](const Kept* a, const Kept* b) {
      return maximize ? *a->value > *b->value : *a->value < *b->value;
    });
    for (std::size_t i = 0; i < scored.size() && i < static_cast<std::size_t>(keep_best); ++i)
      kept.insert(scored[i]->path);
    if (!scored.empty()) write_file_atomic(checkpoints_dir / "best", scored[0]->path.filename().string() + "\n");
  }
  for (const auto& k : all) {
    if (kept.count(k.path)) continue;
    const fs::path trash = checkpoints_dir / (".trash-" + k.path.filename().string());
    fs::rename(k.path, trash, ec);
    if (!ec) fs::remove_all(trash, ec);
  }
}

}  // namespace

fs::path Trainer::write_checkpoint(const fs::path& checkpoints_dir, const nlohmann::json& extra, int keep,
                                   int keep_best, const std::map<std::string, at::Tensor>& opt,
                                   const ModelWriter* model) {
  std::error_code ec;
  fs::create_directories(checkpoints_dir, ec);
  if (ec) throw Error("cannot create checkpoint folder " + checkpoints_dir.string() + ": " + ec.message());
  // what a kill left half done: an unfinished checkpoint, an unfinished removal
  for (const auto& e : fs::directory_iterator(checkpoints_dir, ec)) {
    const auto name = e.path().filename().string();
    if (name.starts_with(".step-") || name.starts_with(".trash-")) fs::remove_all(e.path(), ec);
  }
  const fs::path final_dir = checkpoints_dir / step_dir_name(step_);
  const fs::path tmp = checkpoints_dir / ("." + step_dir_name(step_) + ".tmp");
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp);
  if (model) model->write(tmp / "model.safetensors");
  else save_model(*model_, tmp / "model.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> opt_state;
  for (auto& [k, v] : opt) opt_state.emplace_back(k, v);
  if (cfg_.master_weights && !sharded_masters_)  // divided: joined with the optimizer's state
    for (auto& [name, p] : params_) opt_state.emplace_back(kMasterPrefix + name, p.detach());
  if (!sharded_ema_)  // divided: joined with the optimizer's state
    for (auto& [name, t] : ema_) opt_state.emplace_back(kEmaPrefix + name, t);
  write_safetensors(tmp / "optimizer.safetensors", opt_state);
  std::vector<std::pair<std::string, at::Tensor>> rng;
  for (auto& [name, gen] : generators(at::Device(cfg_.device))) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng.emplace_back(name, gen.get_state());
  }
  write_safetensors(tmp / "rng.safetensors", rng);
  nlohmann::json state = {{"step", step_}, {"wick_version", WICK_VERSION_STRING}, {"extra", extra.is_null() ? nlohmann::json::object() : extra},
                          {"skipped_steps", skipped_}, {"precision", to_string(cfg_.precision)}};
  if (scale_.defined())
    state["loss_scale"] = {{"scale", scale_.item<double>()}, {"growth_tracker", growth_tracker_.item<std::int64_t>()}};
  // each file's size and CRC-32C: a damaged checkpoint is found before it is trusted
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "rng.safetensors"}) {
    std::uint64_t bytes = 0;
    const std::uint32_t crc = crc32c_file(tmp / f, &bytes);
    char hex[16];
    std::snprintf(hex, sizeof hex, "%08x", crc);
    state["files"][f] = {{"bytes", bytes}, {"crc32c", hex}};
  }
  write_file_atomic(tmp / "state.json", state.dump(2) + "\n");
  if (fs::exists(final_dir)) {
    const fs::path trash = checkpoints_dir / (".trash-" + step_dir_name(step_));
    fs::rename(final_dir, trash, ec);
    fs::remove_all(trash, ec);
  }
  fs::rename(tmp, final_dir, ec);
  if (ec) throw Error("cannot finish checkpoint " + final_dir.string() + ": " + ec.message());
  write_file_atomic(checkpoints_dir / "last", step_dir_name(step_) + "\n");
  prune_checkpoints(checkpoints_dir, final_dir, step_, extra, keep, keep_best);
  return final_dir;
}

namespace {

void check_checkpoint_state(const nlohmann::json& state, const std::string& where) {
  // every field a resume reads, of the type write_checkpoint wrote: a
  // hand-edited or damaged state.json is named, key and all, and never read
  // as a zero or a default
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const JsonFields j(state, where);
  // JSON null where wick writes a value is damage too, not "use the default"
  auto no_null = [&](const nlohmann::json& obj, const std::string& path) {
    if (obj.is_object())
      for (const auto& [k, v] : obj.items())
        if (v.is_null()) throw Error(where + ": " + path + k + " is null, expected a value");
  };
  no_null(state, "");
  if (state.contains("extra")) no_null(state["extra"], "extra.");
  if (state.contains("loss_scale")) no_null(state["loss_scale"], "loss_scale.");
  j.integer("step", 0, kMax);
  j.integer("skipped_steps", 0, 0, kMax);
  j.string("precision", "");
  j.string("wick_version", "");
  if (state.contains("extra")) {
    const JsonFields e = j.object("extra");
    e.integer("epoch", 0, 0, kMax);
    e.integer("window", 0, 0, kMax);
    e.integer("micro_batch", 1, 1, kMax);
    e.integer("accumulate", 1, 1, kMax);
    e.integer("world_size", 1, 1, 1 << 20);
    if (state["extra"].contains("monitor")) {
      // the monitored metric (run.cpp): which checkpoints are the best, and early stopping's count
      const JsonFields m = e.object("monitor");
      m.string("name");
      const std::string mode = m.string("mode");
      if (!find_enum(kMonitorModeNames, mode)) m.bad("mode", enum_names_text(kMonitorModeNames, /*quoted=*/true));
      m.number("value", 0.0);
      m.number("best", 0.0);
      m.integer("best_step", 0, 0, kMax);
      m.integer("bad_evals", 0, 0, kMax);
    }
  }
  if (state.contains("loss_scale")) {
    const JsonFields ls = j.object("loss_scale");
    ls.number("scale", 1.0, 0.0, true);
    ls.integer("growth_tracker", 0, 0, kMax);
  }
  if (state.contains("files")) {
    const JsonFields files = j.object("files");
    for (const auto& [name, _] : state["files"].items()) {
      const JsonFields f = files.object(name);
      f.integer("bytes", 0, kMax);
      const std::string crc = f.string("crc32c");
      if (crc.size() != 8 || crc.find_first_not_of("0123456789abcdef") != std::string::npos)
        f.bad("crc32c", "8 lowercase hex digits (a CRC-32C)");
    }
  }
}

}  // namespace

nlohmann::json read_checkpoint_state(const fs::path& checkpoint) {
  const fs::path state_file = checkpoint / "state.json";
  std::ifstream in(state_file);
  if (!in) throw Error("checkpoint " + checkpoint.string() + " has no state.json");
  nlohmann::json state;
  try {
    state = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw Error("checkpoint " + state_file.string() + " is not valid JSON: " + json_error_text(e));
  }
  check_checkpoint_state(state, "checkpoint " + state_file.string());
  return state;
}


nlohmann::json Trainer::load(const fs::path& checkpoint) { return load(checkpoint, read_checkpoint_state(checkpoint)); }

// ZeRO-3: every rank reads the file itself, one unit at a time: the unit's
// whole weights made (no collective), filled from the file, its chunk kept,
// freed. A device holds one block's weights more, never the model.
void Trainer::load_divided_weights(const fs::path& file) {
  ReleaseUnits release{reducer_.get()};
  reducer_->release_all();
  TensorFile f = read_safetensors(file);
  auto state = module_state(*model_);
  detail::check_fit(state, f.tensors, file.string(), {});
  std::map<std::string, at::Tensor*> given;
  for (auto& [n, t] : f.tensors) given[n] = &t;
  auto of_storage = entries_by_storage(state);  // entries viewing each unit
  at::NoGradGuard no_grad;
  auto fill = [&](std::size_t j) {
    at::Tensor& src = *given.at(state[j].first);
    detail::copy_releasing(state[j].second, src);
    src = at::Tensor();
  };
  for (std::size_t u = 0; u < reducer_->units(); ++u) {
    reducer_->make_unit(u);
    for (const auto* storage : reducer_->unit_storages(u))
      if (auto it = of_storage.find(storage); it != of_storage.end()) {
        for (auto j : it->second) fill(j);
        of_storage.erase(it);
      }
    reducer_->keep_chunks_of_gathered();
    reducer_->release_unit(u);
  }
  for (auto& [storage, entries] : of_storage)  // the tensors no unit divides (a block without weights' buffers)
    for (auto j : entries) fill(j);
}

// The fp32 copies kept beside the weights: the masters the run stepped
// (saved without master_weights: the loaded half-precision weights) and the
// average (saved without ema: it starts at the weights the run steps), whole
// or (divided) this rank's pieces of them.
void Trainer::restore_kept(const fs::path& checkpoint, const std::map<std::string, at::Tensor>& masters,
                           const std::map<std::string, at::Tensor>& averages) {
  // fp32 copies kept beside the weights, by name; from a checkpoint without
  // them, `fallback(i)` (the loaded weights)
  auto restore = [&](std::vector<std::pair<std::string, at::Tensor>>& kept, const std::map<std::string, at::Tensor>& saved,
                     const std::string& what, const std::function<at::Tensor(std::size_t)>& fallback) {
    at::NoGradGuard no_grad;
    for (std::size_t i = 0; i < kept.size(); ++i) {
      auto it = saved.find(kept[i].first);
      if (it != saved.end() && !it->second.sizes().equals(kept[i].second.sizes()))
        throw Error("checkpoint " + checkpoint.string() + ": " + what + " '" + kept[i].first + "' has shape " +
                    c10::str(it->second.sizes()) + ", the model's is " + c10::str(kept[i].second.sizes()));
      kept[i].second.copy_(it != saved.end() ? it->second : fallback(i));
    }
  };
  // the fp32 weights the run stepped (saved without master_weights: the loaded half-precision ones)
  if (sharded_masters_) {
    // this rank's pieces, cut out of the whole
    at::NoGradGuard no_grad;
    const auto& pieces = reducer_->my_pieces();
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      const auto& [name, shape] = params_[pieces[i].param];
      auto it = masters.find(name);
      if (it != masters.end() && !it->second.sizes().equals(shape.sizes()))
        throw Error("checkpoint " + checkpoint.string() + ": master weight '" + name + "' has shape " +
                    c10::str(it->second.sizes()) + ", the model's is " + c10::str(shape.sizes()));
      if (it == masters.end() && partitioned()) {  // the loaded weights' piece (the whole ones are freed)
        stepped_[i].second.view({-1}).copy_(reducer_->piece_view(pieces[i]));
        continue;
      }
      const at::Tensor whole = it != masters.end() ? it->second : model_params_[pieces[i].param].detach();
      stepped_[i].second.view({-1}).copy_(whole.reshape({-1}).narrow(0, pieces[i].start, pieces[i].numel));
    }
  } else if (cfg_.master_weights) {
    restore(params_, masters, "master weight", [&](std::size_t i) { return model_params_[i]; });
  }
  // the average the run kept (saved without ema: it starts at the weights the run steps)
  if (sharded_ema_) {
    // this rank's pieces, cut out of the whole (or of the weights it steps)
    at::NoGradGuard no_grad;
    const auto& pieces = reducer_->my_pieces();
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      const std::size_t k = pieces[i].param;
      const std::string& name = params_[k].first;
      auto it = averages.find(name);
      if (it != averages.end() && !it->second.sizes().equals(model_params_[k].sizes()))
        throw Error("checkpoint " + checkpoint.string() + ": the average of '" + name + "' has shape " +
                    c10::str(it->second.sizes()) + ", the model's is " + c10::str(model_params_[k].sizes()));
      if (it != averages.end())
        ema_[i].second.view({-1}).copy_(it->second.reshape({-1}).narrow(0, pieces[i].start, pieces[i].numel));
      else
        ema_[i].second.copy_(stepped_[i].second.detach());
    }
  } else restore(ema_, averages, "the average of", [&](std::size_t i) {
    if (!sharded_masters_) return params_[i].second.detach();
    auto it = masters.find(params_[i].first);
    return it != masters.end() ? it->second : model_params_[i].detach();
  });
}

nlohmann::json Trainer::load(const fs::path& checkpoint, const nlohmann::json& state) {
  check_not_finished("loading checkpoint " + checkpoint.string());
  if (partitioned()) load_divided_weights(checkpoint / "model.safetensors");
  else load_model(*model_, checkpoint / "model.safetensors");
  TensorFile opt = read_safetensors(checkpoint / "optimizer.safetensors");
  std::map<std::string, at::Tensor> opt_state;
  const at::Device device(cfg_.device);
  std::map<std::string, at::Tensor> masters, averages;
  for (auto& [k, v] : opt.tensors) {
    if (k.starts_with(kMasterPrefix)) masters[k.substr(kMasterPrefix.size())] = v.to(device);
    else if (k.starts_with(kEmaPrefix)) averages[k.substr(kEmaPrefix.size())] = v.to(device);
    else opt_state[k] = v.to(device);
  }
  // a checkpoint without optimizer state, for an optimizer that keeps some:
  // written by one that keeps none (SGD without momentum); its moments would
  // start at zero in the middle of the run without a word
  // (steps skipped on an fp16 overflow made none; the whole parameters' state
  // decides, the same on every rank, one without pieces of its own too)
  const std::int64_t stepped = state.value("step", std::int64_t{0}) - state.value("skipped_steps", std::int64_t{0});
  if (opt_state.empty() && stepped > 0 && optim_->state_bytes(params_) > 0)
    throw Error("checkpoint " + checkpoint.string() + " holds no optimizer state after " + std::to_string(stepped) +
                " steps taken, and this run's optimizer keeps some: it was written by an optimizer that keeps none "
                "(SGD without momentum); resume with the recipe's own optimizer, or start over");
  const auto given = sharded() ? cut_state(opt_state, "checkpoint " + checkpoint.string()) : opt_state;
  optim_->load_state(given);
  {
    // state the optimizer did not take (another optimizer wrote it, or for
    // parameters that no longer train) would be dropped without a word
    const auto taken = optim_->state();
    std::string left;
    int n = 0;
    for (const auto& [k, v] : given)
      if (!taken.count(k) && n++ < 4) left += (left.empty() ? "" : ", ") + k;
    if (n > 0)
      throw Error("checkpoint " + checkpoint.string() + " holds optimizer state this run's optimizer does not take (" +
                  left + (n > 4 ? ", ... " + std::to_string(n) + " entries" : "") +
                  "): it was written by another optimizer, or for other trainable parameters; resume with the "
                  "recipe's own optimizer and parameters, or start over");
  }
  restore_kept(checkpoint, masters, averages);
  TensorFile rng = read_safetensors(checkpoint / "rng.safetensors");
  for (auto& [name, gen] : generators(device)) {
    const at::Tensor* state = rng.get(name);
    if (!state) throw Error("checkpoint " + checkpoint.string() + " has no '" + name + "' random state");
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*state);
  }
  step_ = state.at("step").get<std::int64_t>();
  skipped_ = state.value("skipped_steps", std::int64_t{0});
  if (scale_.defined() && state.contains("loss_scale")) {
    scale_.fill_(state["loss_scale"].value("scale", cfg_.loss_scale.init));
    growth_tracker_.fill_(state["loss_scale"].value("growth_tracker", std::int64_t{0}));
  }
  return state.value("extra", nlohmann::json::object());
}

std::string checkpoint_problem(const fs::path& checkpoint) {
  nlohmann::json state;
  try {
    state = read_checkpoint_state(checkpoint);
  } catch (const std::exception& e) {
    return e.what();
  }
  const auto files = state.value("files", nlohmann::json::object());
  std::vector<std::string> names{"model.safetensors", "optimizer.safetensors", "rng.safetensors"};
  for (const auto& f : names) {
    const fs::path p = checkpoint / f;
    std::error_code ec;
    if (!fs::is_regular_file(p, ec)) return f + " is missing";
    if (!files.contains(f)) continue;  // written before checksums were recorded
    const auto want_bytes = files[f].value("bytes", std::uint64_t{0});
    const auto want_crc = files[f].value("crc32c", std::string());
    std::uint64_t bytes = 0;
    std::uint32_t crc = 0;
    try {
      crc = crc32c_file(p, &bytes);
    } catch (const std::exception& e) {
      return e.what();
    }
    if (bytes != want_bytes)
      return f + " holds " + std::to_string(bytes) + " bytes, state.json recorded " + std::to_string(want_bytes);
    char hex[16];
    std::snprintf(hex, sizeof hex, "%08x", crc);
    if (want_crc != hex) return f + " has CRC-32C " + hex + ", state.json recorded " + want_crc;
  }
  return "";
}

fs::path find_checkpoint(const fs::path& checkpoints_dir, std::vector<std::string>* damaged) {
  std::error_code ec;
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(checkpoints_dir, ec))
    if (e.is_directory() && e.path().filename().string().starts_with("step-")) dirs.push_back(e.path());
  // step-%08lld: the name's order is the step's
  std::sort(dirs.begin(), dirs.end(), [](const fs::path& a, const fs::path& b) { return a.filename() > b.filename(); });
  for (const auto& d : dirs) {
    const std::string problem = checkpoint_problem(d);
    if (problem.empty()) return d;
    if (damaged) damaged->push_back(d.string() + ": " + problem);
  }
  return {};
}

fs::path latest_checkpoint(const fs::path& checkpoints_dir) { return find_checkpoint(checkpoints_dir, nullptr); }

}  // namespace wick
