#include "plugin/registry.hpp"

#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <set>
#include <sstream>

namespace fs = std::filesystem;

namespace wick {

Options validate_options(const std::string& plugin, const OptionSchema& schema,
                         const std::map<std::string, Value>& given);

namespace {

std::string join(const std::vector<std::string>& xs, const char* sep = ", ") {
  std::string out;
  for (std::size_t i = 0; i < xs.size(); ++i) out += (i ? sep : "") + xs[i];
  return out;
}

bool looks_like_path(const std::string& s) {
  return s.find('/') != std::string::npos || (s.size() > 3 && s.ends_with(".so"));
}

// Checks one scalar against a scalar type; returns the converted value or an
// error description of what was given.
bool check_scalar(OptionType t, const Value& v) {
  switch (t) {
    case OptionType::Bool: return v.is_bool();
    case OptionType::Int: case OptionType::IntList: return v.is_int();
    case OptionType::Float: case OptionType::FloatList: return v.is_number();
    case OptionType::String: case OptionType::StringList: return v.is_string();
  }
  return false;
}

bool is_list_type(OptionType t) {
  return t == OptionType::IntList || t == OptionType::FloatList || t == OptionType::StringList;
}

// A plugin's own schema must make sense before any recipe is checked against it.
std::string schema_problem(const PluginDescriptor& d) {
  if (!d.summary || !d.create) return "lacks a summary or a factory";
  if (d.kind != PluginKind::Model && d.kind != PluginKind::Data && d.kind != PluginKind::Optim)
    return "declares an unknown kind " + std::to_string(static_cast<int>(d.kind));
  if (static_cast<unsigned>(d.makes) > static_cast<unsigned>(ObjectKind::Transform))
    return "declares that it makes an unknown object kind " + std::to_string(static_cast<int>(d.makes));
  if (plugin_kind_of(d.makes) != d.kind)
    return std::string("is a ") + to_string(d.kind) + " plugin that declares it makes a " + to_string(d.makes);
  std::set<std::string> names;
  for (const auto& o : d.options) {
    if (o.name.empty()) return "declares an option without a name";
    if (!names.insert(o.name).second) return "declares option '" + o.name + "' twice";
    if (o.min && o.max && *o.min > *o.max) return "declares option '" + o.name + "' with min > max";
    if (o.required()) continue;
    try {
      validate_options("default", {o}, {{o.name, o.default_value}});
    } catch (const Error& e) {
      std::string why = e.what();
      return "declares a default for option '" + o.name + "' that its own schema rejects (" +
             why.substr(why.find("expected")) + ")";
    }
  }
  return "";
}

}  // namespace

Options validate_options(const std::string& plugin, const OptionSchema& schema,
                         const std::map<std::string, Value>& given) {
  std::map<std::string, const OptionSpec*> by_name;
  for (const auto& s : schema) by_name[s.name] = &s;
  for (const auto& [key, value] : given) {
    if (!by_name.count(key)) {
      std::vector<std::string> known;
      for (const auto& s : schema) known.push_back(s.name);
      throw Error(plugin + ": unknown option '" + key + "' (known options: " +
                  (known.empty() ? std::string("none") : join(known)) + ")");
    }
  }
  std::map<std::string, Value> out;
  for (const auto& spec : schema) {
    auto it = given.find(spec.name);
    const bool present = it != given.end() && !it->second.is_nil();
    if (!present) {
      if (spec.required())
        throw Error(plugin + ": option '" + spec.name + "' is required (" + to_string(spec.type) +
                    ": " + spec.doc + ")");
      out[spec.name] = spec.default_value;
      continue;
    }
    const Value& v = it->second;
    auto bad = [&](const std::string& what) {
      return Error(plugin + ": option '" + spec.name + "': expected " + what + ", got " +
                   v.type_name() + " " + v.repr());
    };
    std::vector<const Value*> items;
    Value converted = v;
    if (is_list_type(spec.type)) {
      if (!v.is_list()) {
        // a single scalar stands for a one-item list
        if (!check_scalar(spec.type, v)) throw bad(to_string(spec.type));
        converted = Value(List{v});
      }
      for (const auto& x : converted.as_list())
        if (!check_scalar(spec.type, x)) throw bad(to_string(spec.type));
    } else if (!check_scalar(spec.type, v)) {
      throw bad(to_string(spec.type));
    }
    if (spec.type == OptionType::Float) converted = Value(v.as_double());
    if (spec.type == OptionType::FloatList) {
      List l;
      for (const auto& x : converted.as_list()) l.push_back(Value(x.as_double()));
      converted = Value(l);
    }
    std::vector<Value> scalars = converted.is_list() ? converted.as_list() : List{converted};
    for (const auto& x : scalars) {
      // one rule for every number option: inf and nan (lr = 1/0, tonumber("inf")) are never a setting
      if (x.is_number() && !std::isfinite(x.as_double())) throw bad("a finite number");
      if (x.is_number() && (spec.min || spec.max)) {
        const double d = x.as_double();
        if ((spec.min && d < *spec.min) || (spec.max && d > *spec.max) || std::isnan(d)) {
          std::ostringstream range;
          if (spec.min && spec.max) range << "a value in [" << *spec.min << ", " << *spec.max << "]";
          else if (spec.min) range << "a value >= " << *spec.min;
          else range << "a value <= " << *spec.max;
          throw bad(range.str());
        }
      }
      if (x.is_string() && !spec.choices.empty() &&
          std::find(spec.choices.begin(), spec.choices.end(), x.as_string()) == spec.choices.end())
        throw bad("one of " + join(spec.choices));
    }
    out[spec.name] = converted;
  }
  return Options(std::move(out));
}

std::vector<fs::path> Registry::default_search_path() {
  std::vector<fs::path> dirs;
  if (const char* env = std::getenv("WICK_PLUGIN_PATH")) {
    std::stringstream ss(env);
    std::string part;
    while (std::getline(ss, part, ':'))
      if (!part.empty()) dirs.emplace_back(part);
  }
  const fs::path exe = boost::dll::program_location().string();
  dirs.push_back(exe.parent_path().parent_path() / "lib" / "wick" / "plugins");
  return dirs;
}

PluginEntry Registry::load(const fs::path& file) const {
  PluginEntry e;
  e.file = file;
  e.name = file.stem().string();
  if (e.name.starts_with("lib")) e.name = e.name.substr(3);
  try {
    e.library = std::make_shared<boost::dll::shared_library>(
        file.string(), boost::dll::load_mode::rtld_lazy | boost::dll::load_mode::rtld_local);
  } catch (const std::exception& ex) {
    e.error = std::string("cannot be loaded: ") + ex.what();
    return e;
  }
  if (!e.library->has("wick_plugin")) {
    e.error = "is not a wick plugin (it exports no 'wick_plugin')";
    return e;
  }
  const auto& d = e.library->get_alias<const PluginDescriptor>("wick_plugin");
  if (d.name) e.name = d.name;
  if (d.abi_version != kAbiVersion) {
    e.error = "was built for wick plugin ABI " + std::to_string(d.abi_version) +
              ", this host has ABI " + std::to_string(kAbiVersion) + ": rebuild it against this wick";
    return e;
  }
  if (std::string(d.torch_version ? d.torch_version : "?") != TORCH_VERSION) {
    e.error = std::string("was built with LibTorch ") + (d.torch_version ? d.torch_version : "?") +
              ", this host has LibTorch " + TORCH_VERSION + ": rebuild it against this wick";
    return e;
  }
  if (auto problem = schema_problem(d); !problem.empty()) {
    e.error = "has a bad option schema: it " + problem;
    return e;
  }
  e.descriptor = &d;
  return e;
}

Registry::Registry(std::vector<fs::path> search_path) : search_path_(std::move(search_path)) {
  std::set<fs::path> seen_dirs, seen_files;
  for (const auto& dir : search_path_) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    const auto canon = fs::canonical(dir, ec);
    if (ec || !seen_dirs.insert(canon).second) continue;
    std::vector<fs::path> files;
    for (const auto& f : fs::directory_iterator(canon, ec))
      if (f.path().extension() == ".so") files.push_back(f.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files)
      if (seen_files.insert(fs::canonical(f, ec)).second) entries_.push_back(load(f));
  }
}

