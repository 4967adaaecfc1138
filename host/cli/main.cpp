// The wick command line: one CLI11 subcommand per command. CLI11 splits the
// arguments and answers -h/--help; the messages, the key=value pairs after a
// recipe and the value checks stay wick's own, so every usage error reads
// "wick: error: ..." with the command's usage and exits 2.

#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cli/launch.hpp"
#include "distributed/group.hpp"
#include "lua/runtime.hpp"
#include "media/make_clips.hpp"
#include "plugin/registry.hpp"
#include "train/run_folder.hpp"
#include "train/run_options.hpp"
#include "util/args.hpp"
#include "util/layout.hpp"
#include "util/memory.hpp"
#include "util/system.hpp"

namespace {

// A usage error: the message for "wick: error: ..."; main adds the usage of
// the command it belongs to and exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What `wick --help` lists, in this order; each command's own help opens with
// its synopsis. docs/command-line.md's command table is checked against this list.
struct Command {
  const char* name;
  const char* synopsis;  // after "wick NAME"
  const char* summary;   // one line, also the command's description
  const char* details;   // more for the command's own help ("" if none)
};

const Command kCommands[] = {
    {"run", "RECIPE [key=value ...]", "run a Lua recipe",
     "The pairs are wick.args and override wick.train options of the same name. "
     "A value reads as a boolean (true, false), an integer (42, -7), a number "
     "(0.5, 3e-4) or else as the string given (nan, inf, 0x10, 1e5x stay strings). A pair that no "
     "option takes and the recipe never reads is named in a warning."},
    {"launch", "--nproc-per-node N [options] RECIPE [key=value ...]",
     "run a recipe on N local ranks, one `wick run` process each",
     "Each rank gets torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, "
     "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0 keeps the terminal; the "
     "others' lines are prefixed with [rank N]. When a rank fails the others are "
     "stopped."},
    {"plugins", "[--json]", "list the plugins on the plugin path, with unusable ones and why", ""},
    {"generate", "MODEL_DIR [key=value ...]", "continue a prompt with a decoder_lm folder",
     "Pairs: prompt=TEXT max_new_tokens=N temperature=T top_k=K top_p=P seed=S."},
    {"plan", "RECIPE [--device-memory SIZE] [--ranks N] [key=value ...]",
     "measure the recipe's memory for each knob and suggest settings that fit",
     "The recipe runs up to its wick.train call, which takes one step per setting "
     "(nothing is saved) instead of training, prints the peak and time of each, "
     "and suggests the fastest settings that fit SIZE. With --ranks N it runs on N "
     "local ranks and gives the figures of the rank holding the most, for each shard setting."},
    {"report", "RUN_DIR [-o FILE]", "write one self-contained HTML file with the run's plots", ""},
    {"runs", "[DIR] [--json]", "a table of the runs under DIR (default runs/)", ""},
    {"make-clips", "DIR [options]",
     "write a toy video and image data set (moving shapes, one class per shape)",
     "Writes DIR/videos/, DIR/manifest.csv and .jsonl, still images under DIR/images/ "
     "and special test clips under DIR/extras/, for trying and testing the video_folder "
     "and image_folder plugins. The same options write the same bytes."},
    {"describe", "NAME", "show a plugin's options (or 'train' for wick.train's)", ""},
    {"version", "", "wick, plugin ABI, LibTorch, CUDA and NCCL versions; whether CUDA is usable", ""},
};

constexpr const char* kEnvironment = R"(environment:
  WICK_PLUGIN_PATH   colon-separated folders searched for plugins before the
                     installed plugin folder
  WICK_TRACEBACK     set to print a Lua traceback with recipe errors
  WICK_DIST_TIMEOUT  seconds a collective waits for the other ranks (300)
  WICK_CPU_MEMORY_LIMIT
                     cap on the bytes CPU tensors may hold (8GiB, 512MiB, ...):
                     allocations beyond it fail as a full GPU's do
  WICK_MEMORY_PEAK_TRACE
                     1: after each wick.train, print the tensors held at its
                     last step's peak, summed by where they were allocated
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
                     or SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODELIST:
                     `wick run` joins a group of ranks
)";

const Command* find_command(const std::string& name) {
  for (const auto& c : kCommands)
    if (name == c.name) return &c;
  return nullptr;
}

