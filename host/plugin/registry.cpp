#include "plugin/registry.hpp"

#include <boost/dll/shared_library.hpp>

#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <set>
#include <sstream>
#include <string>

#include "util/layout.hpp"

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
    case OptionType::Number: case OptionType::NumberList: return v.is_number();
    case OptionType::String: case OptionType::StringList: return v.is_string();
  }
  return false;
}

bool is_list_type(OptionType t) {
  return t == OptionType::IntList || t == OptionType::NumberList || t == OptionType::StringList;
}

// A plugin's own schema must make sense before any recipe is checked against it.
std::string schema_problem(const PluginDescriptor& d) {
  if (!d.name || !*d.name) return "lacks a name";
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
    if (o.min && o.max && (o.min_open || o.max_open) && *o.min == *o.max)
      return "declares option '" + o.name + "' with an empty range (min = max, an end excluded)";
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

// ---- what a library's `wick_plugin` points at ----
// WICK_PLUGIN (BOOST_DLL_ALIAS) exports `wick_plugin` as a pointer-sized
// object holding the address of the library's descriptor. Anything else under
// that name (an int, a function, a null or stray pointer) is refused before
// the host reads through it.

// The loaded segment that holds the bytes [p, p + n): the base of its object,
// where the segment ends and whether it is code.
struct Segment {
  ElfW(Addr) object = 0;
  std::uintptr_t end = 0;
  bool code = false;
};

std::optional<Segment> segment_of(const void* p, std::size_t n) {
  struct Ask {
    std::uintptr_t lo, hi;
    std::optional<Segment> found;
  } ask{reinterpret_cast<std::uintptr_t>(p), reinterpret_cast<std::uintptr_t>(p) + n, std::nullopt};
  if (ask.hi < ask.lo) return std::nullopt;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) -> int {
        auto* a = static_cast<Ask*>(data);
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const auto& ph = info->dlpi_phdr[i];
          if (ph.p_type != PT_LOAD) continue;
          const std::uintptr_t start = info->dlpi_addr + ph.p_vaddr, end = start + ph.p_memsz;
          if (a->lo >= start && a->hi <= end) {
            a->found = Segment{info->dlpi_addr, end, (ph.p_flags & PF_X) != 0};
            return 1;
          }
        }
        return 0;
      },
      &ask);
  return ask.found;
}

// A C string of at most 200 characters that lies wholly in loaded memory.
std::optional<std::string> loaded_string(const char* s) {
  if (!s) return std::nullopt;
  const auto seg = segment_of(s, 1);
  if (!seg) return std::nullopt;
  std::string out;
  for (auto p = reinterpret_cast<std::uintptr_t>(s); p < seg->end && out.size() <= 200; ++p) {
    const char c = *reinterpret_cast<const char*>(p);
    if (c == '\0') return out;
    out.push_back(c);
  }
  return std::nullopt;
}

// The descriptor `wick_plugin` points at, or why it points at none.
const PluginDescriptor* descriptor_of(void* handle, std::string* why) {
  const std::string made_by = "; WICK_PLUGIN(...) exports it as a pointer to the plugin's descriptor";
  void* sym = ::dlsym(handle, "wick_plugin");
  Dl_info info{};
  void* extra = nullptr;  // the symbol's ELF entry
  if (!sym || !::dladdr1(sym, &info, &extra, RTLD_DL_SYMENT) || !extra ||
      info.dli_saddr != sym) {
    *why = "exports a 'wick_plugin' that cannot be inspected" + made_by;
    return nullptr;
  }
  const auto* elf = static_cast<const ElfW(Sym)*>(extra);
  const auto type = ELF64_ST_TYPE(elf->st_info);  // the same bits in ELF32_ST_TYPE
  if (type == STT_FUNC || type == STT_GNU_IFUNC) {
    *why = "exports 'wick_plugin' as a function" + made_by;
    return nullptr;
  }
  const auto alias = segment_of(sym, sizeof(void*));
  if (elf->st_size != sizeof(void*) || !alias) {
    *why = "exports 'wick_plugin' as a " + std::to_string(elf->st_size) + "-byte object, not a " +
           std::to_string(sizeof(void*)) + "-byte pointer" + made_by;
    return nullptr;
  }
  const void* p = *static_cast<const void* const*>(sym);
  if (!p) {
    *why = "exports a 'wick_plugin' that points to nothing (a null pointer)" + made_by;
    return nullptr;
  }
  if (const auto first = segment_of(p, 1); first && first->code) {
    *why = "exports a 'wick_plugin' that points into code (a function?), not to a descriptor" + made_by;
    return nullptr;
  }
  const auto at = segment_of(p, sizeof(PluginDescriptor));
  if (reinterpret_cast<std::uintptr_t>(p) % alignof(PluginDescriptor) != 0 || !at || at->object != alias->object) {
    *why = "exports a 'wick_plugin' that does not point to a descriptor inside the library" + made_by;
    return nullptr;
  }
  return static_cast<const PluginDescriptor*>(p);
}