const PluginEntry& Registry::find(const std::string& name_or_path) {
  if (looks_like_path(name_or_path)) {
    std::error_code ec;
    const fs::path p = fs::absolute(name_or_path);
    if (!fs::exists(p, ec)) throw Error("plugin file " + name_or_path + " does not exist");
    auto key = fs::canonical(p).string();
    auto it = by_path_.find(key);
    if (it == by_path_.end()) it = by_path_.emplace(key, load(p)).first;
    if (!it->second.error.empty())
      throw Error("plugin " + name_or_path + " " + it->second.error);
    return it->second;
  }
  std::vector<const PluginEntry*> matches;
  for (const auto& e : entries_)
    if (e.name == name_or_path) matches.push_back(&e);
  if (matches.size() > 1)
    throw Error("plugin '" + name_or_path + "' is given twice: " + matches[0]->file.string() +
                " and " + matches[1]->file.string() + " (remove one from the plugin path)");
  if (matches.empty()) {
    std::vector<std::string> known;
    for (const auto& e : entries_)
      if (e.error.empty()) known.push_back(e.name);
    std::sort(known.begin(), known.end());
    std::vector<std::string> dirs;
    for (const auto& d : search_path_) dirs.push_back(d.string());
    throw Error("unknown plugin '" + name_or_path + "' (known plugins: " +
                (known.empty() ? std::string("none") : join(known)) + "; searched " + join(dirs, ":") + ")");
  }
  if (!matches[0]->error.empty())
    throw Error("plugin '" + name_or_path + "' (" + matches[0]->file.string() + ") " + matches[0]->error);
  return *matches[0];
}

std::shared_ptr<Object> Registry::create(const std::string& name_or_path, PluginKind kind,
                                         const std::map<std::string, Value>& given) {
  const PluginEntry& e = find(name_or_path);
  const PluginDescriptor& d = *e.descriptor;
  const std::string label = std::string(to_string(d.kind)) + " '" + d.name + "'";
  if (d.kind != kind)
    throw Error("plugin '" + std::string(d.name) + "' is " + (d.kind == PluginKind::Optim ? "an " : "a ") +
                to_string(d.kind) + " plugin, not " + (kind == PluginKind::Optim ? "an " : "a ") + to_string(kind) +
                " plugin");
  Options options = validate_options(label, d.options, given);
  std::shared_ptr<Object> obj;
  try {
    obj = d.create(options);
  } catch (const std::exception& ex) {
    throw Error(label + " (" + e.file.string() + ") failed to build: " + ex.what());
  }
  if (!obj) throw Error(label + " (" + e.file.string() + ") returned nothing from its factory");
  if (obj->object_kind() != d.makes)
    throw Error(label + " (" + e.file.string() + ") made a " + to_string(obj->object_kind()) +
                " where it declares a " + to_string(d.makes));
  // The object keeps its library loaded: the holder owns both, and destroys
  // the object before the library.
  struct Holder {
    std::shared_ptr<boost::dll::shared_library> library;
    std::shared_ptr<Object> object;
    ~Holder() { object.reset(); }
  };
  auto holder = std::make_shared<Holder>(Holder{e.library, obj});
  return std::shared_ptr<Object>(holder, obj.get());
}

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace wick