std::string usage_line(const CLI::App* app) {
  if (!app || !app->get_parent()) return "usage: wick <command> [arguments]";
  const Command* c = find_command(app->get_name());
  std::string line = "usage: wick " + app->get_name();
  if (c && *c->synopsis) line += std::string(" ") + c->synopsis;
  return line;
}

// Text broken into lines of at most `width` columns, each but the first
// indented by `indent` spaces (the first continues the caller's line).
std::string wrap(const std::string& text, std::size_t indent, std::size_t width = 80) {
  std::istringstream words(text);
  std::string word, out;
  std::size_t col = indent;
  bool first = true;
  while (words >> word) {
    if (!first && col + 1 + word.size() > width) {
      out += "\n" + std::string(indent, ' ');
      col = indent;
    } else if (!first) {
      out += ' ';
      ++col;
    }
    out += word;
    col += word.size();
    first = false;
  }
  return out;
}

// "  LEFT        text", the text wrapped at column `col` (on the next line when LEFT is long).
std::string row(const std::string& left, const std::string& text, std::size_t col) {
  std::string out = "  " + left;
  if (out.size() + 2 > col) out += "\n" + std::string(col, ' ');
  else out += std::string(col - out.size(), ' ');
  return out + wrap(text, col) + "\n";
}

// Help in wick's layout: lower-case headings, the synopsis from kCommands,
// options with the value they take (option_text) and their doc.
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_help(const CLI::App* app, std::string, CLI::AppFormatMode) const override {
    std::string out = usage_line(app) + "\n\n";
    if (!app->get_parent()) {
      out += "commands:\n";
      for (const auto& c : kCommands) out += row(std::string(c.name) + (*c.synopsis ? " " : "") + c.synopsis, c.summary, 31);
      out += "\nRun 'wick <command> --help' for a command's arguments and options.\n\n";
      return out + kEnvironment;
    }
    out += wrap(app->get_description(), 0) + "\n";
    if (const Command* c = find_command(app->get_name()); c && *c->details) out += "\n" + wrap(c->details, 0) + "\n";
    const auto positionals = app->get_options([](const CLI::Option* o) { return o->get_positional(); });
    if (!positionals.empty()) {
      out += "\narguments:\n";
      for (const auto* o : positionals) out += row(o->get_option_text(), o->get_description(), 22);
    }
    out += "\noptions:\n";
    for (const auto* o : app->get_options([](const CLI::Option* o) { return o->nonpositional(); })) {
      std::string names;
      for (const auto& s : o->get_snames()) names += (names.empty() ? "-" : ", -") + s;
      for (const auto& l : o->get_lnames()) names += (names.empty() ? "--" : ", --") + l;
      if (!o->get_option_text().empty()) names += " " + o->get_option_text();
      out += row(names, o->get_description(), 22);
    }
    return out;
  }
};

// ---- value checks: CLI11 splits the arguments, these read the values ----

// A whole number in [lo, hi], read by wick's own rule: CLI11's conversion
// would take 010 as octal and 0x10 as hex.
std::int64_t whole_number(const std::string& flag, const std::string& text, std::int64_t lo, std::int64_t hi) {
  const wick::Value v = wick::parse_arg_value(text);
  if (v.is_int() && v.as_int() >= lo && v.as_int() <= hi) return v.as_int();
  std::string range = hi == std::numeric_limits<std::int64_t>::max()
                          ? "of at least " + std::to_string(lo)
                          : "from " + std::to_string(lo) + " to " + std::to_string(hi);
  throw UsageError(flag + " expects a whole number " + range + ", not '" + text + "'");
}

// The key=value pairs after a recipe or model folder.
std::vector<std::pair<std::string, std::string>> key_values(const std::vector<std::string>& args,
                                                             const std::string& after) {
  std::vector<std::pair<std::string, std::string>> kv;
  for (const auto& a : args) {
    const auto eq = a.find('=');
    if (eq == std::string::npos || eq == 0)
      throw UsageError("argument '" + a + "' after the " + after + " is not key=value");
    kv.emplace_back(a.substr(0, eq), a.substr(eq + 1));
  }
  return kv;
}

// Arguments CLI11 could not place (allow_extras keeps them for this message).
void refuse_extras(const CLI::App* sub) {
  for (const auto& a : sub->remaining()) {
    if (a.size() > 1 && a[0] == '-')
      throw UsageError("unknown option '" + a + "' to " + sub->get_name());
    throw UsageError("unexpected argument '" + a + "' to " + sub->get_name());
  }
}

