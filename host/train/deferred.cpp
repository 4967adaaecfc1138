#include "train/deferred.hpp"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <map>
#include <set>
#include <stdexcept>
#include <vector>

#include "wick/kit/deferral.hpp"
#include "wick/kit/linear.hpp"
#include "wick/kit/safetensors.hpp"
#include "wick/kit/weights.hpp"
#include "wick/model.hpp"

namespace wick {

namespace {
// Models deferred to a file (a divided run's end): the file, by model; a
// model gone since frees its address for another.
std::mutex files_mu;
std::map<const Model*, std::pair<std::weak_ptr<Model>, std::filesystem::path>>& deferred_files() {
  static std::map<const Model*, std::pair<std::weak_ptr<Model>, std::filesystem::path>> m;
  return m;
}
std::optional<std::filesystem::path> file_of(const Model& model) {
  std::lock_guard<std::mutex> lock(files_mu);
  auto& all = deferred_files();
  auto it = all.find(&model);
  if (it == all.end()) return std::nullopt;
  if (it->second.first.expired()) {
    all.erase(it);
    return std::nullopt;
  }
  return it->second.second;
}
bool any_hollow(Model& model) {
  for (const auto& [name, t] : module_state(model))
    if (is_hollow(t)) return true;
  return false;
}
}  // namespace

void defer_to_file(const std::shared_ptr<Model>& model, const std::filesystem::path& file) {
  std::lock_guard<std::mutex> lock(files_mu);
  deferred_files()[model.get()] = {model, file};
}

bool is_deferred(Model& model) {
  if (file_of(model) && any_hollow(model)) return true;
  auto* d = capability<Deferred>(model);
  return d && d->deferred();
}

namespace {
// A deferred layer quantized since its values were last whole (qlora over a
// model built deferred, or over one left in a file): its float weight, when
// it comes, is quantized on arrival (Linear::emit_nf4_from), rounded first
// to the dtype the whole build's weight would hold it in. A value for an
// fp32 weight goes as it is: the quantizer takes every value to fp32 itself,
// the one rounding the whole build's copy into the weight makes.
void emit_quantized(const LinearImpl& layer, const at::Tensor& former, const at::Tensor& value, const Emit& sink) {
  const at::ScalarType dt = former.scalar_type();
  layer.emit_nf4_from(value.scalar_type() == dt || dt == at::kFloat ? value : value.to(dt), sink);
}

// Those layers by name (as in the model's state) and by their former tensor.
std::vector<std::pair<std::string, const LinearImpl*>> quantized_since(Model& model) {
  std::vector<std::pair<std::string, const LinearImpl*>> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false))
    if (const auto* l = dynamic_cast<const LinearImpl*>(item.value().get()); l && l->deferred_float_weight().defined())
      out.emplace_back(item.key(), l);
  return out;
}
}  // namespace

void run_deferred(Model& model, const Emit& sink) {
  const auto quantized = quantized_since(model);
  if (const auto file = file_of(model); file && any_hollow(model)) {
    TensorFile f;
    try {
      f = read_safetensors(*file);
    } catch (const std::exception& e) {
      throw Error(std::string(e.what()) + " (the weights a run with return_weights = \"file\" left there; rank 0 "
                  "wrote it: a rank on another node without a shared file system cannot read it)");
    }
    std::map<std::string, const at::Tensor*> by_name;
    for (const auto& [name, t] : f.tensors) by_name.emplace(name, &t);
    for (const auto& [name, t] : module_state(model))
      if (auto it = by_name.find(name); it != by_name.end()) sink(t, *it->second);
    // a layer quantized since the file was written: the file holds its float weight
    for (const auto& [name, l] : quantized)
      if (auto it = by_name.find(name + ".weight"); it != by_name.end())
        emit_quantized(*l, l->deferred_float_weight(), *it->second, sink);
    return;
  }
  if (quantized.empty()) return capability<Deferred>(model)->materialize(sink);
  std::map<const c10::TensorImpl*, const LinearImpl*> by_former;
  for (const auto& [name, l] : quantized) by_former.emplace(l->deferred_float_weight().unsafeGetTensorImpl(), l);
  capability<Deferred>(model)->materialize(Emit(
      [&](const at::Tensor& t, const at::Tensor& value) {
        if (!t.defined())
          throw Error("a deferred model's step gave a value for an undefined tensor (a plugin's step must give each "
                      "value to the tensor it captured when it was recorded, not to a layer's current one, which "
                      "quantizing it after the build replaces)");
        auto it = by_former.find(t.unsafeGetTensorImpl());
        if (it == by_former.end()) return sink(t, value);
        emit_quantized(*it->second, t, value, sink);
      },
      sink.nf4()));
}

