// A model plugin whose factory throws: the error reaches the recipe, named.
#include <wick/model.hpp>

namespace {
class Throws : public wick::Model {
 public:
  explicit Throws(const wick::Options& o) {
    throw std::runtime_error("deliberate failure (size " + std::to_string(o.get_int("size")) + ")");
  }
  wick::ForwardResult forward(const wick::Batch&) override { return {}; }
};
}  // namespace

WICK_PLUGIN(wick::plugin<Throws>("throws", "a model whose factory always throws",
                                       {wick::opt_int("size", 3, "reported in the error")}))
