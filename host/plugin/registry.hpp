#pragma once
// The plugin registry: finds plugin libraries, checks their versions, validates
// recipe options against their schemas and builds objects that keep their
// library loaded.

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "wick/plugin.hpp"

namespace boost::dll {
class shared_library;
}

namespace wick {

struct PluginEntry {
  std::string name;
  std::filesystem::path file;
  std::string error;  // non-empty: this library cannot be used, and why
  const PluginDescriptor* descriptor = nullptr;
  std::shared_ptr<boost::dll::shared_library> library;
};

class Registry {
 public:
  /// Search order: WICK_PLUGIN_PATH (colon-separated), then the plugin folder
  /// beside the executable (<exe>/../lib/wick/plugins: the installed one, or
  /// the build tree's for a build-tree executable).
  static std::vector<std::filesystem::path> default_search_path();

  explicit Registry(std::vector<std::filesystem::path> search_path = default_search_path());

  /// Every library found, usable or not, in search order.
  const std::vector<PluginEntry>& entries() const { return entries_; }

  /// The usable plugin `name_or_path` (a name, or a path to a .so); throws
  /// wick::Error naming the plugin, its file and what is wrong.
  const PluginEntry& find(const std::string& name_or_path);

  /// Validates `given` against the schema, fills defaults, calls the factory
  /// and checks the object's kind. The object keeps its library loaded.
  std::shared_ptr<Object> create(const std::string& name_or_path, PluginKind kind,
                                 const std::map<std::string, Value>& given);

  const std::vector<std::filesystem::path>& search_path() const { return search_path_; }

  /// The usable plugins known so far: those on the search path, then those
  /// a recipe named by path.
  std::vector<const PluginDescriptor*> descriptors() const;

 private:
  PluginEntry load(const std::filesystem::path& file) const;
  /// Loads each file after a child process has loaded it without crashing or
  /// stalling; a file that failed there is unusable, and not loaded here.
  std::vector<PluginEntry> load_all(const std::vector<std::filesystem::path>& files) const;
  std::vector<std::filesystem::path> search_path_;
  std::vector<PluginEntry> entries_;
  std::map<std::string, PluginEntry> by_path_;  // plugins named by path in recipes
};

/// Checks `given` against `schema`; returns every declared option (defaults
/// filled). Errors name the plugin, the key, what was expected and what was given.
Options validate_options(const std::string& plugin, const OptionSchema& schema,
                         const std::map<std::string, Value>& given);

/// The process-wide registry (built on first use).
Registry& registry();

/// The kind as `wick plugins` shows it: model, data, or optim/<what it makes>.
inline std::string kind_label(const PluginDescriptor& d) {
  return d.kind == PluginKind::Optim ? std::string("optim/") + to_string(d.makes) : to_string(d.kind);
}

}  // namespace wick
