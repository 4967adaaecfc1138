// data `tensors`: samples are the rows of the named tensors in a safetensors
// file, like PyTorch's TensorDataset.

#include <wick/data.hpp>

#include <ATen/ATen.h>

#include <wick/kit/safetensors.hpp>

namespace {

class Tensors : public wick::Dataset {
 public:
  explicit Tensors(const wick::Options& o) : file_(o.get_string("file")) {
    auto f = wick::read_safetensors(file_);
    if (f.tensors.empty()) throw wick::Error("data file " + file_ + " holds no tensors");
    const auto& [first_name, first] = f.tensors.front();
    for (auto& [name, t] : f.tensors) {
      if (t.dim() == 0)
        throw wick::Error("data file " + file_ + ": tensor '" + name + "' is a scalar; samples are rows");
      if (t.size(0) != first.size(0))
        throw wick::Error("data file " + file_ + ": tensor '" + name + "' has " + std::to_string(t.size(0)) +
                          " rows but '" + first_name + "' has " + std::to_string(first.size(0)));
      tensors_[name] = t;
    }
    size_ = first.size(0);
  }

  std::int64_t size() const override { return size_; }

  wick::Sample get(std::int64_t i) const override {
    wick::Sample s;
    for (const auto& [name, t] : tensors_) s[name] = t[i];
    return s;
  }

  wick::Batch get_batch(const std::vector<std::int64_t>& indices) const override {
    const at::Tensor idx = at::tensor(indices, at::kLong);
    wick::Batch b;
    for (const auto& [name, t] : tensors_) b[name] = t.index_select(0, idx);
    return b;
  }

  std::map<std::string, wick::Value> attributes() const override {
    std::map<std::string, wick::Value> a{{"size", size_}, {"file", file_}};
    if (auto x = tensors_.find("x"); x != tensors_.end() && x->second.dim() >= 2) a["inputs"] = x->second.size(-1);
    if (auto y = tensors_.find("y"); y != tensors_.end() && !at::isFloatingType(y->second.scalar_type()))
      a["num_classes"] = y->second.max().item<std::int64_t>() + 1;
    return a;
  }

 private:
  std::string file_;
  std::map<std::string, at::Tensor> tensors_;
  std::int64_t size_ = 0;
};

}  // namespace

WICK_PLUGIN(wick::plugin<Tensors>(
    "tensors", "rows of the named tensors in a safetensors file (like TensorDataset)",
    {wick::opt_string("file", wick::Value(), "safetensors file; every tensor has one row per sample").required()}))
