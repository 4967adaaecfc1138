// A plugin whose option schema contradicts itself (an integer option with a
// string default): the host reports it as unusable, naming the option.
#include <wick/model.hpp>

namespace {
class BadSchema : public wick::Model {
 public:
  explicit BadSchema(const wick::Options&) {}
  wick::ForwardResult forward(const wick::Batch&) override { return {}; }
};
}  // namespace

WICK_PLUGIN(wick::plugin<BadSchema>("bad_schema", "a plugin with a self-contradicting schema",
                                          {wick::opt_int("width", "wide", "an integer with a string default")}))
