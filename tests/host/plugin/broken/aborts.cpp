// A plugin whose static initialisation aborts: listing the plugin path must
// survive it (the host loads each library in a child process first) and name it.
#include <cstdlib>

#include <wick/model.hpp>

namespace {
class Aborts : public wick::Model {
 public:
  explicit Aborts(const wick::Options&) {}
  wick::ForwardResult forward(const wick::Batch&) override { return {}; }
};
const int crash = [] {
  std::abort();
  return 0;
}();
}  // namespace

WICK_PLUGIN(wick::plugin<Aborts>("aborts", "a model whose library aborts while it loads"))
