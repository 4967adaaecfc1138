// offload_embeddings: a model's frozen input embedding tables
// (wick::HostLookups) kept in host memory for the run. Their lookups run
// there (wick::lookup) and only the looked-up rows reach the device, so a
// 32,000 x 4,096 bf16 table (LLaMA-2-7B's, 0.24 GiB) leaves the card for
// [batch, tokens, 4,096]. On a CPU run the host copy lies outside the counting
// allocator that stands for the device, as offloaded activations do.
#include "train/trainer.hpp"

#include <ATen/ATen.h>

#include "train/trainer_internal.hpp"
#include "util/memory.hpp"
#include "wick/kit/deferral.hpp"
#include "wick/kit/weights.hpp"

namespace wick {
namespace trainer_internal {

at::Tensor host_table(const at::Tensor& value, const std::string& name) {
  const std::size_t n = value.nbytes();
  void* p = alloc_host_offload(n);
  if (!p)
    throw c10::OutOfMemoryError("offload_embeddings: no host memory for " + name + " (" + std::to_string(n) +
                                " bytes)");
  at::Tensor host =
      at::from_blob(p, value.sizes(), [n](void* q) { free_host_offload(q, n); }, value.options().device(at::kCPU));
  host.copy_(value);
  return host;
}

}  // namespace trainer_internal
using namespace trainer_internal;

std::vector<std::pair<at::Tensor, at::Tensor>> Trainer::tables_to_host() {
  if (!cfg_.offload_embeddings) return {};
  auto* lookups = capability<HostLookups>(*model_);
  const std::vector<at::Tensor> tables = lookups ? lookups->host_lookup_tables() : std::vector<at::Tensor>{};
  if (tables.empty()) {
    const std::string why = lookups ? lookups->host_lookup_refusal() : "";
    throw Error("wick.train: option 'offload_embeddings': the model has no input embedding that can stay in host "
                "memory (" + (why.empty() ? std::string("its plugin names none: wick::HostLookups") : why) +
                "); train without offload_embeddings");
  }
  std::map<const c10::TensorImpl*, std::string> names;
  for (const auto& [name, t] : module_state(*model_)) names.emplace(t.unsafeGetTensorImpl(), name);
  std::vector<std::pair<at::Tensor, at::Tensor>> kept;
  at::NoGradGuard no_grad;
  for (const auto& t : tables) {
    auto it = names.find(t.unsafeGetTensorImpl());
    if (it == names.end())
      throw Error("wick.train: option 'offload_embeddings': the model named a table of shape " + c10::str(t.sizes()) +
                  " that is not one of its tensors (a plugin's host_lookup_tables gives its own parameters)");
    const std::string& name = it->second;
    if (t.requires_grad())
      throw Error("wick.train: option 'offload_embeddings': " + name +
                  " trains, and an input embedding stays in host memory only frozen (LoRA and QLoRA freeze it; "
                  "or model:freeze(\"" + name + "\")), or train without offload_embeddings");
    host_tables_.emplace(t.unsafeGetTensorImpl(), name);
    if (is_hollow(t)) continue;  // made as the weights are divided (make_divided)
    kept.emplace_back(t, host_table(t, name));
    t.set_data(at::empty({0}, t.options()));
  }
  return kept;
}

void Trainer::return_tables() noexcept {
  const at::Device device(cfg_.device);
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : module_state(*model_)) {
    if (!host_tables_.count(t.unsafeGetTensorImpl()) || is_hollow(t) || !t.is_cpu()) continue;
    try {
      t.set_data(device.is_cpu() ? t.detach().clone() : t.detach().to(device));
    } catch (const std::exception&) {  // (out of memory there: it stays in host memory)
    }
  }
  host_tables_.clear();
}

}  // namespace wick
