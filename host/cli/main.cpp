// The wick command line.

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <climits>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "cli/launch.hpp"
#include "media/make_clips.hpp"
#include "lua/runtime.hpp"
#include "util/memory.hpp"
#include "plugin/registry.hpp"
#include "train/run_options.hpp"
#include "util/system.hpp"

namespace {

constexpr const char* kUsage = R"(usage: wick <command> [arguments]

commands:
  run RECIPE [key=value ...]   run a Lua recipe; the pairs are wick.args (and
                               override wick.train options of the same name)
  launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]
         RECIPE [key=value ...]
                               run a recipe on N local ranks (one process each)
  plugins [--json]             list the plugins on the plugin path
  generate MODEL_DIR [prompt=TEXT max_new_tokens=N temperature=T top_k=K top_p=P seed=S]
                               continue a prompt with a decoder_lm folder
  plan RECIPE [--device-memory SIZE] [key=value ...]
                               measure the recipe's memory for each knob (one
                               step each, nothing saved) and suggest settings
                               that fit SIZE (8GiB, 12GB, ...)
  report RUN_DIR [-o FILE]     one self-contained HTML file with the run's plots
                               (default RUN_DIR/report.html)
  runs [DIR] [--json]          a table of the runs under DIR (default runs/)
  make-clips DIR [--classes N] [--per-class N] [--size WxH] [--seconds S] [--fps F]
             [--seed S] [--no-extras] [--no-images]
                               write a toy video data set (moving shapes, one
                               class per shape) with manifest.csv, for trying
                               and testing video data plugins
  describe NAME                show a plugin's options (or 'train' for wick.train's)
  version                      wick, LibTorch, CUDA and NCCL versions; is CUDA usable
  --help                       this text

environment:
  WICK_PLUGIN_PATH   colon-separated folders searched for plugins before the
                     installed plugin folder
  WICK_TRACEBACK     set to print a Lua traceback with recipe errors
  WICK_DIST_TIMEOUT  seconds a collective waits for the other ranks (300)
  WICK_CPU_MEMORY_LIMIT
                     cap on the bytes CPU tensors may hold (8GiB, 512MiB, ...):
                     allocations beyond it fail as a full GPU's do
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
                     or SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODELIST:
                     `wick run` joins a group of ranks
)";

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "wick: error: %s\n\n%s", msg.c_str(), kUsage);
  return 2;
}

std::string value_str(const wick::OptionSpec& o) {
  return o.required() ? "(required)" : o.default_value.is_nil() ? "(none)" : o.default_value.repr();
}

int cmd_plugins(bool json) {
  auto& reg = wick::registry();
  if (json) {
    auto arr = nlohmann::json::array();
    for (const auto& e : reg.entries()) {
      nlohmann::json j = {{"name", e.name}, {"file", e.file.string()}};
      if (e.descriptor) {
        j["kind"] = wick::to_string(e.descriptor->kind);
        j["summary"] = e.descriptor->summary;
        auto opts = nlohmann::json::array();
        for (const auto& o : e.descriptor->options) opts.push_back(o.name);
        j["options"] = opts;
      } else {
        j["error"] = e.error;
      }
      arr.push_back(j);
    }
    std::cout << arr.dump(2) << "\n";
    return 0;
  }
  if (reg.entries().empty()) std::cout << "no plugins found\n";
  for (const auto& e : reg.entries()) {
    if (e.descriptor)
      std::printf("%-6s %-16s %s\n", wick::to_string(e.descriptor->kind), e.name.c_str(), e.descriptor->summary);
    else
      std::printf("%-6s %-16s unusable: %s\n", "?", e.name.c_str(), e.error.c_str());
  }
  std::printf("\nsearched: ");
  for (std::size_t i = 0; i < reg.search_path().size(); ++i)
    std::printf("%s%s", i ? ":" : "", reg.search_path()[i].c_str());
  std::printf("\n");
  return 0;
}

int cmd_describe(const std::string& name) {
  if (name == "train") {
    std::printf("%s", wick::describe_run_options().c_str());
    return 0;
  }
  const auto& e = wick::registry().find(name);
  const auto& d = *e.descriptor;
  std::printf("%s (%s plugin): %s\nfile: %s\n\noptions:\n", d.name, wick::to_string(d.kind), d.summary,
              e.file.c_str());
  if (d.options.empty()) std::printf("  (none)\n");
  for (const auto& o : d.options) {
    std::string constraint;
    if (o.min && o.max) constraint = " in [" + wick::Value(*o.min).repr() + ", " + wick::Value(*o.max).repr() + "]";
    else if (o.min) constraint = " >= " + wick::Value(*o.min).repr();
    else if (o.max) constraint = " <= " + wick::Value(*o.max).repr();
    if (!o.choices.empty()) {
      constraint = " one of";
      for (const auto& c : o.choices) constraint += " " + c;
    }
    std::printf("  %-16s %-17s default %s%s\n      %s\n", o.name.c_str(), wick::to_string(o.type),
                value_str(o).c_str(), constraint.c_str(), o.doc.c_str());
  }
  return 0;
}

