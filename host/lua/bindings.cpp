// Engine objects as Lua userdata (wick.Model, wick.Data, wick.Optim,
// wick.Loader, wick.Window, wick.Trainer) and functions of `wick.core`.
// Every function runs inside guarded(): a C++ exception becomes a Lua error
// prefixed with the recipe's file and line.

#include <lua.hpp>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>

#include "lua/runtime.hpp"
#include "wick/safetensors.hpp"
#include "dist/group.hpp"
#include "observe/events.hpp"
#include "plugin/registry.hpp"
#include "train/loader.hpp"
#include "train/run.hpp"
#include "train/run_options.hpp"
#include "train/trainer.hpp"
#include "util/memory.hpp"
#include "util/system.hpp"

namespace fs = std::filesystem;

namespace wick {
namespace {

constexpr const char* kModelMt = "wick.Model";
constexpr const char* kDataMt = "wick.Data";
constexpr const char* kOptimMt = "wick.Optim";
constexpr const char* kLoaderMt = "wick.Loader";
constexpr const char* kWindowMt = "wick.Window";
constexpr const char* kTrainerMt = "wick.Trainer";
constexpr const char* kEventsMt = "wick.EventWriter";
constexpr const char* kPackageDirKey = "wick.package_dir";

// ---- locations and errors ----

// "recipe.lua:12: " for the innermost Lua frame outside the wick package, so
// an error inside wick.train points at the recipe line that called it.
std::string user_location(lua_State* L) {
  lua_getfield(L, LUA_REGISTRYINDEX, kPackageDirKey);
  std::string pkg = lua_isstring(L, -1) ? lua_tostring(L, -1) : "";
  lua_pop(L, 1);
  lua_Debug ar;
  for (int level = 1; lua_getstack(L, level, &ar); ++level) {
    if (!lua_getinfo(L, "Sl", &ar) || ar.currentline <= 0 || ar.source[0] != '@') continue;
    std::string src = ar.source + 1;
    std::error_code ec;
    const auto abs = fs::weakly_canonical(src, ec).string();
    if (!pkg.empty() && abs.rfind(pkg, 0) == 0) continue;
    return src + ":" + std::to_string(ar.currentline) + ": ";
  }
  return "";
}

template <lua_CFunction F>
int guarded(lua_State* L) {
  std::string msg;
  try {
    return F(L);
  } catch (const c10::Error& e) {  // LibTorch's errors: the message, not its C++ frames
    msg = e.what_without_backtrace();
  } catch (const std::exception& e) {  // never catch(...): LuaJIT's own errors unwind through here
    msg = e.what();
  }
  msg = user_location(L) + msg;
  lua_pushlstring(L, msg.data(), msg.size());
  return lua_error(L);
}

const char* type_of(lua_State* L, int i) {
  return lua_isnone(L, i) ? "no value" : luaL_typename(L, i);
}

Error bad_argument(lua_State* L, int i, const char* fn, const std::string& expected) {
  return Error("bad argument #" + std::to_string(i) + " to '" + fn + "' (" + expected + " expected, got " +
               type_of(L, i) + ")");
}

std::string check_string(lua_State* L, int i, const char* fn) {
  if (lua_type(L, i) != LUA_TSTRING) throw bad_argument(L, i, fn, "string");
  return lua_tostring(L, i);
}

void check_table(lua_State* L, int i, const char* fn) {
  if (!lua_istable(L, i)) throw bad_argument(L, i, fn, "table");
}

// ---- values ----

Value to_value(lua_State* L, int i, const std::string& where);

bool is_array(lua_State* L, int i, std::size_t* n) {
  *n = lua_objlen(L, i);
  std::size_t count = 0;
  lua_pushnil(L);
  while (lua_next(L, i)) {
    ++count;
    lua_pop(L, 1);
  }
  return count == *n;
}

Value to_value(lua_State* L, int i, const std::string& where) {
  i = i < 0 ? lua_gettop(L) + i + 1 : i;
  switch (lua_type(L, i)) {
    case LUA_TNIL: return Value();
    case LUA_TBOOLEAN: return Value(static_cast<bool>(lua_toboolean(L, i)));
    case LUA_TNUMBER: {
      const double d = lua_tonumber(L, i);
      if (std::floor(d) == d && std::fabs(d) < 9.007199254740992e15) return Value(static_cast<std::int64_t>(d));
      return Value(d);
    }
    case LUA_TSTRING: return Value(std::string(lua_tostring(L, i)));
    case LUA_TTABLE: {
      std::size_t n = 0;
      if (!is_array(L, i, &n)) throw Error(where + ": expected a list, got a table with named keys");
      List l;
      for (std::size_t k = 1; k <= n; ++k) {
        lua_rawgeti(L, i, static_cast<int>(k));
        l.push_back(to_value(L, -1, where));
        lua_pop(L, 1);
      }
      return Value(std::move(l));
    }
    default:
      throw Error(where + ": a " + std::string(luaL_typename(L, i)) + " cannot be an option value");
  }
}

std::map<std::string, Value> to_options(lua_State* L, int i, const std::string& plugin) {
  std::map<std::string, Value> out;
  if (lua_isnoneornil(L, i)) return out;
  i = i < 0 ? lua_gettop(L) + i + 1 : i;
  lua_pushnil(L);
  while (lua_next(L, i)) {
    if (lua_type(L, -2) != LUA_TSTRING) throw Error(plugin + ": option names must be strings");
    std::string key = lua_tostring(L, -2);
    out[key] = to_value(L, -1, plugin + ": option '" + key + "'");
    lua_pop(L, 1);
  }
  return out;
}

void push_value(lua_State* L, const Value& v) {
  switch (v.v.index()) {
    case 0: lua_pushnil(L); break;
    case 1: lua_pushboolean(L, v.as_bool()); break;
    case 2: lua_pushnumber(L, static_cast<lua_Number>(v.as_int())); break;
    case 3: lua_pushnumber(L, v.as_double()); break;
    case 4: lua_pushstring(L, v.as_string().c_str()); break;
    default: {
      const auto& l = v.as_list();
      lua_createtable(L, static_cast<int>(l.size()), 0);
      for (std::size_t k = 0; k < l.size(); ++k) {
        push_value(L, l[k]);
        lua_rawseti(L, -2, static_cast<int>(k + 1));
      }
    }
  }
}

nlohmann::json to_json(lua_State* L, int i, int depth = 0) {
  i = i < 0 ? lua_gettop(L) + i + 1 : i;
  if (depth > 32) throw Error("table nested too deeply to write as JSON");
  switch (lua_type(L, i)) {
    case LUA_TNIL: return nullptr;
    case LUA_TBOOLEAN: return static_cast<bool>(lua_toboolean(L, i));
    case LUA_TNUMBER: {
      const double d = lua_tonumber(L, i);
      if (std::floor(d) == d && std::fabs(d) < 9.007199254740992e15) return static_cast<std::int64_t>(d);
      if (!std::isfinite(d)) return nullptr;
      return d;
    }
    case LUA_TSTRING: return std::string(lua_tostring(L, i));
    case LUA_TTABLE: {
      std::size_t n = 0;
      if (is_array(L, i, &n) && n > 0) {
        auto arr = nlohmann::json::array();
        for (std::size_t k = 1; k <= n; ++k) {
          lua_rawgeti(L, i, static_cast<int>(k));
          arr.push_back(to_json(L, -1, depth + 1));
          lua_pop(L, 1);
        }
        return arr;
      }
      auto obj = nlohmann::json::object();
      lua_pushnil(L);
      while (lua_next(L, i)) {
        lua_pushvalue(L, -2);
        std::string key = lua_tostring(L, -1);
        lua_pop(L, 1);
        if (lua_type(L, -1) != LUA_TFUNCTION && lua_type(L, -1) != LUA_TUSERDATA)
          obj[key] = to_json(L, -1, depth + 1);
        lua_pop(L, 1);
      }
      return obj;
    }
    default: return std::string(luaL_typename(L, i));
  }
}

void push_json(lua_State* L, const nlohmann::json& j) {
  if (j.is_null()) lua_pushnil(L);
  else if (j.is_boolean()) lua_pushboolean(L, j.get<bool>());
  else if (j.is_number()) lua_pushnumber(L, j.get<double>());
  else if (j.is_string()) lua_pushstring(L, j.get<std::string>().c_str());
  else if (j.is_array()) {
    lua_createtable(L, static_cast<int>(j.size()), 0);
    int k = 1;
    for (const auto& x : j) {
      push_json(L, x);
      lua_rawseti(L, -2, k++);
    }
  } else {
    lua_createtable(L, 0, static_cast<int>(j.size()));
    for (auto it = j.begin(); it != j.end(); ++it) {
      push_json(L, it.value());
      lua_setfield(L, -2, it.key().c_str());
    }
  }
}

void set_number(lua_State* L, const char* k, double v) {
  lua_pushnumber(L, v);
  lua_setfield(L, -2, k);
}

// ---- userdata ----

template <class T>
struct Box {
  std::shared_ptr<T> ptr;
};

template <class T>
void push_box(lua_State* L, std::shared_ptr<T> p, const char* mt) {
  void* mem = lua_newuserdata(L, sizeof(Box<T>));
  new (mem) Box<T>{std::move(p)};
  luaL_getmetatable(L, mt);
  lua_setmetatable(L, -2);
}

template <class T>
Box<T>* test_box(lua_State* L, int i, const char* mt) {
  void* p = lua_touserdata(L, i);
  if (!p || !lua_getmetatable(L, i)) return nullptr;
  luaL_getmetatable(L, mt);
  const bool ok = lua_rawequal(L, -1, -2);
  lua_pop(L, 2);
  return ok ? static_cast<Box<T>*>(p) : nullptr;
}

template <class T>
std::shared_ptr<T>& check_box(lua_State* L, int i, const char* mt, const char* fn) {
  auto* b = test_box<T>(L, i, mt);
  if (!b || !b->ptr) throw bad_argument(L, i, fn, mt);
  return b->ptr;
}

template <class T>
int box_gc(lua_State* L) {
  auto* b = static_cast<Box<T>*>(lua_touserdata(L, 1));
  if (b) b->~Box<T>();
  return 0;
}

std::shared_ptr<Model> check_model(lua_State* L, int i, const char* fn) {
  return std::static_pointer_cast<Model>(check_box<Object>(L, i, kModelMt, fn));
}
std::shared_ptr<Dataset> check_data(lua_State* L, int i, const char* fn) {
  return std::static_pointer_cast<Dataset>(check_box<Object>(L, i, kDataMt, fn));
}

// Methods first, then the object's attributes (data.num_classes).
int object_index(lua_State* L) {
  auto* b = static_cast<Box<Object>*>(lua_touserdata(L, 1));
  lua_getmetatable(L, 1);
  lua_getfield(L, -1, "methods");
  lua_pushvalue(L, 2);
  lua_rawget(L, -2);
  if (!lua_isnil(L, -1)) return 1;
  lua_pop(L, 3);
  if (lua_type(L, 2) != LUA_TSTRING || !b || !b->ptr) return 0;
  const std::string key = lua_tostring(L, 2);
  const auto attrs = b->ptr->attributes();
  auto it = attrs.find(key);
  if (it == attrs.end()) {
    lua_pushnil(L);
    return 1;
  }
  push_value(L, it->second);
  return 1;
}

// ---- wick.core functions ----

template <PluginKind K>
int make_plugin(lua_State* L) {
  const char* fn = K == PluginKind::Model ? "model" : K == PluginKind::Data ? "data" : "optim";
  const std::string name = check_string(L, 1, fn);
  if (!lua_isnoneornil(L, 2)) check_table(L, 2, fn);
  auto opts = to_options(L, 2, std::string(fn) + " '" + name + "'");
  auto obj = registry().create(name, K, opts);
  const char* mt = K == PluginKind::Model ? kModelMt : K == PluginKind::Data ? kDataMt : kOptimMt;
  push_box<Object>(L, obj, mt);
  return 1;
}

int model_save(lua_State* L) {
  auto m = check_model(L, 1, "save");
  save_model(*m, check_string(L, 2, "save"));
  return 0;
}

int model_load(lua_State* L) {
  auto m = check_model(L, 1, "load");
  load_model(*m, check_string(L, 2, "load"));
  return 0;
}

int model_parameters(lua_State* L) {
  auto m = check_model(L, 1, "parameters");
  std::int64_t total = 0, trainable = 0;
  for (const auto& p : m->parameters()) {
    total += p.numel();
    if (p.requires_grad()) trainable += p.numel();
  }
  lua_pushnumber(L, static_cast<double>(total));
  lua_pushnumber(L, static_cast<double>(trainable));
  return 2;
}

int model_blocks(lua_State* L) {
  auto m = check_model(L, 1, "blocks");
  push_value(L, [&] {
    List l;
    for (auto& s : m->blocks()) l.push_back(Value(s));
    return Value(l);
  }());
  return 1;
}

int model_item_name(lua_State* L) {
  auto m = check_model(L, 1, "item_name");
  lua_pushstring(L, m->item_name().c_str());
  return 1;
}

// model:window_coupled(): whether the model's loss couples the samples of a
// window (contrastive), so the trainer computes it over the whole window.
int model_window_coupled(lua_State* L) {
  auto m = check_model(L, 1, "window_coupled");
  lua_pushboolean(L, m->window_coupled());
  return 1;
}

// Reads an optional field of the table at index t.
template <class T>
T field(lua_State* L, int t, const char* key, T def) {
  lua_getfield(L, t, key);
  T out = def;
  if (!lua_isnil(L, -1)) {
    if constexpr (std::is_same_v<T, bool>) {
      if (!lua_isboolean(L, -1)) throw Error(std::string("'") + key + "' must be a boolean, got " + luaL_typename(L, -1));
      out = lua_toboolean(L, -1);
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (lua_type(L, -1) != LUA_TSTRING) throw Error(std::string("'") + key + "' must be a string, got " + luaL_typename(L, -1));
      out = lua_tostring(L, -1);
    } else {
      if (lua_type(L, -1) != LUA_TNUMBER) throw Error(std::string("'") + key + "' must be a number, got " + luaL_typename(L, -1));
      out = static_cast<T>(lua_tonumber(L, -1));
    }
  }
  lua_pop(L, 1);
  return out;
}

std::vector<std::int64_t> check_ids(lua_State* L, int i, const char* fn) {
  check_table(L, i, fn);
  std::vector<std::int64_t> ids;
  const auto n = lua_objlen(L, i);
  for (std::size_t k = 1; k <= n; ++k) {
    lua_rawgeti(L, i, static_cast<int>(k));
    if (lua_type(L, -1) != LUA_TNUMBER) throw Error(std::string(fn) + ": token ids must be numbers");
    ids.push_back(static_cast<std::int64_t>(lua_tonumber(L, -1)));
    lua_pop(L, 1);
  }
  return ids;
}

void push_ids(lua_State* L, const std::vector<std::int64_t>& ids) {
  lua_createtable(L, static_cast<int>(ids.size()), 0);
  for (std::size_t k = 0; k < ids.size(); ++k) {
    lua_pushnumber(L, static_cast<double>(ids[k]));
    lua_rawseti(L, -2, static_cast<int>(k + 1));
  }
}

// model:generate(prompt, {max_new_tokens, temperature, top_k, top_p, eos_id, seed}) -> ids
// prompt: token ids {1, 2, ...}, or a batch whose first sample is the prompt
// (Model::generate_from): a window (data:window(i, 1)) or a safetensors file.
int model_generate(lua_State* L) {
  auto m = check_model(L, 1, "generate");
  std::optional<Batch> batch;
  std::vector<std::int64_t> prompt;
  if (auto* w = test_box<std::vector<Batch>>(L, 2, kWindowMt)) {
    if (!w->ptr || w->ptr->empty()) throw Error("generate: the window given as prompt is empty (freed?)");
    batch = w->ptr->front();
  } else if (lua_type(L, 2) == LUA_TSTRING) {
    auto f = read_safetensors(lua_tostring(L, 2));
    batch = Batch(f.tensors.begin(), f.tensors.end());
  } else {
    prompt = check_ids(L, 2, "generate");
  }
  GenerateOptions g;
  if (!lua_isnoneornil(L, 3)) {
    check_table(L, 3, "generate");
    g.max_new_tokens = field<std::int64_t>(L, 3, "max_new_tokens", g.max_new_tokens);
    g.temperature = field<double>(L, 3, "temperature", g.temperature);
    g.top_k = field<std::int64_t>(L, 3, "top_k", g.top_k);
    g.top_p = field<double>(L, 3, "top_p", g.top_p);
    g.eos_id = field<std::int64_t>(L, 3, "eos_id", g.eos_id);
    g.seed = field<std::uint64_t>(L, 3, "seed", g.seed);
  }
  if (g.max_new_tokens < 0 || g.temperature < 0 || g.top_k < 0 || g.top_p <= 0 || g.top_p > 1)
    throw Error("generate: expected max_new_tokens >= 0, temperature >= 0, top_k >= 0, top_p in (0, 1]");
  push_ids(L, batch ? m->generate_from(*batch, g) : m->generate(prompt, g));
  return 1;
}

int data_encode(lua_State* L) {
  auto d = check_data(L, 1, "encode");
  push_ids(L, d->encode(check_string(L, 2, "encode")));
  return 1;
}

int data_decode(lua_State* L) {
  auto d = check_data(L, 1, "decode");
  const std::string s = d->decode(check_ids(L, 2, "decode"));
  lua_pushlstring(L, s.data(), s.size());
  return 1;
}

int data_size(lua_State* L) {
  auto d = check_data(L, 1, "size");
  lua_pushnumber(L, static_cast<double>(d->size()));
  return 1;
}

// data:window(first, count[, micro]): samples first .. first+count-1 (0-based)
// as a window of micro-batches of `micro` (default: one micro-batch).
int data_window(lua_State* L) {
  auto d = check_data(L, 1, "window");
  const auto first = static_cast<std::int64_t>(luaL_checknumber(L, 2));
  const auto count = static_cast<std::int64_t>(luaL_checknumber(L, 3));
  const auto micro = static_cast<std::int64_t>(luaL_optnumber(L, 4, static_cast<double>(count)));
  if (first < 0 || count < 1 || micro < 1 || first + count > d->size())
    throw Error("window: samples " + std::to_string(first) + " .. " + std::to_string(first + count - 1) +
                " with micro-batches of " + std::to_string(micro) + " do not fit data of " + std::to_string(d->size()) +
                " samples");
  auto w = std::make_shared<std::vector<Batch>>();
  for (std::int64_t i = first; i < first + count; i += micro) {
    std::vector<std::int64_t> idx;
    for (std::int64_t j = i; j < std::min(i + micro, first + count); ++j) idx.push_back(j);
    w->push_back(d->get_batch(idx));
  }
  push_box<std::vector<Batch>>(L, std::move(w), kWindowMt);
  return 1;
}

int loader_buffered_bytes(lua_State* L) {
  auto& l = check_box<Loader>(L, 1, kLoaderMt, "buffered_bytes");
  lua_pushnumber(L, static_cast<double>(l->buffered_bytes()));
  return 1;
}

// core.set_memory_limit(bytes | "8GiB" | 0): caps CPU tensor memory (see util/memory.hpp)
int core_set_memory_limit(lua_State* L) {
  std::int64_t bytes = 0;
  if (lua_type(L, 1) == LUA_TNUMBER) bytes = static_cast<std::int64_t>(lua_tonumber(L, 1));
  else bytes = parse_bytes(check_string(L, 1, "set_memory_limit"), "set_memory_limit");
  set_cpu_memory_limit(bytes);
  return 0;
}

int core_reset_peak(lua_State* L) {
  (void)L;
  reset_cpu_tensor_peak();
  reset_cuda_peak();
  return 0;
}

// core.device_memory(device): the bytes a run may use on it: a GPU's total
// memory, or on the CPU the tensor cap (0: none)
int core_device_memory(lua_State* L) {
  const std::string dev = check_string(L, 1, "device_memory");
  if (dev.rfind("cuda", 0) == 0) {
    const at::Device d(dev);
    lua_pushnumber(L, static_cast<double>(cuda_total_memory(d.has_index() ? d.index() : 0)));
  } else {
    lua_pushnumber(L, static_cast<double>(cpu_tensor_memory().limit));
  }
  return 1;
}

int core_parse_bytes(lua_State* L) {
  lua_pushnumber(L, static_cast<double>(parse_bytes(check_string(L, 1, "parse_bytes"), "size")));
  return 1;
}

int optim_kind(lua_State* L) {
  auto& o = check_box<Object>(L, 1, kOptimMt, "kind");
  const auto k = o->object_kind();
  lua_pushstring(L, k == ObjectKind::Schedule ? "schedule" : k == ObjectKind::Transform ? "transform" : "optimizer");
  return 1;
}

Transform& check_transform(lua_State* L, const char* fn) {
  auto& o = check_box<Object>(L, 1, kOptimMt, fn);
  if (o->object_kind() != ObjectKind::Transform)
    throw Error(std::string(fn) + ": this optim object is not a transform (lora, ...)");
  return static_cast<Transform&>(*o);
}

// transform:apply(model), :save(model, dir), :load(model, dir), :merge(model)
int transform_apply(lua_State* L) {
  auto& t = check_transform(L, "apply");
  t.apply(*check_model(L, 2, "apply"));
  return 0;
}
int transform_save(lua_State* L) {
  auto& t = check_transform(L, "save");
  t.save(*check_model(L, 2, "save"), check_string(L, 3, "save"));
  return 0;
}
int transform_load(lua_State* L) {
  auto& t = check_transform(L, "load");
  t.load(*check_model(L, 2, "load"), check_string(L, 3, "load"));
  return 0;
}
int transform_merge(lua_State* L) {
  auto& t = check_transform(L, "merge");
  t.merge(*check_model(L, 2, "merge"));
  return 0;
}

int make_loader(lua_State* L) {
  auto d = check_data(L, 1, "loader");
  check_table(L, 2, "loader");
  LoaderConfig c;
  c.micro_batch = field<std::int64_t>(L, 2, "micro_batch", 1);
  c.accumulate = field<std::int64_t>(L, 2, "accumulate", 1);
  c.shuffle = field<bool>(L, 2, "shuffle", true);
  c.seed = field<std::uint64_t>(L, 2, "seed", 0);
  c.drop_last = field<bool>(L, 2, "drop_last", false);
  c.workers = field<int>(L, 2, "workers", 0);
  c.prefetch = field<int>(L, 2, "prefetch", 2);
  const DistEnv env = dist_env();  // this process's shard unless told otherwise
  c.rank = field<int>(L, 2, "rank", env.rank);
  c.world_size = field<int>(L, 2, "world_size", env.world_size);
  c.pin_memory = field<bool>(L, 2, "pin_memory", false);
  push_box<Loader>(L, std::make_shared<Loader>(d, c), kLoaderMt);
  return 1;
}

int loader_windows_per_epoch(lua_State* L) {
  auto& l = check_box<Loader>(L, 1, kLoaderMt, "windows_per_epoch");
  lua_pushnumber(L, static_cast<double>(l->windows_per_epoch()));
  return 1;
}

int loader_start_epoch(lua_State* L) {
  auto& l = check_box<Loader>(L, 1, kLoaderMt, "start_epoch");
  l->start_epoch(static_cast<std::int64_t>(luaL_checknumber(L, 2)), static_cast<std::int64_t>(luaL_optnumber(L, 3, 0)));
  return 0;
}

int loader_next(lua_State* L) {
  auto& l = check_box<Loader>(L, 1, kLoaderMt, "next");
  auto w = l->next_window();
  if (!w) {
    lua_pushnil(L);
    return 1;
  }
  push_box<std::vector<Batch>>(L, std::make_shared<std::vector<Batch>>(std::move(*w)), kWindowMt);
  return 1;
}

int loader_position(lua_State* L) {
  auto& l = check_box<Loader>(L, 1, kLoaderMt, "position");
  lua_pushnumber(L, static_cast<double>(l->epoch()));
  lua_pushnumber(L, static_cast<double>(l->window()));
  return 2;
}

// window:free(): drops the window's tensors now rather than when Lua's
// collector gets to the (small-looking) userdata; wick.train frees each
// window after its step, so host memory stays bounded.
int window_free(lua_State* L) {
  auto& w = check_box<std::vector<Batch>>(L, 1, kWindowMt, "free");
  w->clear();
  w->shrink_to_fit();
  return 0;
}

// window:save(path): its micro-batches as safetensors "<k>.<name>" (k from 0),
// to see what the loader gives
int window_save(lua_State* L) {
  auto& w = check_box<std::vector<Batch>>(L, 1, kWindowMt, "save");
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (std::size_t k = 0; k < w->size(); ++k)
    for (const auto& [name, t] : (*w)[k]) out.emplace_back(std::to_string(k) + "." + name, t.cpu().contiguous());
  write_safetensors(check_string(L, 2, "save"), out);
  return 0;
}

int window_len(lua_State* L) {
  auto& w = check_box<std::vector<Batch>>(L, 1, kWindowMt, "__len");
  lua_pushnumber(L, static_cast<double>(w->size()));
  return 1;
}

// A wick.train / wick.trainer table: objects (model, data, optim, schedule,
// eval_data) apart, every other key a plain option value. A loss_scale table
// {init, growth, backoff, interval} becomes the loss_scale_* options.
RunObjects collect_run_table(lua_State* L, int t, const std::string& label, std::map<std::string, Value>& options) {
  RunObjects obj;
  t = t < 0 ? lua_gettop(L) + t + 1 : t;
  lua_pushnil(L);
  while (lua_next(L, t)) {
    if (lua_type(L, -2) != LUA_TSTRING) throw Error(label + ": option names must be strings");
    const std::string key = lua_tostring(L, -2);
    const int v = lua_gettop(L);
    auto object = [&](const char* mt) -> std::shared_ptr<Object> {
      auto* b = test_box<Object>(L, v, mt);
      if (!b || !b->ptr)
        throw Error(label + ": option '" + key + "': expected a wick object (" + mt + "), got " + luaL_typename(L, v));
      return b->ptr;
    };
    if (key == "model") obj.model = std::static_pointer_cast<Model>(object(kModelMt));
    else if (key == "data") obj.data = std::static_pointer_cast<Dataset>(object(kDataMt));
    else if (key == "eval_data") obj.eval_data = std::static_pointer_cast<Dataset>(object(kDataMt));
    else if (key == "optim") obj.optim = object(kOptimMt);
    else if (key == "schedule" && lua_type(L, v) != LUA_TSTRING) obj.schedule = object(kOptimMt);
    else if (key == "loss_scale" && lua_istable(L, v)) {
      lua_pushnil(L);
      while (lua_next(L, v)) {
        const std::string k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "?";
        if (k != "init" && k != "growth" && k != "backoff" && k != "interval")
          throw Error(label + ": loss_scale: unknown key '" + k + "' (expected init, growth, backoff, interval)");
        options["loss_scale_" + k] = to_value(L, -1, label + ": option 'loss_scale': '" + k + "'");
        lua_pop(L, 1);
      }
    } else {
      options[key] = to_value(L, v, label + ": option '" + key + "'");
    }
    lua_pop(L, 1);
  }
  return obj;
}

// wick.trainer{model, optim, schedule, ...}: the options of wick.train that a
// trainer takes (wick describe train marks them), checked by the same schema.
int make_trainer(lua_State* L) {
  check_table(L, 1, "trainer");
  std::map<std::string, Value> given;
  RunObjects obj = collect_run_table(L, 1, "wick.trainer", given);
  std::vector<std::string> objects;
  if (obj.model) objects.push_back("model");
  if (obj.optim) objects.push_back("optim");
  if (obj.schedule) objects.push_back("schedule");
  if (obj.data) objects.push_back("data");
  if (obj.eval_data) objects.push_back("eval_data");
  const Options o = validate_run_options("wick.trainer", given, objects, /*trainer_only=*/true);
  if (!obj.model) throw Error("wick.trainer: option 'model' is required");
  if (!obj.optim) throw Error("wick.trainer: option 'optim' is required");
  if (obj.optim->object_kind() != ObjectKind::Optimizer)
    throw Error(std::string("wick.trainer: option 'optim': expected an optimizer (sgd, adamw, ...), got a ") +
                (obj.optim->object_kind() == ObjectKind::Schedule ? "schedule" : "transform"));
  std::shared_ptr<Schedule> schedule;
  if (obj.schedule) {
    if (obj.schedule->object_kind() != ObjectKind::Schedule)
      throw Error("wick.trainer: option 'schedule': expected a schedule (wick.schedule), got an optimizer");
    schedule = std::static_pointer_cast<Schedule>(obj.schedule);
  } else if (auto it = given.find("schedule"); it != given.end() && it->second.is_string()) {
    schedule = std::static_pointer_cast<Schedule>(
        registry().create("schedule", PluginKind::Optim, {{"type", it->second}}));
  }
  TrainerConfig c = trainer_config(o);
  if (c.device == "auto") c.device = cuda_available() ? "cuda" : "cpu";
  c.group = Group::world(c.device);
  push_box<Trainer>(L, std::make_shared<Trainer>(obj.model, std::static_pointer_cast<Optimizer>(obj.optim), schedule, c),
                    kTrainerMt);
  return 1;
}

// The command line's key=value pairs as given (strings), for overrides that
// the run parses as each option declares.
std::vector<std::pair<std::string, std::string>> raw_args(lua_State* L) {
  std::vector<std::pair<std::string, std::string>> out;
  lua_getfield(L, LUA_REGISTRYINDEX, "wick.raw_args");
  if (lua_istable(L, -1)) {
    const int n = static_cast<int>(lua_objlen(L, -1));
    for (int i = 1; i <= n; ++i) {
      lua_rawgeti(L, -1, i);
      lua_getfield(L, -1, "k");
      lua_getfield(L, -2, "v");
      out.emplace_back(lua_tostring(L, -2), lua_tostring(L, -1));
      lua_pop(L, 3);
    }
  }
  lua_pop(L, 1);
  return out;
}

std::string recipe_path(lua_State* L) {
  lua_getglobal(L, "arg");
  std::string path;
  if (lua_istable(L, -1)) {
    lua_rawgeti(L, -1, 0);
    if (lua_type(L, -1) == LUA_TSTRING) path = lua_tostring(L, -1);
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  return path;
}

// core.train(cfg): the engine's run (train/run.hpp); returns its summary.
// Under `wick plan` it measures instead and ends the recipe.
int core_train(lua_State* L) {
  check_table(L, 1, "train");
  RunRequest req;
  req.objects = collect_run_table(L, 1, "wick.train", req.options);
  req.overrides = raw_args(L);
  req.recipe = recipe_path(L);
  lua_getfield(L, LUA_REGISTRYINDEX, "wick.plan");
  const bool plan = !lua_isnil(L, -1);
  const auto device_memory = static_cast<std::int64_t>(lua_tonumber(L, -1));
  lua_pop(L, 1);
  if (plan) {
    plan_training(req, device_memory);
    lua_pushlightuserdata(L, plan_done_sentinel());
    return lua_error(L);
  }
  push_json(L, run_training(req));
  return 1;
}

int core_describe_train(lua_State* L) {
  const std::string s = describe_run_options();
  lua_pushlstring(L, s.data(), s.size());
  return 1;
}

void push_metrics(lua_State* L, const std::map<std::string, double>& m) {
  for (const auto& [k, v] : m) set_number(L, k.c_str(), v);
}

int trainer_step(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "step");
  auto& w = check_box<std::vector<Batch>>(L, 2, kWindowMt, "step");
  StepStats s = t->step(*w);
  lua_createtable(L, 0, 10);
  set_number(L, "step", static_cast<double>(s.step));
  set_number(L, "loss", s.loss);
  set_number(L, "items", static_cast<double>(s.items));
  set_number(L, "micro_batches", static_cast<double>(s.micro_batches));
  set_number(L, "lr", s.lr);
  set_number(L, "grad_norm", s.grad_norm);
  set_number(L, "seconds", s.seconds);
  if (s.loss_scale > 0) set_number(L, "loss_scale", s.loss_scale);
  if (s.skipped) {
    lua_pushboolean(L, true);
    lua_setfield(L, -2, "skipped");
  }
  if (s.split > 1) set_number(L, "split", static_cast<double>(s.split));
  if (s.oom_retries > 0) set_number(L, "oom_retries", static_cast<double>(s.oom_retries));
  lua_pushboolean(L, s.stop);
  lua_setfield(L, -2, "stop");
  push_metrics(L, s.metrics);
  return 1;
}

int trainer_skipped_steps(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "skipped_steps");
  lua_pushnumber(L, static_cast<double>(t->skipped_steps()));
  return 1;
}

int trainer_split(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "split");
  lua_pushnumber(L, static_cast<double>(t->split()));
  return 1;
}

