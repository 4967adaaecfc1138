#include "train/inspect.hpp"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <set>
#include <string>

#include "wick/kit/safetensors.hpp"

namespace wick {

std::vector<Batch> sample_window(const Dataset& d, std::int64_t first, std::int64_t count, std::int64_t micro) {
  if (first < 0 || count < 1 || micro < 1 || first + count > d.size())
    throw Error("window: samples " + std::to_string(first) + " .. " + std::to_string(first + count - 1) +
                " with micro-batches of " + std::to_string(micro) + " do not fit data of " + std::to_string(d.size()) +
                " samples");
  std::vector<Batch> w;
  for (std::int64_t i = first; i < first + count; i += micro) {
    std::vector<std::int64_t> idx;
    for (std::int64_t j = i; j < std::min(i + micro, first + count); ++j) idx.push_back(j);
    w.push_back(d.get_batch(idx));
  }
  return w;
}

void save_window(const std::vector<Batch>& window, const std::filesystem::path& file) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (std::size_t k = 0; k < window.size(); ++k)
    for (const auto& [name, t] : window[k]) out.emplace_back(std::to_string(k) + "." + name, t.cpu().contiguous());
  write_safetensors(file, out);
}

void save_samples(const Dataset& d, const std::vector<std::int64_t>& indices, const std::filesystem::path& file,
                  std::int64_t epoch, std::uint64_t seed) {
  d.set_epoch(epoch, seed);
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<std::int64_t> written;
  for (const auto i : indices) {
    if (i < 0 || i >= d.size())
      throw Error("save_samples: index " + std::to_string(i) + " outside the data set's 0.." + std::to_string(d.size() - 1));
    auto sample = d.get(i);
    if (!written.insert(i).second) continue;
    for (auto& [name, t] : sample) out.emplace_back(std::to_string(i) + "." + name, t.contiguous());
  }
  write_safetensors(file, out);
}

Batch read_batch(const std::filesystem::path& file) {
  auto in = read_safetensors(file);
  return Batch(in.tensors.begin(), in.tensors.end());
}

void save_predictions(Model& m, const std::filesystem::path& batch_file, const std::filesystem::path& out_file) {
  const Batch b = read_batch(batch_file);
  const bool was_training = m.is_training();
  m.train(false);
  at::Tensor out;
  try {
    at::NoGradGuard no_grad;
    auto* p = capability<Predictor>(m);
    if (!p) throw Error("this model does not implement predict()");
    out = p->predict(b);
  } catch (...) {
    m.train(was_training);
    throw;
  }
  m.train(was_training);
  write_safetensors(out_file, {{"output", out}});
}

void save_gradients(Model& m, const std::filesystem::path& batch_file, const std::filesystem::path& out_file) {
  const Batch b = read_batch(batch_file);
  for (auto& p : m.parameters()) p.mutable_grad() = at::Tensor();
  ForwardResult r = m.forward(b);
  if (r.items <= 0) throw Error("gradients: the batch in " + batch_file.string() + " holds no items");
  at::Tensor loss = r.loss_sum / static_cast<double>(r.items);
  loss.backward();
  std::vector<std::pair<std::string, at::Tensor>> out{{"loss", loss.detach().reshape({})},
                                                      {"items", at::scalar_tensor(r.items, at::kLong)}};
  for (const auto& p : m.named_parameters(/*recurse=*/true))
    if (p.value().grad().defined()) out.emplace_back("grad." + p.key(), p.value().grad());
  write_safetensors(out_file, out);
  for (auto& p : m.parameters()) p.mutable_grad() = at::Tensor();
}

}  // namespace wick
