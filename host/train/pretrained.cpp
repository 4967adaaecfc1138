#include "train/pretrained.hpp"

#include <ATen/ATen.h>

#include <map>
#include <set>
#include <string>

#include "train/deferred.hpp"
#include "wick/kit/linear.hpp"
#include "wick/options.hpp"

namespace wick {
namespace {

std::vector<std::pair<std::string, Linear>> layers_of(Model& model) {
  auto* targets = capability<AdapterTargets>(model);
  return targets ? targets->linear_layers() : std::vector<std::pair<std::string, Linear>>{};
}

bool is_adapter(const std::string& name) {
  return name.find(".lora_A.") != std::string::npos || name.find(".lora_B.") != std::string::npos;
}

// The dtype most of the model's float tensors have (the adapters and the
// 4-bit constants aside): what its dequantized layers are written in.
at::ScalarType model_dtype(const NamedTensorList& state) {
  std::map<at::ScalarType, std::int64_t> count;
  for (const auto& [name, t] : state)
    if (at::isFloatingType(t.scalar_type()) && name.find(".nf4.") == std::string::npos && !is_adapter(name))
      count[t.scalar_type()] += t.numel();
  at::ScalarType best = at::kFloat;
  std::int64_t most = -1;
  for (const auto& [dtype, n] : count)
    if (n > most) best = dtype, most = n;
  return best;
}

}  // namespace

std::int64_t adapted_layers(Model& model) {
  std::int64_t n = 0;
  for (const auto& [name, lin] : layers_of(model)) n += lin->has_adapter();
  return n;
}

std::vector<LazyTensor> pretrained_tensors(Model& model, bool merge, std::vector<std::vector<at::Tensor>>* uses) {
  const NamedTensorList state = module_state(model);
  // a layer's own tensors (weight or 4-bit codes and constants, bias, adapters), by its name
  auto layer_tensors = [&state](const std::string& layer) {
    std::vector<at::Tensor> ts;
    for (const auto& [name, t] : state)
      if (name.size() > layer.size() && name.compare(0, layer.size(), layer) == 0 && name[layer.size()] == '.')
        ts.push_back(t);
    return ts;
  };
  const at::ScalarType dtype = model_dtype(state);
  // the layers whose weight is written anew, by the name it takes: made
  // when the writer comes to it, one layer's float weight at a time
  std::map<std::string, LazyTensor> made;
  std::set<std::string> rewritten;  // their module names
  for (auto& [name, lin] : layers_of(model)) {
    if (!lin->quantized() && !lin->has_adapter()) continue;
    if (lin->has_adapter() && !merge)
      throw Error("save_pretrained: layer " + name + " carries a LoRA adapter, expected merge = true to fold it in");
    const at::ScalarType out = lin->quantized() ? dtype : lin->weight.scalar_type();
    made[name + ".weight"] = {name + ".weight", out, {lin->out_features, lin->in_features}, [lin, out] {
                                at::NoGradGuard no_grad;
                                at::Tensor w = lin->dense_weight();
                                if (lin->has_adapter())
                                  w = w.to(at::kFloat) + lin->lora_B->weight.to(at::kFloat).matmul(
                                                             lin->lora_A->weight.to(at::kFloat)) * lin->scale_;
                                return w.to(out);
                              }};
    rewritten.insert(name);
  }
  std::vector<LazyTensor> out;
  auto as_is = [&](const std::string& name, const at::Tensor& t) {
    out.push_back({name, t.scalar_type(), t.sizes().vec(), [t] { return t; }});
    if (uses) uses->push_back({t});
  };
  auto layer_weight = [&](const std::string& layer) {
    out.push_back(made.at(layer + ".weight"));
    if (uses) uses->push_back(layer_tensors(layer));
  };
  std::set<std::string> placed;  // quantized layers whose weight is in `out`
  for (const auto& [name, t] : state) {
    if (made.count(name)) {  // a float layer's weight, its adapter folded in
      layer_weight(name.substr(0, name.size() - std::string(".weight").size()));
      continue;
    }
    const auto nf4 = name.find(".nf4.");
    const auto dot = nf4 != std::string::npos ? nf4
                     : is_adapter(name)       ? std::min(name.find(".lora_A."), name.find(".lora_B."))
                                              : std::string::npos;
    if (dot == std::string::npos) {
      as_is(name, t);
      continue;
    }
    const std::string layer = name.substr(0, dot);
    if (!rewritten.count(layer))
      throw Error("save_pretrained: " + name + " belongs to no linear layer the model offers (its AdapterTargets), "
                  "expected float weights a Hugging Face folder holds");
    // a quantized layer's weight where its first 4-bit tensor was
    if (nf4 != std::string::npos && placed.insert(layer).second) layer_weight(layer);
  }
  return out;
}

void save_pretrained_weights(Model& model, const std::filesystem::path& file, bool merge, bool write) {
  std::vector<std::vector<at::Tensor>> uses;
  const auto out = pretrained_tensors(model, merge, &uses);  // on every rank: the same refusals
  if (!write) return;
  if (is_deferred(model))
    write_deferred(model, file, out, uses, {{"format", "pt"}});
  else
    write_safetensors(file, out, {{"format", "pt"}});
}

}  // namespace wick