// ---- the commands ----

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
        j["makes"] = wick::to_string(e.descriptor->makes);
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
      std::printf("%-15s %-16s %s\n", wick::kind_label(*e.descriptor).c_str(), e.name.c_str(), e.descriptor->summary);
    else
      std::printf("%-15s %-16s unusable: %s\n", "?", e.name.c_str(), e.error.c_str());
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
  std::printf("%s (%s plugin): %s\nfile: %s\n\noptions:\n", d.name, wick::kind_label(d).c_str(), d.summary,
              e.file.c_str());
  if (d.options.empty()) std::printf("  (none)\n");
  for (const auto& o : d.options) {
    std::string constraint;
    if (o.min && o.max)
      constraint = std::string(" in ") + (o.min_open ? "(" : "[") + wick::Value(*o.min).repr() + ", " +
                   wick::Value(*o.max).repr() + (o.max_open ? ")" : "]");
    else if (o.min) constraint = (o.min_open ? " > " : " >= ") + wick::Value(*o.min).repr();
    else if (o.max) constraint = (o.max_open ? " < " : " <= ") + wick::Value(*o.max).repr();
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
  // where this wick finds its files, and which LibTorch the loader found
  std::printf("%-13s %s\n", "prefix", wick::layout::prefix().c_str());
  std::printf("%-13s %s\n", "plugins", wick::layout::plugin_dir().c_str());
  std::printf("%-13s %s\n", "lua", wick::LuaRuntime::package_dir().c_str());
  std::printf("%-13s %s\n", "libtorch_dir", wick::layout::libtorch_dir().c_str());
  return 0;
}

// A key=value pair where the recipe belongs (`wick run a=1 recipe.lua`): the
// recipe comes first. A file of that name is a recipe all the same.
void recipe_first(const std::string& recipe, const std::vector<std::string>& pairs, const char* command) {
  std::error_code ec;
  if (recipe.find('=') == std::string::npos || recipe[0] == '=' || std::filesystem::exists(recipe, ec)) return;
  std::string rest;
  for (const auto& p : pairs)
    if (p.find('=') == std::string::npos || p[0] == '=') rest = p;
  throw UsageError("'" + recipe + "' is not a recipe file: the recipe comes first, then the key=value pairs" +
                   (rest.empty() ? std::string() : " (wick " + std::string(command) + " " + rest + " " + recipe + " ...)"));
}

// After a recipe ran to its end: the key=value pairs it never read (neither
// from wick.args nor taken as a wick.train option) and not named already
// (a typo is named at wick.train's start), once, on rank 0. A warning: the
// recipe did run.
void warn_unused(wick::RunContext& context) {
  const auto unused = context.report_unread();
  if (unused.empty()) return;
  try {
    if (wick::dist_env().rank != 0) return;
  } catch (const std::exception&) {
  }
  const bool one = unused.size() == 1;
  std::fprintf(stderr,
               "wick: warning: command-line %s %s never used: no wick.train option took %s and the recipe never "
               "read %s from wick.args\n",
               one ? "key" : "keys", wick::join_pairs(unused).c_str(), one ? "it" : "them", one ? "it" : "them");
}

int cmd_run(const std::string& recipe, const std::vector<std::string>& pairs) {
  if (recipe.empty()) throw UsageError("'wick run' needs a recipe file");
  recipe_first(recipe, pairs, "run");
  auto kv = key_values(pairs, "recipe");
  wick::dist_timeout();  // a bad WICK_DIST_TIMEOUT is refused before the recipe runs, also on one rank
  wick::install_signal_handlers();
  wick::LuaRuntime rt(wick::RunContext(std::move(kv)));
  const int rc = rt.run_file(recipe);
  if (rc == 0) warn_unused(rt.context());
  wick::announce_end(rc);  // a rank still waiting for this one learns why at once
  return rc;
}