// ---- loading without being taken down ----
// Loading a library runs its static initialisation, which may crash, exit or
// hang the process. A child process (fork) loads the files first, one after
// another, saying on a pipe which one it starts; a file that ends or stalls
// the child is reported as unusable and never loaded by this process.
constexpr int kLoadStallSeconds = 60;

std::string how_it_ended(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = ::sigabbrev_np(sig);
    return "was killed by " + (name ? std::string("SIG") + name : "signal " + std::to_string(sig));
  }
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  return "ended with status " + std::to_string(status);
}

// For each file: "" when loading it in a child process went through, else why not.
std::vector<std::string> trial_load(const std::vector<fs::path>& files,
                                    const std::function<void(const fs::path&)>& load) {
  std::vector<std::string> verdict(files.size());
  constexpr std::uint32_t kAllDone = 0xffffffffu;
  std::size_t next = 0;
  while (next < files.size()) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) break;  // no trial: load here, as without one
    std::fflush(nullptr);                      // nothing buffered is written twice
    const pid_t pid = ::fork();
    if (pid < 0) {
      ::close(fds[0]), ::close(fds[1]);
      break;
    }
    if (pid == 0) {
      ::close(fds[0]);
      if (const int null = ::open("/dev/null", O_WRONLY); null >= 0) ::dup2(null, 1), ::dup2(null, 2);
      const rlimit no_core{0, 0};
      ::setrlimit(RLIMIT_CORE, &no_core);
      for (std::size_t i = next; i < files.size(); ++i) {
        const auto index = static_cast<std::uint32_t>(i);
        if (::write(fds[1], &index, sizeof index) != sizeof index) ::_exit(0);
        try {
          load(files[i]);
        } catch (...) {
        }
      }
      if (::write(fds[1], &kAllDone, sizeof kAllDone) != sizeof kAllDone) ::_exit(0);
      ::_exit(0);
    }
    ::close(fds[1]);
    std::int64_t current = -1;
    bool finished = false, stalled = false;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kLoadStallSeconds);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      pollfd pfd{fds[0], POLLIN, 0};
      const int r = ::poll(&pfd, 1, static_cast<int>(std::max<std::int64_t>(left.count(), 0)));
      if (r < 0 && errno == EINTR) continue;
      if (r == 0) {
        stalled = true;
        break;
      }
      std::uint32_t index = 0;
      const ssize_t n = ::read(fds[0], &index, sizeof index);
      if (n < 0 && errno == EINTR) continue;
      if (n != sizeof index) break;  // the child ended
      if (index == kAllDone) {
        finished = true;
        break;
      }
      current = index;
      deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kLoadStallSeconds);
    }
    ::close(fds[0]);
    if (stalled) ::kill(pid, SIGKILL);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (finished || current < 0) break;
    verdict[static_cast<std::size_t>(current)] =
        stalled ? "cannot be loaded: loading it did not finish within " + std::to_string(kLoadStallSeconds) +
                      " s (its static initialisation hangs?); it was not loaded"
                : "cannot be loaded: a test process that loaded it " + how_it_ended(status) +
                      " (its static initialisation crashes); it was not loaded";
    next = static_cast<std::size_t>(current) + 1;
  }
  return verdict;
}

// Why a name found in several files cannot be used: all of them, in search order.
std::string given_again(const std::vector<std::string>& files) {
  return "is given " + (files.size() == 2 ? std::string("twice") : std::to_string(files.size()) + " times") + ": " +
         join(files, " and ") + " (remove " + (files.size() == 2 ? "one" : "all but one") + " from the plugin path)";
}

PluginEntry unusable(const fs::path& file, const std::string& why) {
  PluginEntry e;
  e.file = file;
  e.name = file.stem().string();
  if (e.name.starts_with("lib")) e.name = e.name.substr(3);
  e.error = why;
  return e;
}

