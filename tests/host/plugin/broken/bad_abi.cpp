// A plugin built for another plugin ABI: the host must refuse it before it
// reads anything past the version fields.
#include <wick/plugin.hpp>

namespace {
const wick::PluginDescriptor descriptor{/*abi_version=*/999, TORCH_VERSION, "bad_abi"};
}
BOOST_DLL_ALIAS(descriptor, wick_plugin)