int trainer_loss_scale(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "loss_scale");
  const double v = t->loss_scale();
  if (v > 0) lua_pushnumber(L, v);
  else lua_pushnil(L);
  return 1;
}

int trainer_checkpointed_blocks(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "checkpointed_blocks");
  const auto b = t->checkpointed_blocks();
  lua_createtable(L, static_cast<int>(b.size()), 0);
  for (std::size_t i = 0; i < b.size(); ++i) {
    lua_pushstring(L, b[i].c_str());
    lua_rawseti(L, -2, static_cast<int>(i + 1));
  }
  return 1;
}

// trainer:probe(window): forward and backward of the window's first
// micro-batch, no step; returns true, or false and the message when it ran
// out of memory.
int trainer_probe(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "probe");
  auto& w = check_box<std::vector<Batch>>(L, 2, kWindowMt, "probe");
  if (w->empty()) throw Error("probe: the window is empty");
  try {
    t->probe(w->front());
  } catch (const c10::OutOfMemoryError& e) {
    if (t->config().device.rfind("cuda", 0) == 0) cuda_empty_cache();
    lua_pushboolean(L, false);
    lua_pushstring(L, e.what_without_backtrace());
    return 2;
  }
  lua_pushboolean(L, true);
  return 1;
}

int trainer_memory_breakdown(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "memory_breakdown");
  const auto m = t->memory_breakdown();
  lua_createtable(L, 0, static_cast<int>(m.size()));
  for (const auto& [k, v] : m) set_number(L, k.c_str(), static_cast<double>(v));
  return 1;
}

