// A library whose `wick_plugin` is a function returning null, not the pointer
// to a descriptor that WICK_PLUGIN exports: refused, never called or read.
#include <boost/config.hpp>

namespace wick {
struct PluginDescriptor;
}
extern "C" BOOST_SYMBOL_EXPORT const wick::PluginDescriptor* wick_plugin() { return nullptr; }
