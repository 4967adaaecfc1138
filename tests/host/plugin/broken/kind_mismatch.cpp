// A hand-written descriptor whose kind (data) contradicts what it says it
// makes (a model): refused as unusable before any factory runs.
#include <wick/model.hpp>

namespace {
std::shared_ptr<wick::Object> create(const wick::Options&) { return nullptr; }
const wick::PluginDescriptor descriptor{wick::kAbiVersion, TORCH_VERSION, "kind_mismatch", wick::PluginKind::Data,
                                        wick::ObjectKind::Model, "kind and object kind disagree", {}, &create};
}  // namespace
BOOST_DLL_ALIAS(descriptor, wick_plugin)
