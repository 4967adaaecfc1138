// A `wick_plugin` alias (a pointer, as WICK_PLUGIN exports) that points to
// nothing: refused, never read through.
#include <boost/config.hpp>

namespace _autoaliases {
extern "C" BOOST_SYMBOL_EXPORT const void* wick_plugin;
const void* wick_plugin = nullptr;
}  // namespace _autoaliases