void materialize_whole(Model& model, const std::string& who, bool say) {
  if (!is_deferred(model)) return;
  const auto file = file_of(model);
  if (!say) {
  } else if (file)
    std::fprintf(stderr, "wick: %s: the model's weights are in %s (a divided run's return_weights = \"file\"); they "
                         "are read whole now\n", who.c_str(), file->c_str());
  else
    std::fprintf(stderr, "wick: %s: the model was built deferred; its weights are made whole now\n", who.c_str());
  at::NoGradGuard no_grad;
  run_deferred(model, [](const at::Tensor& t, const at::Tensor& value) {
    t.set_data(value.to(t.scalar_type()).contiguous().clone());
  });
  for (const auto& [name, t] : module_state(model))
    if (is_hollow(t))
      throw Error(who + ": the model's deferred weights hold no value for " + name +
                  (file ? " (" + file->string() + " has none)" : " (its plugin's materialize gives none)"));
}

void write_deferred(Model& model, const std::filesystem::path& file, const std::vector<LazyTensor>& out,
                    const std::vector<std::vector<at::Tensor>>& uses, const std::map<std::string, std::string>& metadata) {
  if (uses.size() != out.size()) throw std::logic_error("write_deferred: a list of uses for each tensor written");
  // the entries using each tensor; an entry waits for its hollow tensors'
  // values. One whose tensors all hold bytes is written after the values are
  // made: the deferral may still give one of them its value (a folder's
  // norms, which a deferred build holds as ones until then)
  std::map<const c10::TensorImpl*, std::vector<std::size_t>> users;
  std::set<const c10::TensorImpl*> hollow_before;
  std::vector<int> waiting(out.size(), 0);
  for (std::size_t j = 0; j < out.size(); ++j)
    for (const auto& t : uses[j]) {
      auto& u = users[t.unsafeGetTensorImpl()];
      if (std::find(u.begin(), u.end(), j) != u.end()) continue;
      u.push_back(j);
      if (is_hollow(t)) {
        ++waiting[j];
        hollow_before.insert(t.unsafeGetTensorImpl());
      }
    }
  std::vector<bool> written(out.size(), false);
  std::set<const c10::TensorImpl*> given;  // a tensor's value comes once (a tied one is named twice)
  write_safetensors_placed(
      file, out,
      [&](const PutTensor& put) {
        auto emit = [&](std::size_t j) {
          put(out[j].name, out[j].make());
          written[j] = true;
        };
        at::NoGradGuard no_grad;
        run_deferred(model, [&](const at::Tensor& t, const at::Tensor& value) {
          auto it = users.find(t.unsafeGetTensorImpl());
          if (it == users.end() || !given.insert(t.unsafeGetTensorImpl()).second) return;
          const bool was_hollow = is_hollow(t);
          // the value in the tensor while the entries using it are made; a
          // hollow one is hollow again after: one layer's values at a time
          t.set_data(value.to(t.scalar_type()).contiguous().clone());
          if (!was_hollow) return;  // (its entries are written at the end, with this value)
          std::vector<std::size_t> done;
          for (auto j : it->second)
            if (--waiting[j] == 0) {
              emit(j);
              done.push_back(j);
            }
          for (auto j : done)
            for (const auto& u : uses[j]) {
              if (!hollow_before.count(u.unsafeGetTensorImpl()) || is_hollow(u)) continue;
              const auto& us = users.at(u.unsafeGetTensorImpl());
              if (std::all_of(us.begin(), us.end(), [&](std::size_t k) { return written[k]; }))
                u.set_data(hollow(u.sizes(), u.options()));
            }
        });
        for (std::size_t j = 0; j < out.size(); ++j)
          if (!written[j] && waiting[j] == 0) emit(j);
        for (std::size_t j = 0; j < out.size(); ++j)
          if (!written[j])
            throw Error("saving " + file.string() + ": the model's deferred weights made no value for " + out[j].name +
                        " (a tensor it is made from stayed hollow)");
      },
      metadata);
}

void save_deferred(Model& model, const std::filesystem::path& file) {
  std::vector<LazyTensor> out;
  std::vector<std::vector<at::Tensor>> uses;
  for (const auto& [name, t] : module_state(model)) {
    out.push_back({name, t.scalar_type(), t.sizes().vec(), [t] { return t; }});
    uses.push_back({t});
  }
  write_deferred(model, file, out, uses, {{"format", "pt"}});
}

at::Tensor moved(const at::Tensor& t, std::optional<at::ScalarType> dtype, std::optional<at::Device> device) {
  const at::ScalarType to_dtype = dtype.value_or(t.scalar_type());
  const at::Device to_device = device.value_or(t.device());
  if (is_hollow(t)) return hollow(t.sizes(), t.options().dtype(to_dtype).device(to_device));
  return t.to(to_device, to_dtype);
}

void move_hollow(torch::nn::Module& module, at::Device device) {
  for (auto& [name, t] : module_state(module))
    if (is_hollow(t) && t.device() != device) t.set_data(moved(t, std::nullopt, device));
}

}  // namespace wick
