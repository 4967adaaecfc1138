// A plugin that claims another LibTorch: the host must refuse it.
#include <wick/plugin.hpp>

namespace {
const wick::PluginDescriptor descriptor{wick::kAbiVersion, /*torch_version=*/"1.13.1", "old_torch"};
}
BOOST_DLL_ALIAS(descriptor, wick_plugin)
