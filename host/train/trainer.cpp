#include "train/trainer.hpp"
#include "wick/weights.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <set>

#include "wick/safetensors.hpp"
#include "dist/group.hpp"
#include "dist/reducer.hpp"
#include "train/loader.hpp"
#include "util/system.hpp"

namespace fs = std::filesystem;

namespace wick {
namespace {

// The random generators a run draws from: the CPU's, and the device's when it is a GPU.
std::vector<std::pair<std::string, at::Generator>> generators(const at::Device& device) {
  std::vector<std::pair<std::string, at::Generator>> g{{"cpu", at::detail::getDefaultCPUGenerator()}};
  if (device.is_cuda()) g.emplace_back("cuda", at::globalContext().defaultGenerator(device));
  return g;
}

std::string step_dir_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

}  // namespace

std::string describe(const Batch& b) {
  std::string s = "{";
  for (const auto& [k, v] : b) {
    std::ostringstream o;
    o << (s.size() > 1 ? ", " : "") << k << " " << c10::toString(v.scalar_type()) << " " << v.sizes();
    s += o.str();
  }
  return s + "}";
}

Batch to_device(const Batch& b, const at::Device& device) {
  if (device.is_cpu()) return b;
  Batch out;
  for (const auto& [k, v] : b) out[k] = v.to(device, /*non_blocking=*/v.is_pinned());
  return out;
}

void save_model(torch::nn::Module& model, const fs::path& file, const std::map<std::string, std::string>& metadata) {
  auto meta = metadata;
  meta.emplace("format", "pt");
  write_safetensors(file, module_state(model), meta);
}

void load_model(torch::nn::Module& model, const fs::path& file) {
  load_state(model, read_safetensors(file).tensors, file.string());
}

Trainer::Trainer(std::shared_ptr<Model> model, std::shared_ptr<Optimizer> optim, std::shared_ptr<Schedule> schedule,
                 TrainerConfig cfg)
    : model_(std::move(model)), optim_(std::move(optim)), schedule_(std::move(schedule)), cfg_(std::move(cfg)) {
  if (!model_) throw Error("wick.train: 'model' is required");
  if (!optim_) throw Error("wick.train: 'optim' is required");
  if (cfg_.clip_grad_norm < 0) throw Error("clip_grad_norm must be >= 0");
  at::Device device(cfg_.device);
  model_->to(device);
  for (const auto& p : model_->named_parameters(/*recurse=*/true))
    if (p.value().requires_grad()) params_.emplace_back(p.key(), p.value());
  if (params_.empty()) throw Error("the model has no trainable parameters");
  optim_->attach(params_);
  if (cfg_.group) {
    // Every rank starts from rank 0's weights.
    std::vector<at::Tensor> state;
    for (auto& [name, t] : module_state(*model_)) state.push_back(t.detach());
    cfg_.group->broadcast(state, "broadcasting rank 0's initial weights");
    std::vector<at::Tensor> trainable;
    for (auto& [name, p] : params_) trainable.push_back(p);
    reducer_ = std::make_unique<GradReducer>(cfg_.group, trainable, cfg_.bucket_mb);
  }
}

Trainer::~Trainer() = default;

double Trainer::lr_at(std::int64_t step) const {
  const double f = schedule_ ? schedule_->factor(step, cfg_.total_steps) : 1.0;
  return optim_->base_lr() * f;
}

StepStats Trainer::step(const std::vector<Batch>& window) {
  const auto t0 = std::chrono::steady_clock::now();
  Group* group = cfg_.group.get();
  if (window.empty() && !group) throw Error("a window needs at least one micro-batch");
  StepStats s;
  // The window's item count over all ranks, before any backward: every
  // micro-batch's loss is divided by it, so the summed gradients equal the
  // full batch's whatever the split and the rank count.
  std::vector<std::int64_t> counts;
  for (const auto& b : window) {
    if (b.empty()) throw Error("a micro-batch holds no tensors");
    counts.push_back(model_->count_items(b));
    s.items += counts.back();
  }
  if (group) s.items = group->sum(s.items, "the item count of step " + std::to_string(step_ + 1));
  if (s.items <= 0) throw Error("the window holds no items to learn from");
  const at::Device device(cfg_.device);
  model_->train(true);
  for (auto& [name, p] : params_) p.mutable_grad() = at::Tensor();
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  std::map<std::string, at::Tensor> metric_sums;
  const double inv_items = 1.0 / static_cast<double>(s.items);
  for (std::size_t i = 0; i < window.size(); ++i) {
    ForwardResult r;
    try {
      r = model_->forward(to_device(window[i], device));
    } catch (const c10::Error& e) {
      throw Error("step " + std::to_string(step_ + 1) + ", micro-batch " + std::to_string(i + 1) + " of " +
                  std::to_string(window.size()) + ": the model's forward failed on " + describe(window[i]) + ": " +
                  e.what_without_backtrace());
    }
    if (r.items != counts[i])
      throw Error("the model counted " + std::to_string(counts[i]) + " items in a micro-batch before forward and " +
                  std::to_string(r.items) + " in forward");
    if (!r.loss_sum.defined() || r.loss_sum.numel() != 1)
      throw Error("the model's forward must return a one-element loss sum");
    const bool last = i + 1 == window.size();
    if (group && (last || cfg_.sync_every_micro_batch)) reducer_->arm();  // this backward reduces as it goes
    (r.loss_sum.reshape({}) * inv_items).backward();
    if (group && !last && cfg_.sync_every_micro_batch) {
      // sum, then divide by the rank count: the common part stays counted once
      reducer_->finish(step_ + 1);
      at::NoGradGuard no_grad;
      for (auto& [name, p] : params_)
        if (p.grad().defined()) p.mutable_grad().div_(group->size());
    }
    loss_sum += r.loss_sum.detach().to(at::kDouble).reshape({});
    for (auto& [k, v] : r.metrics) {
      auto x = v.detach().to(at::kDouble).sum();
      auto it = metric_sums.find(k);
      if (it == metric_sums.end()) metric_sums.emplace(k, x);
      else it->second += x;
    }
  }
  s.micro_batches = static_cast<std::int64_t>(window.size());
  for (const auto& [k, v] : metric_sums)
    if (std::find(metric_names_.begin(), metric_names_.end(), k) == metric_names_.end()) metric_names_.push_back(k);
  if (group) {
    if (window.empty()) reducer_->arm();
    reducer_->finish(step_ + 1);
    // The loss and metric sums over all ranks, in one small all-reduce.
    // The stop flag rides along, so every rank stops after the same step.
    std::vector<at::Tensor> parts{loss_sum.reshape({1}), at::full({1}, interrupted() ? 1.0 : 0.0, loss_sum.options())};
    for (const auto& k : metric_names_) {
      auto it = metric_sums.find(k);
      parts.push_back(it == metric_sums.end() ? at::zeros({1}, loss_sum.options()) : it->second.reshape({1}));
    }
    std::vector<at::Tensor> packed{at::cat(parts)};
    group->all_reduce(packed, "the loss of step " + std::to_string(step_ + 1));
    loss_sum = packed[0][0];
    s.stop = packed[0][1].item<double>() > 0;
    for (std::size_t k = 0; k < metric_names_.size(); ++k) metric_sums[metric_names_[k]] = packed[0][k + 2];
  } else {
    s.stop = interrupted();
  }
  // Global gradient norm, and clipping as torch.nn.utils.clip_grad_norm_ does.
  std::vector<at::Tensor> norms;
  for (auto& [name, p] : params_)
    if (p.grad().defined()) norms.push_back(p.grad().detach().norm(2).to(at::kFloat));
  if (!norms.empty()) {
    at::Tensor total = at::stack(norms).norm(2);
    s.grad_norm = total.item<double>();
    if (cfg_.clip_grad_norm > 0) {
      at::Tensor coef = (cfg_.clip_grad_norm / (total + 1e-6)).clamp_max(1.0);
      at::NoGradGuard no_grad;
      for (auto& [name, p] : params_)
        if (p.grad().defined()) p.mutable_grad().mul_(coef.to(p.grad().dtype()));
    }
  }
  s.lr = lr_at(step_);
  {
    at::NoGradGuard no_grad;
    optim_->step(s.lr);
  }
  ++step_;
  s.step = step_;
  s.loss = loss_sum.item<double>() * inv_items;
  for (auto& [k, v] : metric_sums) s.metrics[k] = v.item<double>() * inv_items;
  s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return s;
}

fs::path Trainer::save(const fs::path& checkpoints_dir, const nlohmann::json& extra, int keep) {
  if (cfg_.group) {
    // Written once, by rank 0; no rank goes on until it is complete.
    fs::path dir = checkpoints_dir / step_dir_name(step_);
    std::string error;
    if (cfg_.group->rank() == 0) {
      try {
        dir = write_checkpoint(checkpoints_dir, extra, keep);
      } catch (const std::exception& e) {
        error = e.what();
      }
    }
    cfg_.group->barrier("waiting for rank 0 to write checkpoint " + dir.string());
    if (!error.empty()) throw Error(error);
    return dir;
  }
  return write_checkpoint(checkpoints_dir, extra, keep);
}

fs::path Trainer::write_checkpoint(const fs::path& checkpoints_dir, const nlohmann::json& extra, int keep) {
  std::error_code ec;
  fs::create_directories(checkpoints_dir, ec);
  if (ec) throw Error("cannot create checkpoint folder " + checkpoints_dir.string() + ": " + ec.message());
  const fs::path final_dir = checkpoints_dir / step_dir_name(step_);
  const fs::path tmp = checkpoints_dir / ("." + step_dir_name(step_) + ".tmp");
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp);
  save_model(*model_, tmp / "model.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> opt_state;
  for (auto& [k, v] : optim_->state()) opt_state.emplace_back(k, v);
  write_safetensors(tmp / "optimizer.safetensors", opt_state);
  std::vector<std::pair<std::string, at::Tensor>> rng;
  for (auto& [name, gen] : generators(at::Device(cfg_.device))) {
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng.emplace_back(name, gen.get_state());
  }
  write_safetensors(tmp / "rng.safetensors", rng);
  nlohmann::json state = {{"step", step_}, {"wick_version", WICK_VERSION_STRING}, {"extra", extra}};
  write_file_atomic(tmp / "state.json", state.dump(2) + "\n");
  if (fs::exists(final_dir)) fs::remove_all(final_dir, ec);
  fs::rename(tmp, final_dir, ec);
  if (ec) throw Error("cannot finish checkpoint " + final_dir.string() + ": " + ec.message());
  // Keep the newest `keep` checkpoints.
  if (keep > 0) {
    std::vector<fs::path> all;
    for (const auto& e : fs::directory_iterator(checkpoints_dir, ec))
      if (e.is_directory() && e.path().filename().string().starts_with("step-")) all.push_back(e.path());
    std::sort(all.begin(), all.end());
    for (std::size_t i = 0; i + keep < all.size(); ++i) fs::remove_all(all[i], ec);
  }
  return final_dir;
}

nlohmann::json Trainer::load(const fs::path& checkpoint) {
  const fs::path state_file = checkpoint / "state.json";
  std::ifstream in(state_file);
  if (!in) throw Error("checkpoint " + checkpoint.string() + " has no state.json");
  nlohmann::json state;
  try {
    state = nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    throw Error("checkpoint " + state_file.string() + " is not valid JSON: " + e.what());
  }
  load_model(*model_, checkpoint / "model.safetensors");
  TensorFile opt = read_safetensors(checkpoint / "optimizer.safetensors");
  std::map<std::string, at::Tensor> opt_state;
  const at::Device device(cfg_.device);
  for (auto& [k, v] : opt.tensors) opt_state[k] = v.to(device);
  optim_->load_state(opt_state);
  TensorFile rng = read_safetensors(checkpoint / "rng.safetensors");
  for (auto& [name, gen] : generators(device)) {
    const at::Tensor* state = rng.get(name);
    if (!state) throw Error("checkpoint " + checkpoint.string() + " has no '" + name + "' random state");
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*state);
  }
  step_ = state.at("step").get<std::int64_t>();
  return state.value("extra", nlohmann::json::object());
}