int trainer_steps(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "steps");
  lua_pushnumber(L, static_cast<double>(t->steps()));
  return 1;
}

// Collectives and bytes this rank has sent into them so far.
int trainer_comm(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "comm");
  lua_createtable(L, 0, 2);
  set_number(L, "collectives", t->group() ? static_cast<double>(t->group()->collectives()) : 0);
  set_number(L, "bytes", t->group() ? static_cast<double>(t->group()->bytes()) : 0);
  return 1;
}

int trainer_save(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "save");
  const std::string dir = check_string(L, 2, "save");
  nlohmann::json extra = lua_isnoneornil(L, 3) ? nlohmann::json::object() : to_json(L, 3);
  const int keep = static_cast<int>(luaL_optnumber(L, 4, 3));
  lua_pushstring(L, t->save(dir, extra, keep).string().c_str());
  return 1;
}

int trainer_load(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "load");
  push_json(L, t->load(check_string(L, 2, "load")));
  return 1;
}

int core_evaluate(lua_State* L) {
  auto m = check_model(L, 1, "evaluate");
  auto d = check_data(L, 2, "evaluate");
  const auto micro = static_cast<std::int64_t>(luaL_optnumber(L, 3, 32));
  const std::string device = lua_isstring(L, 4) ? lua_tostring(L, 4) : "cpu";
  EvalStats s = evaluate(*m, d, micro, device);
  lua_createtable(L, 0, 4);
  set_number(L, "loss", s.loss);
  set_number(L, "items", static_cast<double>(s.items));
  push_metrics(L, s.metrics);
  return 1;
}

