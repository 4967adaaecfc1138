// A shared library on the plugin path that is not a wick plugin.
extern "C" int not_a_plugin_answer() { return 42; }