// What a factory's exception says, as one line: LibTorch's message without
// its C++ frames ("Exception raised from ..."), and an allocation that could
// not be made (a size in the options too large) said so, naming the options
// that set the largest sizes.
std::string build_failure(const std::exception& ex, const std::map<std::string, Value>& given) {
  std::string msg;
  if (const auto* c = dynamic_cast<const c10::Error*>(&ex)) msg = c->what_without_backtrace();
  else msg = ex.what();
  for (const char* cut : {"\nException raised from", "\n"})
    if (const auto at = msg.find(cut); at != std::string::npos) msg.resize(at);
  const bool alloc = msg.find("can't allocate memory") != std::string::npos ||
                     msg.find("Storage size calculation overflowed") != std::string::npos ||
                     dynamic_cast<const std::bad_alloc*>(&ex) != nullptr;
  // (an out-of-memory error, a cap's or a device's, already says what was asked and what there is)
  if (!alloc) return msg;
  std::string size;
  if (const auto at = msg.find("tried to allocate "); at != std::string::npos)
    size = " (" + std::to_string(std::strtoull(msg.c_str() + at + 18, nullptr, 10)) + " bytes)";
  // the integer options in order of their largest value: the likeliest cause first
  std::vector<std::pair<double, std::string>> sizes;
  for (const auto& [k, v] : given) {
    double top = 0;
    if (v.is_number()) top = v.as_number();
    else if (v.is_list())
      for (const auto& x : v.as_list())
        if (x.is_number()) top = std::max(top, x.as_number());
    if (top > 1) sizes.emplace_back(top, k + " = " + v.repr());
  }
  std::sort(sizes.begin(), sizes.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::string named;
  for (std::size_t i = 0; i < sizes.size() && i < 2; ++i) named += (i ? ", " : "") + sizes[i].second;
  return "its tensors at these sizes need more memory than can be allocated" + size +
         (named.empty() ? std::string() : "; the largest sizes among its options: " + named);
}

// "" when `d` is in the spec's range, else the range a message expects:
// "a value in [0, 1]", "a value in (0, 1e+30]", "a value >= 1", "a value > 0".
std::string outside_range(const OptionSpec& spec, double d) {
  const bool below = spec.min && (spec.min_open ? d <= *spec.min : d < *spec.min);
  const bool above = spec.max && (spec.max_open ? d >= *spec.max : d > *spec.max);
  if (!below && !above && !std::isnan(d)) return "";
  std::ostringstream range;
  if (spec.min && spec.max)
    range << "a value in " << (spec.min_open ? "(" : "[") << *spec.min << ", " << *spec.max << (spec.max_open ? ")" : "]");
  else if (spec.min) range << "a value " << (spec.min_open ? "> " : ">= ") << *spec.min;
  else if (spec.max) range << "a value " << (spec.max_open ? "< " : "<= ") << *spec.max;
  else return "";  // no range: nan is refused as not finite, before
  return range.str();
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
                   v.type_name() + " " + v.repr() + (what == "integer" ? v.not_exact_note() : ""));
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
    if (spec.type == OptionType::Number) converted = Value(v.as_number());
    if (spec.type == OptionType::NumberList) {
      List l;
      for (const auto& x : converted.as_list()) l.push_back(Value(x.as_number()));
      converted = Value(l);
    }
    std::vector<Value> scalars = converted.is_list() ? converted.as_list() : List{converted};
    for (const auto& x : scalars) {
      // one rule for every number option: inf and nan (lr = 1/0, tonumber("inf")) are never a setting
      if (x.is_number() && !std::isfinite(x.as_number())) throw bad("a finite number");
      if (x.is_number())
        if (const std::string range = outside_range(spec, x.as_number()); !range.empty()) throw bad(range);
      if (x.is_string() && !spec.choices.empty() &&
          std::find(spec.choices.begin(), spec.choices.end(), x.as_string()) == spec.choices.end())
        throw bad("one of " + join(spec.choices));
    }
    out[spec.name] = converted;
  }
  return Options(std::move(out));
}

std::vector<const PluginDescriptor*> Registry::descriptors() const {
  std::vector<const PluginDescriptor*> out;
  for (const auto& e : entries_)
    if (e.descriptor && e.error.empty()) out.push_back(e.descriptor);
  for (const auto& [path, e] : by_path_)
    if (e.descriptor && e.error.empty()) out.push_back(e.descriptor);
  return out;
}