int core_latest_checkpoint(lua_State* L) {
  auto p = latest_checkpoint(check_string(L, 1, "latest_checkpoint"));
  if (p.empty()) lua_pushnil(L);
  else lua_pushstring(L, p.string().c_str());
  return 1;
}

int core_seed(lua_State* L) {
  at::manual_seed(static_cast<std::uint64_t>(luaL_checknumber(L, 1)));
  return 0;
}

int core_interrupted(lua_State* L) {
  lua_pushboolean(L, interrupted());
  lua_pushnumber(L, interrupt_signal());
  return 2;
}

int core_memory(lua_State* L) {
  auto m = memory_stats(lua_toboolean(L, 1));
  lua_createtable(L, 0, static_cast<int>(m.size()));
  for (const auto& [k, v] : m) set_number(L, k.c_str(), static_cast<double>(v));
  return 1;
}

int core_cuda_available(lua_State* L) {
  lua_pushboolean(L, cuda_available());
  return 1;
}

int core_now(lua_State* L) {
  lua_pushnumber(L, std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count());
  return 1;
}

int core_isatty(lua_State* L) {
  lua_pushboolean(L, ::isatty(static_cast<int>(luaL_checknumber(L, 1))));
  return 1;
}

int core_json(lua_State* L) {
  const std::string s = to_json(L, 1).dump();
  lua_pushlstring(L, s.data(), s.size());
  return 1;
}