fs::path latest_checkpoint(const fs::path& checkpoints_dir) {
  std::error_code ec;
  fs::path best;
  for (const auto& e : fs::directory_iterator(checkpoints_dir, ec)) {
    const auto name = e.path().filename().string();
    if (e.is_directory() && name.starts_with("step-") && fs::exists(e.path() / "state.json") &&
        (best.empty() || name > best.filename().string()))
      best = e.path();
  }
  return best;
}

EvalStats evaluate(Model& model, std::shared_ptr<const Dataset> data, std::int64_t micro_batch,
                   const std::string& device_name) {
  LoaderConfig cfg;
  cfg.micro_batch = micro_batch;
  cfg.shuffle = false;
  Loader loader(std::move(data), cfg);
  const at::Device device(device_name);
  const bool was_training = model.is_training();
  model.train(false);
  at::NoGradGuard no_grad;
  EvalStats s;
  double loss = 0;
  std::map<std::string, double> sums;
  while (auto w = loader.next_window()) {
    for (const auto& b : *w) {
      ForwardResult r = model.forward(to_device(b, device));
      loss += r.loss_sum.to(at::kDouble).item<double>();
      s.items += r.items;
      for (auto& [k, v] : r.metrics) sums[k] += v.to(at::kDouble).sum().item<double>();
    }
  }
  model.train(was_training);
  if (s.items > 0) {
    s.loss = loss / s.items;
    for (auto& [k, v] : sums) s.metrics[k] = v / s.items;
  }
  return s;
}

}  // namespace wick