// The recipe runs up to its wick.train call, which measures memory instead of training.
// --ranks N: the same, measured on N local ranks (each a `wick plan` process
// under the launcher), with the per-rank figures of each shard setting.
int cmd_plan(const std::string& recipe, const std::string& device_memory_text, const std::string& ranks_text,
             const std::vector<std::string>& pairs) {
  if (!ranks_text.empty()) {
    const int ranks = static_cast<int>(whole_number("--ranks", ranks_text, 1, 64));
    if (ranks > 1) {
      if (const char* ws = std::getenv("WORLD_SIZE"); ws && std::string(ws) != "1")
        throw UsageError("--ranks: this process is already one of WORLD_SIZE=" + std::string(ws) +
                         " ranks; run 'wick plan --ranks N' outside a launcher");
      if (recipe.empty()) throw UsageError("'wick plan' needs a recipe file");
      recipe_first(recipe, pairs, "plan");
      key_values(pairs, "recipe");  // refused here once, not by every rank
      if (!device_memory_text.empty()) wick::parse_bytes(device_memory_text, "--device-memory", /*need_unit=*/true);
      wick::LaunchOptions o;
      o.nproc_per_node = ranks;
      o.verb = "plan";
      o.run_args.push_back(recipe);
      if (!device_memory_text.empty()) o.run_args.insert(o.run_args.end(), {"--device-memory", device_memory_text});
      o.run_args.insert(o.run_args.end(), pairs.begin(), pairs.end());
      return wick::launch(o);
    }
  }
  std::int64_t device_memory = 0;
  if (!device_memory_text.empty()) {
    try {
      device_memory = wick::parse_bytes(device_memory_text, "--device-memory", /*need_unit=*/true);
    } catch (const wick::Error& e) {
      throw UsageError(e.what());
    }
  }
  if (recipe.empty()) throw UsageError("'wick plan' needs a recipe file");
  recipe_first(recipe, pairs, "plan");
  auto kv = key_values(pairs, "recipe");
  wick::LuaRuntime rt(wick::RunContext(std::move(kv)));
  rt.set_plan(device_memory);
  const int rc = rt.run_file(recipe);
  if (rc != 0) return rc;
  if (rt.planned()) return 0;
  std::fprintf(stderr, "wick: error: wick plan: the recipe never called wick.train\n");
  return 1;
}

int cmd_generate(const std::string& dir, const std::vector<std::string>& pairs) {
  if (dir.empty()) throw UsageError("'wick generate' needs a model folder");
  wick::LuaRuntime rt(wick::RunContext(key_values(pairs, "model folder")));
  rt.call("wick.generate", "main", {dir});
  return 0;
}

int cmd_report(const std::string& dir, const std::string& out) {
  if (dir.empty()) throw UsageError("'wick report' needs a run folder");
  if (!out.empty()) wick::refuse_run_file(out, "wick report -o");
  wick::LuaRuntime rt;
  rt.call("wick.report", "main", {dir, out});
  return 0;
}

int cmd_runs(const std::string& dir, bool json) {
  wick::LuaRuntime rt;
  rt.call("wick.runs", "main", {dir, json ? "json" : ""});
  return 0;
}

struct ClipFlags {
  std::string dir, classes, per_class, size, seconds, fps, seed;
  bool no_extras = false, no_images = false;
};