int core_json_decode(lua_State* L) {
  const std::string s = check_string(L, 1, "json_decode");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(s);
  } catch (const std::exception& e) {
    throw Error(std::string("invalid JSON: ") + e.what());
  }
  push_json(L, j);
  return 1;
}

int core_where(lua_State* L) {
  lua_pushstring(L, user_location(L).c_str());
  return 1;
}

int core_mkdirs(lua_State* L) {
  const std::string p = check_string(L, 1, "mkdirs");
  std::error_code ec;
  fs::create_directories(p, ec);
  if (ec) throw Error("cannot create folder " + p + ": " + ec.message());
  return 0;
}

int core_write_file(lua_State* L) {
  size_t n = 0;
  const std::string p = check_string(L, 1, "write_file");
  const char* s = luaL_checklstring(L, 2, &n);
  write_file_atomic(p, std::string(s, n));
  return 0;
}

// ---- run folders: TensorBoard events, listing, processes, terminals ----

int core_event_writer(lua_State* L) {
  push_box<EventWriter>(L, std::make_shared<EventWriter>(check_string(L, 1, "event_writer")), kEventsMt);
  return 1;
}

double wall_time_arg(lua_State* L, int i) {
  return lua_isnoneornil(L, i) ? wall_time_now() : luaL_checknumber(L, i);
}

