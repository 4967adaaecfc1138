// data `synthetic`: seeded classification or regression sets of any size,
// labelled by a fixed random teacher network so there is something to learn.
// With max_items > 0 every sample carries 1..max_items items and a mask, as
// sequences do, to exercise per-item loss normalisation.

#include <wick/data.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

namespace {

class Synthetic : public wick::Dataset {
 public:
  explicit Synthetic(const wick::Options& o)
      : size_(o.get_int("size")),
        inputs_(o.get_int("inputs")),
        classes_(o.get_int("classes")),
        outputs_(o.get_int("outputs")),
        max_items_(o.get_int("max_items")),
        classification_(o.get_string("task") == "classification") {
    // The teacher (what is to be learned) and the points have their own seeds:
    // a held-out set is the same teacher with another point seed.
    auto teacher = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(o.get_int("teacher_seed")));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(o.get_int("seed")) + 0x5eed);
    const std::int64_t rows = size_ * std::max<std::int64_t>(1, max_items_);
    const std::int64_t teacher_hidden = 32;
    const std::int64_t out = classification_ ? classes_ : outputs_;
    at::Tensor w1 = at::randn({inputs_, teacher_hidden}, teacher) / std::sqrt(double(inputs_));
    at::Tensor w2 = at::randn({teacher_hidden, out}, teacher) / std::sqrt(double(teacher_hidden));
    x_ = at::randn({rows, inputs_}, gen);
    at::Tensor t = at::tanh(x_.mm(w1)).mm(w2) * 3.0;
    if (classification_) {
      y_ = t.argmax(1);
    } else {
      y_ = t + o.get_number("noise") * at::randn(t.sizes(), gen);
    }
    if (max_items_ > 0) {
      x_ = x_.reshape({size_, max_items_, inputs_});
      y_ = classification_ ? y_.reshape({size_, max_items_}) : y_.reshape({size_, max_items_, outputs_});
      at::Tensor n = at::randint(1, max_items_ + 1, {size_}, gen);
      mask_ = at::arange(max_items_).unsqueeze(0).lt(n.unsqueeze(1));
    }
  }

  std::int64_t size() const override { return size_; }

  wick::Sample get(std::int64_t i) const override {
    wick::Sample s{{"x", x_[i]}, {"y", y_[i]}};
    if (mask_.defined()) s["mask"] = mask_[i];
    return s;
  }

  wick::Batch get_batch(const std::vector<std::int64_t>& indices) const override {
    const at::Tensor idx = at::tensor(indices, at::kLong);
    wick::Batch b{{"x", x_.index_select(0, idx)}, {"y", y_.index_select(0, idx)}};
    if (mask_.defined()) b["mask"] = mask_.index_select(0, idx);
    return b;
  }

  std::map<std::string, wick::Value> attributes() const override {
    std::map<std::string, wick::Value> a{{"size", size_}, {"inputs", inputs_}};
    if (classification_) a["num_classes"] = classes_;
    else a["outputs"] = outputs_;
    return a;
  }

 private:
  std::int64_t size_, inputs_, classes_, outputs_, max_items_;
  bool classification_;
  at::Tensor x_, y_, mask_;
};

}  // namespace

WICK_PLUGIN(wick::plugin<Synthetic>(
    "synthetic", "seeded synthetic classification or regression data, optionally several items per sample",
    {wick::opt_string("task", "classification", "what the labels are").one_of({"classification", "regression"}),
     wick::opt_int("size", 1024, "number of samples").range(1, 1e9),
     wick::opt_int("inputs", 16, "input features").range(1, 1e6),
     wick::opt_int("classes", 4, "classes (classification)").range(2, 1e6),
     wick::opt_int("outputs", 1, "targets per item (regression)").range(1, 1e6),
     wick::opt_number("noise", 0.1, "label noise (regression)").at_least(0),
     wick::opt_int("max_items", 0, "0: one item per sample; n: 1..n items per sample with a mask").range(0, 1e6),
     wick::opt_int("seed", 0, "seed of the points: same seed, same data").at_least(0),
     wick::opt_int("teacher_seed", 0, "seed of the labelling network: same teacher, same task").at_least(0)}))