std::vector<fs::path> Registry::default_search_path() {
  std::vector<fs::path> dirs;
  if (const char* env = std::getenv("WICK_PLUGIN_PATH")) {
    std::stringstream ss(env);
    std::string part;
    while (std::getline(ss, part, ':'))
      if (!part.empty()) dirs.emplace_back(part);
  }
  dirs.push_back(layout::plugin_dir());
  return dirs;
}

PluginEntry Registry::load(const fs::path& file) const {
  PluginEntry e = unusable(file, "");
  e.library = std::make_shared<boost::dll::shared_library>();
  boost::dll::fs::error_code ec;
  ::dlerror();
  e.library->load(file.string(), boost::dll::load_mode::rtld_lazy | boost::dll::load_mode::rtld_local, ec);
  if (ec) {
    // dlerror() says why ("...: invalid ELF header"); the error code alone says "Bad file descriptor"
    const char* dl = ::dlerror();
    std::string why = dl ? dl : ec.message();
    if (why.starts_with(file.string() + ": ")) why.erase(0, file.string().size() + 2);
    e.library.reset();
    e.error = "cannot be loaded: " + why;
    return e;
  }
  if (!e.library->has("wick_plugin")) {
    e.error = "is not a wick plugin (it exports no 'wick_plugin')";
    return e;
  }
  const PluginDescriptor* dp = descriptor_of(e.library->native(), &e.error);
  if (!dp) return e;
  const PluginDescriptor& d = *dp;
  if (auto name = loaded_string(d.name); name && !name->empty()) e.name = *name;
  if (d.abi_version != kAbiVersion) {
    e.error = "was built for wick plugin ABI " + std::to_string(d.abi_version) +
              ", this host has ABI " + std::to_string(kAbiVersion) + ": rebuild it against this wick";
    return e;
  }
  const std::string torch = loaded_string(d.torch_version).value_or("?");
  if (torch != TORCH_VERSION) {
    e.error = "was built with LibTorch " + torch + ", this host has LibTorch " + TORCH_VERSION +
              ": rebuild it against this wick";
    return e;
  }
  if (auto problem = schema_problem(d); !problem.empty()) {
    e.error = "has a bad option schema: it " + problem;
    return e;
  }
  e.descriptor = &d;
  return e;
}

std::vector<PluginEntry> Registry::load_all(const std::vector<fs::path>& files) const {
  const auto verdict = trial_load(files, [this](const fs::path& f) { load(f); });
  std::vector<PluginEntry> out;
  for (std::size_t i = 0; i < files.size(); ++i)
    out.push_back(verdict[i].empty() ? load(files[i]) : unusable(files[i], verdict[i]));
  return out;
}

Registry::Registry(std::vector<fs::path> search_path) : search_path_(std::move(search_path)) {
  std::set<fs::path> seen_dirs, seen_files;
  std::vector<fs::path> found;
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
      if (seen_files.insert(fs::canonical(f, ec)).second) found.push_back(f);
  }
  entries_ = load_all(found);
  // A name given twice is refused by find(); the listing says so too.
  for (auto& e : entries_) {
    if (!e.error.empty()) continue;
    std::vector<std::string> files;
    for (const auto& o : entries_)
      if (o.name == e.name) files.push_back(o.file.string());
    if (files.size() > 1) {
      e.error = given_again(files);
      e.descriptor = nullptr;
    }
  }
}

const PluginEntry& Registry::find(const std::string& name_or_path) {
  if (looks_like_path(name_or_path)) {
    std::error_code ec;
    const fs::path p = fs::absolute(name_or_path);
    if (!fs::exists(p, ec)) throw Error("plugin file " + name_or_path + " does not exist");
    auto key = fs::canonical(p).string();
    auto it = by_path_.find(key);
    if (it == by_path_.end()) it = by_path_.emplace(key, std::move(load_all({p}).front())).first;
    if (!it->second.error.empty())
      throw Error("plugin " + name_or_path + " " + it->second.error);
    return it->second;
  }
  std::vector<const PluginEntry*> matches;
  for (const auto& e : entries_)
    if (e.name == name_or_path) matches.push_back(&e);
  if (matches.size() > 1) {
    std::vector<std::string> files;
    for (const auto* m : matches) files.push_back(m->file.string());
    throw Error("plugin '" + name_or_path + "' " + given_again(files));
  }
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
    throw Error(label + " (" + e.file.string() + ") failed to build: " + build_failure(ex, given));
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