// writer:scalars(step, {tag = number, ...} [, wall_time]): tags in sorted order
int events_scalars(lua_State* L) {
  auto& w = check_box<EventWriter>(L, 1, kEventsMt, "scalars");
  const auto step = static_cast<std::int64_t>(luaL_checknumber(L, 2));
  luaL_checktype(L, 3, LUA_TTABLE);
  std::vector<std::pair<std::string, double>> values;
  lua_pushnil(L);
  while (lua_next(L, 3) != 0) {
    if (lua_type(L, -2) == LUA_TSTRING && lua_type(L, -1) == LUA_TNUMBER)
      values.emplace_back(lua_tostring(L, -2), lua_tonumber(L, -1));
    lua_pop(L, 1);
  }
  std::sort(values.begin(), values.end());
  w->scalars(step, values, wall_time_arg(L, 4));
  return 0;
}

int events_text(lua_State* L) {
  auto& w = check_box<EventWriter>(L, 1, kEventsMt, "text");
  w->text(static_cast<std::int64_t>(luaL_checknumber(L, 2)), check_string(L, 3, "text"), check_string(L, 4, "text"),
          wall_time_arg(L, 5));
  return 0;
}

int events_close(lua_State* L) {
  check_box<EventWriter>(L, 1, kEventsMt, "close")->close();
  return 0;
}

int events_path(lua_State* L) {
  lua_pushstring(L, check_box<EventWriter>(L, 1, kEventsMt, "path")->path().c_str());
  return 1;
}

