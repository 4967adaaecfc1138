// wick.core: Training: the run (core.train, wick.train's engine), the step primitives (loader, trainer), evaluation, checkpoints, inspection (predict, gradients, save_samples), ranks and memory.

#include "lua/binding.hpp"

#include <ATen/record_function.h>

#include <set>
#include <optional>

#include "distributed/group.hpp"
#include "plugin/registry.hpp"
#include "train/inspect.hpp"
#include "train/loader.hpp"
#include "train/run.hpp"
#include "train/run_options.hpp"
#include "train/trainer.hpp"
#include "util/memory.hpp"
#include "util/system.hpp"
#include "wick/kit/safetensors.hpp"

namespace wick::lua {
namespace {

// wick.loader(data, {...}): its options checked by wick.train's declarations
// (train/run_options.hpp), so micro_batch = 2.5 is refused as wick.train
// refuses it, not truncated.
int make_loader(lua_State* L) {
  auto d = check_data(L, 1, "loader");
  check_table(L, 2, "loader");
  std::map<std::string, Value> given;
  lua_pushnil(L);
  while (lua_next(L, 2)) {
    if (lua_type(L, -2) != LUA_TSTRING) throw Error("wick.loader: option names must be strings");
    const std::string key = lua_tostring(L, -2);
    given[key] = to_value(L, lua_gettop(L), "wick.loader: option '" + key + "'");
    lua_pop(L, 1);
  }
  const Options o = validate_loader_options("wick.loader", given);
  LoaderConfig c;
  c.micro_batch = o.get_int("micro_batch");
  c.accumulate = o.get_int("accumulate");
  c.shuffle = o.get_bool("shuffle");
  c.seed = static_cast<std::uint64_t>(o.get_int("seed"));
  c.drop_last = o.get_bool("drop_last");
  c.workers = static_cast<int>(o.get_int("workers"));
  c.prefetch = static_cast<int>(o.get_int("prefetch"));
  const DistEnv env = dist_env();  // this process's shard unless told otherwise
  c.rank = o.has("rank") ? static_cast<int>(o.get_int("rank")) : env.rank;
  c.world_size = o.has("world_size") ? static_cast<int>(o.get_int("world_size")) : env.world_size;
  c.pin_memory = o.get_bool("pin_memory");
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
  std::optional<std::vector<Batch>> w;
  {
    RECORD_USER_SCOPE("wick::data");  // a profile's data phase (wick.profile), as wick.train's loop marks it
    w = l->next_window();
  }
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

int loader_buffered_bytes(lua_State* L) {
  auto& l = check_box<Loader>(L, 1, kLoaderMt, "buffered_bytes");
  lua_pushnumber(L, static_cast<double>(l->buffered_bytes()));
  return 1;
}

// A wick.train / wick.trainer table: objects (model, data, optim, schedule,
// eval_data) apart, every other key a plain option value. A loss_scale table
// {init, growth, backoff, interval} becomes the loss_scale_* options.
// A recipe's callback: a Lua function held in the registry while the run
// lasts. Its answer: nil, or {log = {name = number, ...}, stop = true or a reason}.
class LuaCallback {
 public:
  LuaCallback(lua_State* L, int index, std::string name) : L_(L), name_(std::move(name)) {
    lua_pushvalue(L, index);
    ref_ = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  ~LuaCallback() { luaL_unref(L_, LUA_REGISTRYINDEX, ref_); }
  LuaCallback(const LuaCallback&) = delete;
  LuaCallback& operator=(const LuaCallback&) = delete;

  template <class Push>
  CallbackReply call(Push push, const std::string& at) {
    const int top = lua_gettop(L_);
    lua_rawgeti(L_, LUA_REGISTRYINDEX, ref_);
    push(L_);
    const CallbackScope in_lua;  // a signal meanwhile: the callback's grace, then the hook or the watcher
    if (lua_pcall(L_, 1, 1, 0) != 0) {
      std::string msg = lua_type(L_, -1) == LUA_TSTRING ? lua_tostring(L_, -1)
                                                        : std::string("(an error value of type ") + luaL_typename(L_, -1) + ")";
      lua_settop(L_, top);
      throw Error(name_ + " (" + at + ") failed: " + msg);
    }
    CallbackReply reply;
    try {
      reply = read_reply(lua_gettop(L_), at);
    } catch (...) {
      lua_settop(L_, top);
      throw;
    }
    lua_settop(L_, top);
    return reply;
  }

 private:
  CallbackReply read_reply(int i, const std::string& at) {
    CallbackReply r;
    const std::string expected = "expected nil or a table {log = {name = number, ...}, stop = true or a reason}";
    if (lua_isnil(L_, i)) return r;
    if (!lua_istable(L_, i))
      throw Error(name_ + " (" + at + ") returned a " + luaL_typename(L_, i) + ": " + expected);
    lua_pushnil(L_);
    while (lua_next(L_, i)) {
      const std::string key = lua_type(L_, -2) == LUA_TSTRING ? lua_tostring(L_, -2) : "?";
      const int v = lua_gettop(L_);
      if (key == "stop") {
        if (lua_type(L_, v) == LUA_TSTRING) {
          r.stop = true;
          r.reason = lua_tostring(L_, v);
        } else if (lua_isboolean(L_, v)) {
          r.stop = lua_toboolean(L_, v);
        } else {
          throw Error(name_ + " (" + at + "): stop: expected true, false or a reason (a string), got a " +
                      luaL_typename(L_, v));
        }
      } else if (key == "log") {
        if (!lua_istable(L_, v))
          throw Error(name_ + " (" + at + "): log: expected a table {name = number, ...}, got a " + luaL_typename(L_, v));
        lua_pushnil(L_);
        while (lua_next(L_, v)) {
          if (lua_type(L_, -2) != LUA_TSTRING || lua_type(L_, -1) != LUA_TNUMBER)
            throw Error(name_ + " (" + at + "): log: expected names (strings) with numbers, got a " +
                        luaL_typename(L_, -2) + " with a " + luaL_typename(L_, -1));
          const std::string name = lua_tostring(L_, -2);
          if (name.empty()) throw Error(name_ + " (" + at + "): log: an empty name");
          r.log.emplace_back(name, lua_tonumber(L_, -1));
          lua_pop(L_, 1);
        }
      } else {
        throw Error(name_ + " (" + at + ") returned a table with '" + key + "': " + expected);
      }
      lua_pop(L_, 1);
    }
    return r;
  }
  lua_State* L_;
  std::string name_;
  int ref_ = LUA_NOREF;
};

void set_callback(lua_State* L, int v, const std::string& key, const std::string& label, RunCallbacks* cbs) {
  if (!cbs)
    throw Error(label + ": option '" + key + "' is wick.train's (a custom loop calls its own functions after each step)");
  if (!lua_isfunction(L, v))
    throw Error(label + ": option '" + key + "': expected a function, got a " + std::string(luaL_typename(L, v)));
  auto f = std::make_shared<LuaCallback>(L, v, key);
  auto where_step = [](const nlohmann::json& rec) {
    return "step " + std::to_string(rec.value("step", std::int64_t{0}));
  };
  if (key == "on_step")
    cbs->on_step = [f, where_step](const nlohmann::json& rec) {
      return f->call([&](lua_State* S) { push_json(S, rec); }, where_step(rec));
    };
  else if (key == "on_eval")
    cbs->on_eval = [f](const nlohmann::json& rec) {
      return f->call([&](lua_State* S) { push_json(S, rec); },
                     "evaluation after step " + std::to_string(rec.value("step", std::int64_t{0})));
    };
  else
    cbs->on_save = [f](const std::string& dir) {
      return f->call([&](lua_State* S) { lua_pushstring(S, dir.c_str()); }, "checkpoint " + dir);
    };
}

RunObjects collect_run_table(lua_State* L, int t, const std::string& label, std::map<std::string, Value>& options,
                             RunCallbacks* callbacks = nullptr) {
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
    else if (key == "on_step" || key == "on_eval" || key == "on_save") set_callback(L, v, key, label, callbacks);
    else if (key == "loss_scale" && lua_istable(L, v)) {
      lua_pushnil(L);
      while (lua_next(L, v)) {
        if (lua_type(L, -2) != LUA_TSTRING)
          throw Error(label + ": loss_scale: expected a number or a table of named keys (init, growth, backoff, "
                      "interval), got a list (key " + std::string(luaL_typename(L, -2)) + " " +
                      (lua_type(L, -2) == LUA_TNUMBER ? Value(lua_tonumber(L, -2)).repr() : "?") + ")");
        const std::string k = lua_tostring(L, -2);
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
                to_string(obj.optim->object_kind()));
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
  c.device = resolve_device_option("wick.trainer", c.device, dist_env());
  c.group = Group::world(c.device);
  push_box<Trainer>(L, std::make_shared<Trainer>(obj.model, std::static_pointer_cast<Optimizer>(obj.optim), schedule, c),
                    kTrainerMt);
  return 1;
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
  req.objects = collect_run_table(L, 1, "wick.train", req.options, &req.callbacks);
  req.context = run_context(L);  // the run notes the keys it takes, and names typos
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
  nlohmann::json result = run_training(req);
  report_memory_trace();  // WICK_MEMORY_PEAK_TRACE: while the plugins' code is still loaded
  push_json(L, result);
  return 1;
}

int core_describe_train(lua_State* L) {
  const std::string s = describe_run_options();
  lua_pushlstring(L, s.data(), s.size());
  return 1;
}

int trainer_step(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "step");
  auto& w = check_box<std::vector<Batch>>(L, 2, kWindowMt, "step");
  StepStats s;
  {
    RECORD_USER_SCOPE("wick::step");  // a profile's step phase (wick.profile), as wick.train's loop marks it
    s = t->step(*w);
  }
  lua_createtable(L, 0, 10);
  set_number(L, "step", static_cast<double>(s.step));
  set_number(L, "loss", s.loss);
  set_number(L, "items", static_cast<double>(s.items));
  set_number(L, "micro_batches", static_cast<double>(s.micro_batches));
  set_number(L, "lr", s.lr);
  for (const auto& [k, v] : s.group_lrs) set_number(L, k.c_str(), v);
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
  lua_createtable(L, 0, 3);
  set_number(L, "collectives", t->group() ? static_cast<double>(t->group()->collectives()) : 0);
  set_number(L, "bytes", t->group() ? static_cast<double>(t->group()->bytes()) : 0);
  set_number(L, "sent", t->group() ? static_cast<double>(t->group()->sent()) : 0);
  return 1;
}

// trainer:finish(): shard = "parameters" gathers the divided weights back
// into the model, on every rank at once (each calls it at the same point of
// its loop; a garbage collection would come at each rank's own time). The
// trainer takes no step after it. Elsewhere it does nothing.
int trainer_finish(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "finish");
  t->gather_weights_back();
  return 0;
}

// trainer:evaluate(data[, micro_batch]): the loss (and metrics) of the
// trainer's model on `data`, on its device and precision; under shard =
// "parameters" on every rank at once, each block gathering its weights.
int trainer_evaluate(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "evaluate");
  auto d = check_data(L, 2, "trainer:evaluate");
  const double micro = luaL_optnumber(L, 3, 32);
  if (!(micro >= 1 && micro <= 1e9 && std::floor(micro) == micro))
    throw Error("trainer:evaluate: micro_batch: expected a whole number >= 1, got " + Value(micro).repr());
  EvalStats s = t->evaluate(d, static_cast<std::int64_t>(micro));
  lua_createtable(L, 0, 4);
  set_number(L, "loss", s.loss);
  set_number(L, "items", static_cast<double>(s.items));
  push_metrics(L, s.metrics);
  return 1;
}

// trainer:save_ema(file): the model with the averaged weights (wick.trainer{ema = 0.999}), for model:load
int trainer_save_ema(lua_State* L) {
  auto& t = check_box<Trainer>(L, 1, kTrainerMt, "save_ema");
  t->save_ema(check_string(L, 2, "save_ema"));
  return 0;
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
  EvalConfig ec;
  ec.micro_batch = micro;
  ec.device = device;
  EvalStats s = evaluate(*m, d, ec);
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
  const double seed = luaL_checknumber(L, 1);
  // a seed is a whole number: inf, nan, 1.5 or -1 would be cast to some other one
  if (!(seed >= 0 && seed < 9.007199254740992e15 && std::floor(seed) == seed))
    throw Error("wick.seed: expected a whole number from 0 to 2^53, got " + Value(seed).repr());
  at::manual_seed(static_cast<std::uint64_t>(seed));
  return 0;
}

int core_interrupted(lua_State* L) {
  signal_polled();  // a recipe that asks stops by itself: its Lua code gets a callback's grace
  lua_pushboolean(L, interrupted());
  lua_pushnumber(L, interrupt_signal());
  return 2;
}

// Every rank must give the same value (a fingerprint of recipe and options).
int core_check_same(lua_State* L) {
  const std::string what = check_string(L, 1, "check_same");
  const std::string value = check_string(L, 2, "check_same");
  const std::string device = lua_isstring(L, 3) ? lua_tostring(L, 3) : "cpu";
  if (auto g = Group::world(device)) g->check_same(what, value);
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

// model outputs for the batch in a safetensors file, written to another:
// wick.core.predict(model, "batch.safetensors", "out.safetensors")
int core_predict(lua_State* L) {
  save_predictions(*check_model(L, 1, "predict"), check_string(L, 2, "predict"), check_string(L, 3, "predict"));
  return 0;
}

// core.save_samples(data, {i, ...}, path [, epoch, seed]): samples as the
// loader would read them in that epoch, written as safetensors "<i>.<name>"
int core_save_samples(lua_State* L) {
  auto d = check_data(L, 1, "save_samples");
  const auto indices = check_ids(L, 2, "save_samples");
  save_samples(*d, indices, check_string(L, 3, "save_samples"), static_cast<std::int64_t>(luaL_optnumber(L, 4, 0)),
               static_cast<std::uint64_t>(luaL_optnumber(L, 5, 0)));
  return 0;
}

// the loss (sum / items) of the batch in a file and every parameter's
// gradient of it, written as safetensors ("loss", "items", "grad.<name>")
int core_gradients(lua_State* L) {
  save_gradients(*check_model(L, 1, "gradients"), check_string(L, 2, "gradients"), check_string(L, 3, "gradients"));
  return 0;
}

// Reads a safetensors file and writes it again: tensors and metadata as read.
int core_copy_tensors(lua_State* L) {
  auto f = read_safetensors(check_string(L, 1, "copy_tensors"));
  write_safetensors(check_string(L, 2, "copy_tensors"), f.tensors, f.metadata);
  return 0;
}

int core_memory(lua_State* L) {
  auto m = memory_stats(lua_toboolean(L, 1));
  lua_createtable(L, 0, static_cast<int>(m.size()));
  for (const auto& [k, v] : m) set_number(L, k.c_str(), static_cast<double>(v));
  return 1;
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

// core.set_memory_limit(bytes | "8GiB" | 0): caps CPU tensor memory (see util/memory.hpp)
int core_set_memory_limit(lua_State* L) {
  std::int64_t bytes = 0;
  if (lua_type(L, 1) == LUA_TNUMBER) bytes = static_cast<std::int64_t>(lua_tonumber(L, 1));
  else bytes = parse_bytes(check_string(L, 1, "set_memory_limit"), "set_memory_limit");
  set_cpu_memory_limit(bytes);
  return 0;
}

// core.resolve_device([name [, label]]): the device option as wick.train
// resolves it for this process ("auto" or nil: this rank's GPU, or the CPU)
int core_resolve_device(lua_State* L) {
  const std::string name = lua_isnoneornil(L, 1) ? "auto" : check_string(L, 1, "resolve_device");
  const std::string label = lua_isnoneornil(L, 2) ? "wick.device" : check_string(L, 2, "resolve_device");
  const std::string d = resolve_device_option(label, name, dist_env());
  lua_pushlstring(L, d.data(), d.size());
  return 1;
}

int core_cuda_available(lua_State* L) {
  lua_pushboolean(L, cuda_available());
  return 1;
}

}  // namespace

void open_train(lua_State* L) {
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
                                             {"save_ema", G(trainer_save_ema)},
                                             {"finish", G(trainer_finish)},
                                             {"evaluate", G(trainer_evaluate)},
                                             {"load", G(trainer_load)},
                                             {"skipped_steps", G(trainer_skipped_steps)},
                                             {"split", G(trainer_split)},
                                             {"loss_scale", G(trainer_loss_scale)},
                                             {"checkpointed_blocks", G(trainer_checkpointed_blocks)},
                                             {"probe", G(trainer_probe)},
                                             {"memory_breakdown", G(trainer_memory_breakdown)},
                                             {nullptr, nullptr}};
  new_metatable<Loader>(L, kLoaderMt, loader_methods);
  new_metatable<Trainer>(L, kTrainerMt, trainer_methods);
  static const luaL_Reg fns[] = {{"loader", G(make_loader)},
                                 {"trainer", G(make_trainer)},
                                 {"train", G(core_train)},
                                 {"describe_train", G(core_describe_train)},
                                 {"evaluate", G(core_evaluate)},
                                 {"latest_checkpoint", G(core_latest_checkpoint)},
                                 {"seed", G(core_seed)},
                                 {"interrupted", G(core_interrupted)},
                                 {"memory", G(core_memory)},
                                 {"cuda_available", G(core_cuda_available)},
                                 {"save_samples", G(core_save_samples)},
                                 {"dist", G(core_dist)},
                                 {"check_same", G(core_check_same)},
                                 {"copy_tensors", G(core_copy_tensors)},
                                 {"predict", G(core_predict)},
                                 {"gradients", G(core_gradients)},
                                 {"set_memory_limit", G(core_set_memory_limit)},
                                 {"reset_peak", G(core_reset_peak)},
                                 {"device_memory", G(core_device_memory)},
                                 {"resolve_device", G(core_resolve_device)},
                                 {nullptr, nullptr}};
  luaL_register(L, nullptr, fns);
}

}  // namespace wick::lua
