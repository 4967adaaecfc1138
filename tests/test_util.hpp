#pragma once
// Shared helpers for the GoogleTest suite: plugins come from the build tree.
#include <ATen/ATen.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <unistd.h>

#include "plugin/registry.hpp"

namespace wick::test {

inline std::filesystem::path test_plugin_dir() {
  return Registry::default_search_path().back().parent_path() / "test-plugins";
}

template <class T>
std::shared_ptr<T> make(const std::string& name, PluginKind kind, std::map<std::string, Value> opts = {}) {
  return std::static_pointer_cast<T>(registry().create(name, kind, opts));
}

/// A fresh temporary folder, removed with the object.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "wick-test-XXXXXX").string();
    path = ::mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

/// Runs f and returns the wick::Error message it throws ("" if none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace wick::test