// core.list_dir(path) -> { {name=, dir=bool, size=, mtime=}, ... } sorted by
// name, or nil and the reason
int core_list_dir(lua_State* L) {
  const std::string p = check_string(L, 1, "list_dir");
  std::error_code ec;
  std::vector<fs::directory_entry> entries;
  for (fs::directory_iterator it(p, ec), end; !ec && it != end; it.increment(ec)) entries.push_back(*it);
  if (ec) {
    lua_pushnil(L);
    lua_pushstring(L, (p + ": " + ec.message()).c_str());
    return 2;
  }
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.path().filename() < b.path().filename(); });
  lua_createtable(L, static_cast<int>(entries.size()), 0);
  int i = 0;
  for (const auto& e : entries) {
    lua_createtable(L, 0, 4);
    lua_pushstring(L, e.path().filename().c_str());
    lua_setfield(L, -2, "name");
    lua_pushboolean(L, e.is_directory(ec));
    lua_setfield(L, -2, "dir");
    const auto size = e.is_regular_file(ec) ? e.file_size(ec) : 0;
    set_number(L, "size", static_cast<double>(ec ? 0 : size));
    const auto mt = e.last_write_time(ec);
    // file_clock is system time shifted by a fixed offset (libstdc++: 2174 - 1970)
    const auto secs = std::chrono::duration<double>(std::chrono::file_clock::to_sys(mt).time_since_epoch()).count();
    set_number(L, "mtime", ec ? 0.0 : secs);
    lua_rawseti(L, -2, ++i);
  }
  return 1;
}

// core.process() -> { pid =, host = }
int core_process(lua_State* L) {
  lua_createtable(L, 0, 2);
  set_number(L, "pid", static_cast<double>(::getpid()));
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  lua_pushstring(L, host);
  lua_setfield(L, -2, "host");
  return 1;
}

// core.pid_alive(pid): a process with this id exists on this machine
int core_pid_alive(lua_State* L) {
  const auto pid = static_cast<pid_t>(luaL_checknumber(L, 1));
  lua_pushboolean(L, pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM));
  return 1;
}

// core.term_width(fd): the terminal's columns, or 0 when fd is not a terminal
int core_term_width(lua_State* L) {
  winsize ws{};
  const int fd = static_cast<int>(luaL_checknumber(L, 1));
  lua_pushnumber(L, ::ioctl(fd, TIOCGWINSZ, &ws) == 0 ? ws.ws_col : 0);
  return 1;
}

// Reads a safetensors file and writes it again: tensors and metadata as read.
int core_copy_tensors(lua_State* L) {
  auto f = read_safetensors(check_string(L, 1, "copy_tensors"));
  write_safetensors(check_string(L, 2, "copy_tensors"), f.tensors, f.metadata);
  return 0;
}

int core_dist(lua_State* L) {
  const DistEnv env = dist_env();
  lua_createtable(L, 0, 6);
  set_number(L, "rank", env.rank);
  set_number(L, "world_size", env.world_size);
  set_number(L, "local_rank", env.local_rank);
  set_number(L, "local_world_size", env.local_world_size);
  lua_pushstring(L, env.source.c_str());
  lua_setfield(L, -2, "source");
  return 1;
}

// Every rank must give the same value (a fingerprint of recipe and options).
int core_check_same(lua_State* L) {
  const std::string what = check_string(L, 1, "check_same");
  const std::string value = check_string(L, 2, "check_same");
  const std::string device = lua_isstring(L, 3) ? lua_tostring(L, 3) : "cpu";
  if (auto g = Group::world(device)) g->check_same(what, value);
  return 0;
}

// model outputs for the batch in a safetensors file, written to another:
// wick.core.predict(model, "batch.safetensors", "out.safetensors")
int core_predict(lua_State* L) {
  auto m = check_model(L, 1, "predict");
  auto in = read_safetensors(check_string(L, 2, "predict"));
  Batch b(in.tensors.begin(), in.tensors.end());
  const bool was_training = m->is_training();
  m->train(false);
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = m->predict(b);
  }
  m->train(was_training);
  write_safetensors(check_string(L, 3, "predict"), {{"output", out}});
  return 0;
}

// core.save_samples(data, {i, ...}, path [, epoch, seed]): samples as the
// loader would read them in that epoch, written as safetensors "<i>.<name>"
int core_save_samples(lua_State* L) {
  auto d = check_data(L, 1, "save_samples");
  luaL_checktype(L, 2, LUA_TTABLE);
  const std::string path = check_string(L, 3, "save_samples");
  const auto epoch = static_cast<std::int64_t>(luaL_optnumber(L, 4, 0));
  const auto seed = static_cast<std::uint64_t>(luaL_optnumber(L, 5, 0));
  d->set_epoch(epoch, seed);
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<std::int64_t> written;  // an index given twice is read twice, written once
  const int n = static_cast<int>(lua_objlen(L, 2));
  for (int k = 1; k <= n; ++k) {
    lua_rawgeti(L, 2, k);
    const auto i = static_cast<std::int64_t>(luaL_checknumber(L, -1));
    lua_pop(L, 1);
    if (i < 0 || i >= d->size())
      throw Error("save_samples: index " + std::to_string(i) + " outside the data set's 0.." + std::to_string(d->size() - 1));
    auto sample = d->get(i);
    if (!written.insert(i).second) continue;
    for (auto& [name, t] : sample) out.emplace_back(std::to_string(i) + "." + name, t.contiguous());
  }
  write_safetensors(path, out);
  return 0;
}

// the loss (sum / items) of the batch in a file and every parameter's
// gradient of it, written as safetensors ("loss", "items", "grad.<name>")
int core_gradients(lua_State* L) {
  auto m = check_model(L, 1, "gradients");
  auto in = read_safetensors(check_string(L, 2, "gradients"));
  Batch b(in.tensors.begin(), in.tensors.end());
  for (auto& p : m->parameters()) p.mutable_grad() = at::Tensor();
  ForwardResult r = m->forward(b);
  at::Tensor loss = r.loss_sum / static_cast<double>(r.items);
  loss.backward();
  std::vector<std::pair<std::string, at::Tensor>> out{{"loss", loss.detach().reshape({})},
                                                      {"items", at::scalar_tensor(r.items, at::kLong)}};
  for (const auto& p : m->named_parameters(/*recurse=*/true))
    if (p.value().grad().defined()) out.emplace_back("grad." + p.key(), p.value().grad());
  write_safetensors(check_string(L, 3, "gradients"), out);
  for (auto& p : m->parameters()) p.mutable_grad() = at::Tensor();
  return 0;
}

int core_args(lua_State* L) {
  lua_getfield(L, LUA_REGISTRYINDEX, "wick.args");
  if (lua_isnil(L, -1)) {
    lua_pop(L, 1);
    lua_newtable(L);
  }
  return 1;
}

int core_plugins(lua_State* L) {
  const auto& entries = registry().entries();
  lua_createtable(L, static_cast<int>(entries.size()), 0);
  int k = 1;
  for (const auto& e : entries) {
    lua_createtable(L, 0, 4);
    lua_pushstring(L, e.name.c_str());
    lua_setfield(L, -2, "name");
    lua_pushstring(L, e.file.string().c_str());
    lua_setfield(L, -2, "file");
    if (e.descriptor) {
      lua_pushstring(L, to_string(e.descriptor->kind));
      lua_setfield(L, -2, "kind");
      lua_pushstring(L, e.descriptor->summary);
      lua_setfield(L, -2, "summary");
    } else {
      lua_pushstring(L, e.error.c_str());
      lua_setfield(L, -2, "error");
    }
    lua_rawseti(L, -2, k++);
  }
  return 1;
}

