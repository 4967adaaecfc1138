// A working Transform (wick/optim.hpp): it freezes the parameters whose name
// ends with `suffix` and records their names; save() writes that list into a
// folder and load() freezes the parameters a saved list names; merge() has
// nothing to fold and does nothing.
#include <wick/model.hpp>
#include <wick/optim.hpp>
#include <wick/plugin.hpp>

#include <fstream>

namespace {
class FreezeSuffix : public wick::Transform {
 public:
  explicit FreezeSuffix(const wick::Options& o) : suffix_(o.get_string("suffix")) {}
  void apply(wick::Model& model) override {
    for (auto& p : model.named_parameters())
      if (p.key().ends_with(suffix_)) freeze(model, p.key());
    if (frozen_.empty()) throw wick::Error("test_transform: no parameter name ends with '" + suffix_ + "'");
  }
  void save(wick::Model&, const std::string& dir) const override {
    std::ofstream f(dir + "/frozen.txt");
    for (const auto& n : frozen_) f << n << "\n";
    if (!f) throw wick::Error("test_transform: cannot write " + dir + "/frozen.txt");
  }
  void load(wick::Model& model, const std::string& dir) override {
    std::ifstream f(dir + "/frozen.txt");
    if (!f) throw wick::Error("test_transform: no " + dir + "/frozen.txt");
    for (std::string n; std::getline(f, n);)
      if (!n.empty()) freeze(model, n);
  }
  void merge(wick::Model&) override {}

 private:
  void freeze(wick::Model& model, const std::string& name) {
    auto params = model.named_parameters();  // handles: freezing one freezes the model's
    auto* p = params.find(name);
    if (!p) throw wick::Error("test_transform: the model has no parameter '" + name + "'");
    p->set_requires_grad(false);
    frozen_.push_back(name);
  }
  std::string suffix_;
  std::vector<std::string> frozen_;
};
}  // namespace

WICK_PLUGIN(wick::plugin<FreezeSuffix>("test_transform", "freezes the parameters whose name ends with suffix",
                                       {wick::opt_string("suffix", "bias", "the end of the names to freeze")}))
