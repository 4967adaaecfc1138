#pragma once
// Where wick's own files are: found from where libwick_engine really is (its
// symlinks resolved), through the relations between GNUInstallDirs' folders
// that the build was configured with. The build tree has the installed
// layout, so one rule serves build/, an installed prefix, a moved prefix and
// an unpacked archive.

#include <filesystem>

namespace wick::layout {

/// The folder holding libwick_engine (<prefix>/<libdir>).
std::filesystem::path library_dir();
/// The built-in plugins: <libdir>/wick/plugins.
std::filesystem::path plugin_dir();
/// wick's data: <datadir>/wick, holding lua/ (the Lua package) and presets/.
std::filesystem::path data_dir();
/// The prefix: <libdir> with the configured libdir's components taken off.
std::filesystem::path prefix();
/// The folder the loaded LibTorch (libtorch_cpu) came from.
std::filesystem::path libtorch_dir();

}  // namespace wick::layout