int cmd_version() {
  const auto v = wick::versions();
  for (const char* k : {"wick", "plugin_abi", "libtorch", "cuda_runtime", "cuda_driver", "nccl", "cuda_usable"}) {
    auto it = v.find(k);
    if (it != v.end()) std::printf("%-13s %s\n", k, it->second.c_str());
  }
  return 0;
}

std::vector<std::pair<std::string, std::string>> key_values(const std::vector<std::string>& args, std::size_t from) {
  std::vector<std::pair<std::string, std::string>> kv;
  for (std::size_t i = from; i < args.size(); ++i) {
    const auto eq = args[i].find('=');
    if (eq == std::string::npos || eq == 0) throw std::invalid_argument(args[i]);
    kv.emplace_back(args[i].substr(0, eq), args[i].substr(eq + 1));
  }
  return kv;
}

int cmd_generate(const std::vector<std::string>& args) {
  if (args.empty()) return usage_error("'wick generate' needs a model folder");
  std::vector<std::pair<std::string, std::string>> kv;
  try {
    kv = key_values(args, 1);
  } catch (const std::invalid_argument& e) {
    return usage_error(std::string("argument '") + e.what() + "' after the model folder is not key=value");
  }
  wick::LuaRuntime rt(kv);
  rt.call("wick.generate", "main", {args[0]});
  return 0;
}

// wick report RUN_DIR [-o FILE]
int cmd_report(const std::vector<std::string>& args) {
  std::string dir, out;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "-o" || args[i] == "--output") {
      if (i + 1 >= args.size()) return usage_error(args[i] + " needs a file name");
      out = args[++i];
    } else if (dir.empty() && args[i].rfind('-', 0) != 0) {
      dir = args[i];
    } else {
      return usage_error("unexpected argument '" + args[i] + "' to report");
    }
  }
  if (dir.empty()) return usage_error("'wick report' needs a run folder");
  wick::LuaRuntime rt;
  rt.call("wick.report", "main", {dir, out});
  return 0;
}

// wick runs [DIR] [--json]
int cmd_runs(const std::vector<std::string>& args) {
  std::string dir = "runs", json = "";
  bool dir_given = false;
  for (const auto& a : args) {
    if (a == "--json") json = "json";
    else if (!dir_given && a.rfind('-', 0) != 0) dir = a, dir_given = true;
    else return usage_error("unexpected argument '" + a + "' to runs");
  }
  wick::LuaRuntime rt;
  rt.call("wick.runs", "main", {dir, json});
  return 0;
}

int cmd_run(const std::vector<std::string>& args) {
  if (args.empty()) return usage_error("'wick run' needs a recipe file");
  std::vector<std::pair<std::string, std::string>> kv;
  for (std::size_t i = 1; i < args.size(); ++i) {
    const auto eq = args[i].find('=');
    if (eq == std::string::npos || eq == 0)
      return usage_error("argument '" + args[i] + "' after the recipe is not key=value");
    kv.emplace_back(args[i].substr(0, eq), args[i].substr(eq + 1));
  }
  wick::install_signal_handlers();
  wick::LuaRuntime rt(kv);
  return rt.run_file(args[0]);
}

// wick plan RECIPE [--device-memory SIZE] [key=value ...]: the recipe runs up
// to its wick.train call, which measures memory instead of training.
int cmd_plan(std::vector<std::string> args) {
  std::int64_t device_memory = 0;
  for (std::size_t i = 0; i < args.size();) {
    if (args[i] == "--device-memory") {
      if (i + 1 >= args.size()) return usage_error("--device-memory needs a size such as 8GiB");
      device_memory = wick::parse_bytes(args[i + 1], "--device-memory");
      args.erase(args.begin() + static_cast<long>(i), args.begin() + static_cast<long>(i) + 2);
    } else {
      ++i;
    }
  }
  if (args.empty()) return usage_error("'wick plan' needs a recipe file");
  std::vector<std::pair<std::string, std::string>> kv;
  try {
    kv = key_values(args, 1);
  } catch (const std::invalid_argument& e) {
    return usage_error(std::string("argument '") + e.what() + "' after the recipe is not key=value");
  }
  wick::LuaRuntime rt(kv);
  rt.set_plan(device_memory);
  const int rc = rt.run_file(args[0]);
  if (rc != 0) return rc;
  if (rt.planned()) return 0;
  std::fprintf(stderr, "wick: error: wick plan: the recipe never called wick.train\n");
  return 1;
}

