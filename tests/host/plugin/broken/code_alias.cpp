// A Boost.DLL alias `wick_plugin` given a function instead of the descriptor:
// the pointer leads into the library's code; refused, never read through.
#include <wick/plugin.hpp>

namespace {
const wick::PluginDescriptor* describe() { return nullptr; }
}  // namespace
BOOST_DLL_ALIAS(describe, wick_plugin)
