// offload_embeddings: a model's frozen input embedding tables
// (wick::HostLookups) kept in host memory for the run. Their lookups run
// there (wick::lookup) and only the looked-up rows reach the device, so a
// 32,000 x 4,096 bf16 table (LLaMA-2-7B's, 0.24 GiB) leaves the card for
// [batch, tokens, 4,096]. On a CPU run the host copy lies outside the counting
// allocator that stands for the device, as offloaded activations do.
#include "train/trainer.hpp"

#include <ATen/ATen.h>

#include <cstdio>

#include "train/trainer_internal.hpp"
#include "util/host_copy.hpp"
#include "util/memory.hpp"
#include "wick/kit/deferral.hpp"
#include "wick/kit/weights.hpp"

namespace wick {
namespace trainer_internal {

at::Tensor host_table(const at::Tensor& value, const std::string& name) {
  return copy_to_host_offload(value, "offload_embeddings: no host memory for " + name);
}

std::map<const c10::TensorImpl*, std::string> offered_host_tables(Model& model) {
  auto* lookups = capability<HostLookups>(model);
  const std::vector<at::Tensor> tables = lookups ? lookups->host_lookup_tables() : std::vector<at::Tensor>{};
  if (tables.empty()) {
    const std::string why = lookups ? lookups->host_lookup_refusal() : "";
    throw Error("wick.train: option 'offload_embeddings': the model has no input embedding that can stay in host "
                "memory (" + (why.empty() ? std::string("its plugin names none: wick::HostLookups") : why) +
                "); train without offload_embeddings");
  }
  std::map<const c10::TensorImpl*, std::string> names;
  for (const auto& [name, t] : module_state(model)) names.emplace(t.unsafeGetTensorImpl(), name);
  std::map<const c10::TensorImpl*, std::string> chosen;
  for (const auto& t : tables) {
    auto it = names.find(t.unsafeGetTensorImpl());
    if (it == names.end())
      throw Error("wick.train: option 'offload_embeddings': the model named a table of shape " + c10::str(t.sizes()) +
                  " that is not one of its tensors (a plugin's host_lookup_tables gives its own parameters)");
    if (t.requires_grad())
      throw Error("wick.train: option 'offload_embeddings': " + it->second +
                  " trains, and an input embedding stays in host memory only frozen (LoRA and QLoRA freeze it; "
                  "or model:freeze(\"" + it->second + "\")), or train without offload_embeddings");
    chosen.emplace(it->first, it->second);
  }
  return chosen;
}

}  // namespace trainer_internal
using namespace trainer_internal;

// Before anything of the model changes: each table the model offers, checked
// (a refusal leaves the model as it was given).
void Trainer::choose_host_tables() {
  if (cfg_.offload_embeddings) host_tables_ = offered_host_tables(*model_);
}

std::vector<std::pair<at::Tensor, at::Tensor>> Trainer::tables_to_host() {
  std::vector<std::pair<at::Tensor, at::Tensor>> kept;
  if (host_tables_.empty()) return kept;
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : module_state(*model_)) {
    auto it = host_tables_.find(t.unsafeGetTensorImpl());
    // (a hollow one is made into host memory as the weights are divided:
    // make_divided; a tensor reached by two names moves once)
    if (it == host_tables_.end() || is_hollow(t) || host_data_.count(it->first)) continue;
    at::Tensor host = host_table(t, it->second);
    host_data_[it->first] = host.data_ptr();
    kept.emplace_back(t, host);
  }
  for (auto& [table, host] : kept) table.set_data(at::empty({0}, table.options()));  // Module::to moves nothing of it
  return kept;
}

void Trainer::return_tables() noexcept {
  if (host_data_.empty()) return;
  const at::Device device(cfg_.device);
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : module_state(*model_)) {
    auto it = host_data_.find(t.unsafeGetTensorImpl());
    // only what this trainer put there: another trainer of the same model
    // (a custom loop's, collected later) may hold it in host memory now
    if (it == host_data_.end() || is_hollow(t) || t.data_ptr() != it->second) continue;
    try {
      t.set_data(device.is_cpu() ? t.detach().clone() : t.detach().to(device));
    } catch (const std::exception& e) {
      const auto* ce = dynamic_cast<const c10::Error*>(&e);
      std::string why = ce ? ce->what_without_backtrace() : e.what();
      why = why.substr(0, why.find('\n'));
      std::fprintf(stderr, "wick: offload_embeddings: %s stays in host memory after the run (%s); its lookups work "
                           "there\n", name.c_str(), why.c_str());
    }
    host_data_.erase(it);
  }
  host_data_.clear();
}

}  // namespace wick
