// A library whose `wick_plugin` is an int, not the pointer WICK_PLUGIN
// exports: the host must refuse it without reading through it.
#include <boost/config.hpp>

extern "C" BOOST_SYMBOL_EXPORT int wick_plugin;
int wick_plugin = 42;
