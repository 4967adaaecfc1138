// An optim plugin that declares it makes a transform but whose factory returns
// a schedule: the host must refuse the object, naming both kinds.
#include <wick/optim.hpp>

namespace {
class Flat : public wick::Schedule {
 public:
  double factor(std::int64_t, std::int64_t) const override { return 1.0; }
};
std::shared_ptr<wick::Object> create(const wick::Options&) { return std::make_shared<Flat>(); }
}  // namespace

WICK_PLUGIN(wick::plugin<wick::Transform>("wrong_object", "a factory that returns another kind than declared", {},
                                          &create))