template <class T>
void new_metatable(lua_State* L, const char* name, const luaL_Reg* methods, lua_CFunction index = nullptr) {
  luaL_newmetatable(L, name);
  lua_pushcfunction(L, box_gc<T>);
  lua_setfield(L, -2, "__gc");
  lua_pushstring(L, name);
  lua_setfield(L, -2, "__name");
  lua_newtable(L);
  if (methods) luaL_register(L, nullptr, methods);
  if (index) {
    lua_setfield(L, -2, "methods");
    lua_pushcfunction(L, index);
    lua_setfield(L, -2, "__index");
  } else {
    lua_setfield(L, -2, "__index");
  }
  lua_pushfstring(L, "%s", name);
  lua_pushcclosure(L, [](lua_State* L) -> int {
    lua_pushfstring(L, "%s: %p", lua_tostring(L, lua_upvalueindex(1)), lua_touserdata(L, 1));
    return 1;
  }, 1);
  lua_setfield(L, -2, "__tostring");
  lua_pop(L, 1);
}

#define G(f) guarded<f>

int luaopen_wick_core(lua_State* L) {
  static const luaL_Reg model_methods[] = {{"save", G(model_save)},
                                           {"load", G(model_load)},
                                           {"parameters", G(model_parameters)},
                                           {"blocks", G(model_blocks)},
                                           {"item_name", G(model_item_name)},
                                           {"window_coupled", G(model_window_coupled)},
                                           {"generate", G(model_generate)},
                                           {nullptr, nullptr}};
  static const luaL_Reg data_methods[] = {
      {"size", G(data_size)}, {"encode", G(data_encode)}, {"decode", G(data_decode)}, {"window", G(data_window)},
      {nullptr, nullptr}};
  static const luaL_Reg optim_methods[] = {{"kind", G(optim_kind)},   {"apply", G(transform_apply)},
                                           {"save", G(transform_save)}, {"load", G(transform_load)},
                                           {"merge", G(transform_merge)}, {nullptr, nullptr}};
  static const luaL_Reg loader_methods[] = {{"windows_per_epoch", G(loader_windows_per_epoch)},
                                            {"start_epoch", G(loader_start_epoch)},
                                            {"next", G(loader_next)},
                                            {"position", G(loader_position)},
                                            {"buffered_bytes", G(loader_buffered_bytes)},
                                            {nullptr, nullptr}};
  static const luaL_Reg trainer_methods[] = {{"step", G(trainer_step)},
                                             {"steps", G(trainer_steps)},
                                             {"comm", G(trainer_comm)},
                                             {"save", G(trainer_save)},
                                             {"load", G(trainer_load)},
                                             {"skipped_steps", G(trainer_skipped_steps)},
                                             {"split", G(trainer_split)},
                                             {"loss_scale", G(trainer_loss_scale)},
                                             {"checkpointed_blocks", G(trainer_checkpointed_blocks)},
                                             {"probe", G(trainer_probe)},
                                             {"memory_breakdown", G(trainer_memory_breakdown)},
                                             {nullptr, nullptr}};
  new_metatable<Object>(L, kModelMt, model_methods, object_index);
  new_metatable<Object>(L, kDataMt, data_methods, object_index);
  new_metatable<Object>(L, kOptimMt, optim_methods, object_index);
  new_metatable<Loader>(L, kLoaderMt, loader_methods);
  new_metatable<Trainer>(L, kTrainerMt, trainer_methods);
  static const luaL_Reg events_methods[] = {{"scalars", G(events_scalars)},
                                            {"text", G(events_text)},
                                            {"close", G(events_close)},
                                            {"path", G(events_path)},
                                            {nullptr, nullptr}};
  new_metatable<EventWriter>(L, kEventsMt, events_methods);
  static const luaL_Reg window_methods[] = {{"free", G(window_free)}, {"save", G(window_save)}, {nullptr, nullptr}};
  new_metatable<std::vector<Batch>>(L, kWindowMt, window_methods);
  luaL_getmetatable(L, kWindowMt);
  lua_pushcfunction(L, G(window_len));
  lua_setfield(L, -2, "__len");
  lua_pop(L, 1);

  static const luaL_Reg core[] = {{"model", G(make_plugin<PluginKind::Model>)},
                                  {"data", G(make_plugin<PluginKind::Data>)},
                                  {"optim", G(make_plugin<PluginKind::Optim>)},
                                  {"loader", G(make_loader)},
                                  {"trainer", G(make_trainer)},
                                  {"train", G(core_train)},
                                  {"describe_train", G(core_describe_train)},
                                  {"evaluate", G(core_evaluate)},
                                  {"latest_checkpoint", G(core_latest_checkpoint)},
                                  {"seed", G(core_seed)},
                                  {"interrupted", G(core_interrupted)},
                                  {"memory", G(core_memory)},
                                  {"cuda_available", G(core_cuda_available)},
                                  {"now", G(core_now)},
                                  {"isatty", G(core_isatty)},
                                  {"json", G(core_json)},
                                  {"json_decode", G(core_json_decode)},
                                  {"where", G(core_where)},
                                  {"mkdirs", G(core_mkdirs)},
                                  {"write_file", G(core_write_file)},
                                  {"event_writer", G(core_event_writer)},
                                  {"save_samples", G(core_save_samples)},
                                  {"list_dir", G(core_list_dir)},
                                  {"process", G(core_process)},
                                  {"pid_alive", G(core_pid_alive)},
                                  {"term_width", G(core_term_width)},
                                  {"plugins", G(core_plugins)},
                                  {"args", G(core_args)},
                                  {"dist", G(core_dist)},
                                  {"check_same", G(core_check_same)},
                                  {"copy_tensors", G(core_copy_tensors)},
                                  {"predict", G(core_predict)},
                                  {"gradients", G(core_gradients)},
                                  {"set_memory_limit", G(core_set_memory_limit)},
                                  {"reset_peak", G(core_reset_peak)},
                                  {"device_memory", G(core_device_memory)},
                                  {"parse_bytes", G(core_parse_bytes)},
                                  {nullptr, nullptr}};
  lua_newtable(L);
  luaL_register(L, nullptr, core);
  return 1;
}

}  // namespace

void open_wick_core(lua_State* L) {
  lua_pushstring(L, fs::weakly_canonical(LuaRuntime::package_dir()).string().c_str());
  lua_setfield(L, LUA_REGISTRYINDEX, kPackageDirKey);
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, luaopen_wick_core);
  lua_setfield(L, -2, "wick.core");
  lua_pop(L, 2);
}

}  // namespace wick