int cmd_make_clips(const ClipFlags& f) {
  if (f.dir.empty()) throw UsageError("'wick make-clips' needs a folder");
  wick::ClipSetOptions o;
  if (!f.classes.empty()) o.classes = static_cast<int>(whole_number("--classes", f.classes, 1, 6));
  if (!f.per_class.empty()) o.per_class = static_cast<int>(whole_number("--per-class", f.per_class, 1, 100000));
  if (!f.fps.empty()) o.fps = static_cast<int>(whole_number("--fps", f.fps, 1, 1000));
  if (!f.seed.empty())
    o.seed = static_cast<std::uint64_t>(
        whole_number("--seed", f.seed, 0, std::numeric_limits<std::int64_t>::max()));
  if (!f.seconds.empty()) {
    const wick::Value v = wick::parse_arg_value(f.seconds);
    if (!v.is_number() || !(v.as_number() > 0) || v.as_number() > 3600)
      throw UsageError("--seconds expects a length in seconds above 0 and at most 3600, not '" + f.seconds + "'");
    o.seconds = v.as_number();
  }
  if (!f.size.empty()) {
    const auto x = f.size.find('x');
    const wick::Value w = wick::parse_arg_value(f.size.substr(0, x));
    const wick::Value h = x == std::string::npos ? wick::Value() : wick::parse_arg_value(f.size.substr(x + 1));
    if (!w.is_int() || !h.is_int() || w.as_int() < 64 || w.as_int() > 8192 || h.as_int() < 48 ||
        h.as_int() > 8192 || w.as_int() % 2 || h.as_int() % 2)
      throw UsageError("--size expects WIDTHxHEIGHT, even numbers from 64x48 to 8192x8192, not '" + f.size + "'");
    o.width = static_cast<int>(w.as_int());
    o.height = static_cast<int>(h.as_int());
  }
  o.extras = !f.no_extras;
  o.images = !f.no_images;
  wick::quiet_media_logs();
  wick::ClipSetReport rep;
  try {
    rep = wick::make_clip_set(f.dir, o);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  const std::string manifest = (std::filesystem::path(f.dir) / "manifest.csv").string();
  std::printf("wick make-clips: %d clips, %d images, %d extras in %s (manifest %s)\n", rep.clips, rep.images,
              rep.extras, f.dir.c_str(), manifest.c_str());
  return 0;
}

struct LaunchFlags {
  std::string nproc_per_node, nnodes, node_rank, master_port;
  std::string master_addr;
  bool standalone = false;
  std::string recipe;
  std::vector<std::string> pairs;
};

int cmd_launch(const LaunchFlags& f) {
  wick::LaunchOptions o;
  if (f.nproc_per_node.empty()) throw UsageError("--nproc-per-node is required");
  o.nproc_per_node = static_cast<int>(whole_number("--nproc-per-node", f.nproc_per_node, 1, 65535));
  if (!f.nnodes.empty()) o.nnodes = static_cast<int>(whole_number("--nnodes", f.nnodes, 1, 65535));
  if (!f.node_rank.empty()) o.node_rank = static_cast<int>(whole_number("--node-rank", f.node_rank, 0, 65535));
  if (!f.master_port.empty()) o.master_port = static_cast<int>(whole_number("--master-port", f.master_port, 1, 65535));
  // torchrun's --standalone: one node, its own rendezvous on a free local port (wick launch's default)
  if (f.standalone && (o.nnodes > 1 || !f.master_addr.empty() || o.master_port != 0 || o.node_rank != 0))
    throw UsageError("--standalone is one node with its own rendezvous; it takes no --nnodes above 1, "
                     "--node-rank, --master-addr or --master-port");
  o.master_addr = f.master_addr.empty() ? "127.0.0.1" : f.master_addr;
  if (o.node_rank >= o.nnodes)
    throw UsageError("--node-rank " + std::to_string(o.node_rank) + " is not below --nnodes " +
                     std::to_string(o.nnodes));
  if (o.nnodes > 1 && o.master_port == 0)
    throw UsageError("with several nodes, give every node the same --master-port");
  if (f.recipe.empty()) throw UsageError("a recipe is required");
  recipe_first(f.recipe, f.pairs, "launch");
  key_values(f.pairs, "recipe");  // refused here once, not by every rank
  wick::dist_timeout();           // so is a bad WICK_DIST_TIMEOUT
  o.run_args.push_back(f.recipe);
  o.run_args.insert(o.run_args.end(), f.pairs.begin(), f.pairs.end());
  return wick::launch(o);
}

// ---- the parser ----

int usage_error(const std::string& msg, const CLI::App* app) {
  const bool sub = app && app->get_parent();
  std::fprintf(stderr, "wick: error: %s\n%s\nRun 'wick %s--help' for more.\n", msg.c_str(), usage_line(app).c_str(),
               sub ? (app->get_name() + " ").c_str() : "");
  return 2;
}

// CLI11's message, in wick's words where CLI11's would puzzle.
std::string message_of(const CLI::ParseError& e) {
  const std::string m = e.what();
  // "--device-memory: 1 required TEXT missing": a flag given last, without its value
  if (e.get_name() == "ArgumentMismatch" && m.find(" missing") != std::string::npos)
    return m.substr(0, m.find(':')) + " needs a value";
  // "json was given a disallowed flag override": --json=VALUE (CLI11 names it without dashes)
  if (const auto at = m.find(" was given a disallowed flag override"); at != std::string::npos)
    return (m[0] == '-' ? "" : "--") + m.substr(0, at) + " is a flag and takes no value";
  return m;
}

// The command the parse reached (the root app when none).
const CLI::App* reached(const CLI::App& app) {
  const auto subs = app.get_subcommands();
  return subs.empty() ? &app : subs.front();
}

int run_cli(std::vector<std::string> args) {
  // aliases kept from before: `wick help [COMMAND]`, `wick --version`
  if (!args.empty() && args[0] == "help") {
    args.erase(args.begin());
    args.push_back("--help");
  }
  if (!args.empty() && args[0] == "--version") args[0] = "version";

  CLI::App app("wick: a C++ training host for Lua recipes", "wick");
  app.formatter(std::make_shared<HelpFormatter>());
  app.set_help_flag("-h,--help", "show this help and exit");
  app.option_defaults()->disable_flag_override();  // --json=abc is an error, not a conversion puzzle
  // exactly one command: afterwards a word such as `plan` is an argument, never a second command
  app.require_subcommand(1, 1);

  std::map<const CLI::App*, std::function<int()>> actions;
  auto command = [&](const char* name, std::function<int()> action) {
    const Command* c = find_command(name);
    CLI::App* sub = app.add_subcommand(name, c->summary);
    sub->allow_extras();  // refuse_extras names what did not fit
    actions[sub] = std::move(action);
    return sub;
  };
  auto flag_value = [](CLI::App* sub, const std::string& names, std::string& into, const std::string& text,
                       const std::string& doc) { sub->add_option(names, into, doc)->option_text(text); };

  std::string recipe, dir, out, device_memory;
  std::vector<std::string> pairs;
  bool json = false;
  ClipFlags clips;
  LaunchFlags launch;

  auto* run = command("run", [&] { return cmd_run(recipe, pairs); });
  run->add_option("recipe", recipe, "the recipe file (.lua)")->option_text("RECIPE");
  run->add_option("pairs", pairs, "wick.args, and overrides of wick.train options")->option_text("key=value");

  auto* lau = command("launch", [&] { return cmd_launch(launch); });
  // torchrun's spellings too: --nproc_per_node, --node_rank, --master_addr, --master_port, --standalone
  flag_value(lau, "--nproc-per-node,--nproc_per_node", launch.nproc_per_node, "N", "ranks on this node (required)");
  flag_value(lau, "--nnodes", launch.nnodes, "M", "nodes (default 1)");
  flag_value(lau, "--node-rank,--node_rank", launch.node_rank, "R", "this node's index, from 0 (default 0)");
  flag_value(lau, "--master-addr,--master_addr", launch.master_addr, "A", "address of node 0 (default 127.0.0.1)");
  flag_value(lau, "--master-port,--master_port", launch.master_port, "P", "port on node 0 (default: a free one; needed with several nodes)");
  lau->add_flag("--standalone", launch.standalone, "one node, a free local port (torchrun's --standalone; the default)");
  lau->add_option("recipe", launch.recipe, "the recipe file (.lua)")->option_text("RECIPE");
  lau->add_option("pairs", launch.pairs, "passed to every rank's `wick run`")->option_text("key=value");

  auto* plugins = command("plugins", [&] { return cmd_plugins(json); });
  plugins->add_flag("--json", json, "one JSON array: name, file, kind, summary, options (or error)");

  auto* gen = command("generate", [&] { return cmd_generate(dir, pairs); });
  gen->add_option("dir", dir, "a decoder_lm folder (config.json, weights, tokenizer)")->option_text("MODEL_DIR");
  gen->add_option("pairs", pairs, "prompt=TEXT max_new_tokens=N temperature=T top_k=K top_p=P seed=S")
      ->option_text("key=value");

  std::string plan_ranks;
  auto* plan = command("plan", [&] { return cmd_plan(recipe, device_memory, plan_ranks, pairs); });
  plan->add_option("recipe", recipe, "the recipe file (.lua)")->option_text("RECIPE");
  plan->add_option("pairs", pairs, "wick.args, and overrides of wick.train options")->option_text("key=value");
  flag_value(plan, "--device-memory", device_memory, "SIZE",
             "the memory to fit (8GiB, 12GB, bytes; default: the device's own)");
  flag_value(plan, "--ranks", plan_ranks, "N",
             "measure on N local ranks (as wick launch starts them), with each shard setting's per-rank figures");

  auto* rep = command("report", [&] { return cmd_report(dir, out); });
  rep->add_option("dir", dir, "a run folder (with metrics.jsonl)")->option_text("RUN_DIR");
  flag_value(rep, "-o,--output", out, "FILE", "where to write (default RUN_DIR/report.html)");

  auto* runs = command("runs", [&] { return cmd_runs(dir.empty() ? "runs" : dir, json); });
  runs->add_option("dir", dir, "where to look, three levels deep (default runs)")->option_text("DIR");
  runs->add_flag("--json", json, "the same rows as JSON, with every number");

  auto* mc = command("make-clips", [&] { return cmd_make_clips(clips); });
  mc->add_option("dir", clips.dir, "the folder to write (created if missing)")->option_text("DIR");
  const wick::ClipSetOptions d;  // the defaults the help names
  auto num = [](double x) { return wick::Value(x).repr(); };
  flag_value(mc, "--classes", clips.classes, "N", "shape classes, 1 to 6 (default " + std::to_string(d.classes) + ")");
  flag_value(mc, "--per-class", clips.per_class, "N", "clips per class (default " + std::to_string(d.per_class) + ")");
  flag_value(mc, "--size", clips.size, "WxH",
             "frame size, even numbers (default " + std::to_string(d.width) + "x" + std::to_string(d.height) + ")");
  flag_value(mc, "--seconds", clips.seconds, "S", "length of each clip (default " + num(d.seconds) + ")");
  flag_value(mc, "--fps", clips.fps, "F", "frames per second (default " + std::to_string(d.fps) + ")");
  flag_value(mc, "--seed", clips.seed, "S", "seed of the shapes' looks and motion (default " + std::to_string(d.seed) + ")");
  mc->add_flag("--no-extras", clips.no_extras, "skip the special test clips under DIR/extras");
  mc->add_flag("--no-images", clips.no_images, "skip the still images under DIR/images");

  std::string name;
  auto* desc = command("describe", [&] {
    if (name.empty()) throw UsageError("'wick describe' needs one plugin name");
    return cmd_describe(name);
  });
  desc->add_option("name", name, "a plugin's name, or 'train' for wick.train's options")->option_text("NAME");

  command("version", [&] { return cmd_version(); });

  if (args.empty()) return usage_error("no command given", &app);
  if (args[0] != "-h" && args[0] != "--help") {
    if (args[0].size() > 1 && args[0][0] == '-') return usage_error("unknown option '" + args[0] + "'", &app);
    if (!find_command(args[0])) return usage_error("unknown command '" + args[0] + "'", &app);
  }

  const CLI::App* sub = nullptr;
  try {
    std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes them last first
    app.parse(reversed);
    sub = reached(app);
    refuse_extras(sub);
  } catch (const CLI::CallForHelp&) {
    std::cout << reached(app)->help();
    return 0;
  } catch (const CLI::ParseError& e) {
    return usage_error(message_of(e), reached(app));
  } catch (const UsageError& e) {
    return usage_error(e.what(), reached(app));
  }

  try {
    if (const char* lim = std::getenv("WICK_CPU_MEMORY_LIMIT"); lim && *lim)
      wick::set_cpu_memory_limit(wick::parse_bytes(lim, "WICK_CPU_MEMORY_LIMIT"));
    if (const char* t = std::getenv("WICK_MEMORY_PEAK_TRACE"); t && *t && std::string(t) != "0" && std::string(t) != "1")
      throw wick::Error(std::string("WICK_MEMORY_PEAK_TRACE: expected 1 (print where the peak's tensors were "
                                    "allocated) or 0, got '") + t + "'");
    return actions.at(sub)();
  } catch (const UsageError& e) {
    return usage_error(e.what(), sub);
  }
}

}  // namespace

int main(int argc, char** argv) {
  wick::quiet_torch_logs();
  int rc = 1;
  try {
    rc = run_cli(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "wick: error: %s\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "wick: error: %s\n", e.what());
  }
  // What the command made lived in run_cli and is closed by now: the recipe's
  // Lua state (its files with it), run folders, checkpoints, the ranks' end
  // said (announce_end). What exit() would add is the libraries' teardown:
  // LibTorch unregistering its thousands of operators, CUDA's, the plugins'
  // unloading, about 0.2 s of a 0.5 s `wick version` on a 2-core machine,
  // paid by every command (a test suite runs thousands). The streams are
  // flushed, and the process ends without it, unless a profiler or another
  // tool attached to it collects its data at exit.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  if (wick::exit_collectors_attached()) return rc;
  std::_Exit(rc);
}