// wick make-clips DIR [--classes N] [--per-class N] [--size WxH] [--seconds S]
//                 [--fps F] [--seed S] [--no-extras] [--no-images]
int cmd_make_clips(const std::vector<std::string>& args) {
  wick::ClipSetOptions o;
  std::string dir;
  auto whole_int = [](const std::string& v, long long lo, long long hi, long long& out) {
    std::size_t used = 0;
    try {
      out = std::stoll(v, &used);
    } catch (const std::exception&) {
      return false;
    }
    return used == v.size() && out >= lo && out <= hi;
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--no-extras") { o.extras = false; continue; }
    if (a == "--no-images") { o.images = false; continue; }
    if (a.rfind("--", 0) != 0) {
      if (!dir.empty()) return usage_error("unexpected argument '" + a + "' to make-clips (the folder is '" + dir + "')");
      dir = a;
      continue;
    }
    if (a != "--classes" && a != "--per-class" && a != "--size" && a != "--seconds" && a != "--fps" && a != "--seed")
      return usage_error("unknown option '" + a + "' to make-clips");
    if (i + 1 >= args.size()) return usage_error(a + " needs a value");
    const std::string& v = args[++i];
    long long n = 0;
    if (a == "--classes") {
      if (!whole_int(v, 1, 6, n)) return usage_error("--classes expects a whole number from 1 to 6, not '" + v + "'");
      o.classes = static_cast<int>(n);
    } else if (a == "--per-class") {
      if (!whole_int(v, 1, 100000, n)) return usage_error("--per-class expects a whole number of at least 1, not '" + v + "'");
      o.per_class = static_cast<int>(n);
    } else if (a == "--fps") {
      if (!whole_int(v, 1, 1000, n)) return usage_error("--fps expects a whole number from 1 to 1000, not '" + v + "'");
      o.fps = static_cast<int>(n);
    } else if (a == "--seed") {
      if (v.empty() || v[0] == '-' || !whole_int(v, 0, LLONG_MAX, n))
        return usage_error("--seed expects a whole number of at least 0, not '" + v + "'");
      o.seed = static_cast<std::uint64_t>(n);
    } else if (a == "--seconds") {
      std::size_t used = 0;
      double d = 0;
      try {
        d = std::stod(v, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != v.size() || !(d > 0) || d > 3600)
        return usage_error("--seconds expects a length in seconds above 0 and at most 3600, not '" + v + "'");
      o.seconds = d;
    } else {  // --size
      const auto x = v.find('x');
      long long w = 0, h = 0;
      if (x == std::string::npos || !whole_int(v.substr(0, x), 64, 8192, w) || !whole_int(v.substr(x + 1), 48, 8192, h) ||
          w % 2 || h % 2)
        return usage_error("--size expects WIDTHxHEIGHT, even numbers from 64x48 to 8192x8192, not '" + v + "'");
      o.width = static_cast<int>(w);
      o.height = static_cast<int>(h);
    }
  }
  if (dir.empty()) return usage_error("'wick make-clips' needs a folder");
  wick::quiet_media_logs();
  wick::ClipSetReport rep;
  try {
    rep = wick::make_clip_set(dir, o);
  } catch (const std::invalid_argument& e) {
    return usage_error(e.what());
  }
  const std::string manifest = (std::filesystem::path(dir) / "manifest.csv").string();
  std::printf("wick make-clips: %d clips, %d images, %d extras in %s (manifest %s)\n", rep.clips, rep.images,
              rep.extras, dir.c_str(), manifest.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) return usage_error("no command given");
  wick::quiet_torch_logs();
  const std::string cmd = args[0];
  args.erase(args.begin());
  try {
    if (cmd == "--help" || cmd == "-h" || cmd == "help") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (const char* lim = std::getenv("WICK_CPU_MEMORY_LIMIT"); lim && *lim)
      wick::set_cpu_memory_limit(wick::parse_bytes(lim, "WICK_CPU_MEMORY_LIMIT"));
    if (cmd == "run") return cmd_run(args);
    if (cmd == "plan") return cmd_plan(args);
    if (cmd == "launch") return wick::launch(args);
    if (cmd == "generate") return cmd_generate(args);
    if (cmd == "report") return cmd_report(args);
    if (cmd == "make-clips") return cmd_make_clips(args);
    if (cmd == "runs") return cmd_runs(args);
    if (cmd == "plugins") {
      if (!args.empty() && args[0] != "--json") return usage_error("unknown option '" + args[0] + "' to plugins");
      return cmd_plugins(!args.empty());
    }
    if (cmd == "describe") {
      if (args.size() != 1) return usage_error("'wick describe' needs one plugin name");
      return cmd_describe(args[0]);
    }
    if (cmd == "version" || cmd == "--version") return cmd_version();
    return usage_error("unknown command '" + cmd + "'");
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "wick: error: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "wick: error: %s\n", e.what());
    return 1;
  }
}
