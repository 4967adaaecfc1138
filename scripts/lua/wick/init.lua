-- The `wick` package: plugins, the step-level primitives and wick.train.
--   local wick = require "wick"
-- Everything here is plain Lua over `wick.core`, the engine's bindings.
local core = require "wick.core"

local wick = {}

wick.core = core
--- The key=value pairs given after the recipe on the command line. Reads go
-- through a proxy that notes each key read (pairs() reads them all), so that
-- a key no wick.train option takes and the recipe never reads is named in a
-- warning, at wick.train's start and when the recipe ends.
local arg_values, args_used = core.args()
wick.args = setmetatable({}, {
  __index = function(_, k)
    args_used[k] = true
    return arg_values[k]
  end,
  __newindex = function(_, k, v) arg_values[k] = v end,
  __pairs = function()
    for k in next, arg_values do args_used[k] = true end
    return next, arg_values, nil
  end,
})

-- pairs() honours __pairs as in Lua 5.2 (LuaJIT does only when built with
-- 5.2 compatibility), so `for k, v in pairs(wick.args)` sees the pairs.
do
  local raw_pairs = pairs
  local probe = false
  for _ in raw_pairs(setmetatable({}, { __pairs = function() probe = true return next, {}, nil end })) do end
  if not probe then
    function pairs(t)
      local mt = getmetatable(t)
      local f = type(mt) == "table" and rawget(mt, "__pairs")
      if f then return f(t) end
      return raw_pairs(t)
    end
  end
end

--- This process among the ranks (torchrun-style variables or SLURM's):
-- wick.rank, wick.world_size, wick.local_rank (0, 1, 0 for one process);
-- wick.is_main(): whether this is rank 0, the rank that writes the run's
-- files and what model:save and wick.save_pretrained write.
local dist = core.dist()
wick.rank, wick.world_size, wick.local_rank = dist.rank, dist.world_size, dist.local_rank
function wick.is_main() return wick.rank == 0 end

--- Plugins: wick.model(name, opts), wick.data(name, opts), wick.optim(name, opts).
-- `name` is a plugin name or a path to a plugin .so.
wick.model = core.model
wick.data = core.data
wick.optim = core.optim

--- wick.schedule("cosine", {warmup_steps = 10}) is wick.optim("schedule", {type = "cosine", ...}).
function wick.schedule(type_, opts)
  local o = {}
  for k, v in pairs(opts or {}) do o[k] = v end
  o.type = type_
  return core.optim("schedule", o)
end

--- Step-level primitives, for custom loops (see examples/custom_loop).
-- wick.loader(data, {micro_batch, accumulate, shuffle, seed, drop_last, workers, prefetch, pin_memory})
--   :windows_per_epoch(), :start_epoch(epoch, first_window), :next() -> window or nil, :position()
wick.loader = core.loader
-- wick.trainer{model, optim, schedule, clip_grad_norm, total_steps, device}
--   :step(window) -> {step, loss, items, lr, grad_norm, seconds, <metrics>}
--   :save(checkpoints_dir, extra_table, keep) -> folder, :load(folder) -> extra_table, :steps()
--   :save_ema(file): with ema = 0.999, the model with the averaged weights (model:load reads it)
--   :evaluate(data, micro_batch) -> {loss, items, <metrics>}: the model on the trainer's device and precision
--   :finish(): shard = "parameters": the divided weights back into the model, on every rank at once (no step after)
wick.trainer = core.trainer
wick.latest_checkpoint = core.latest_checkpoint
wick.seed = core.seed
wick.memory = core.memory
wick.plugins = core.plugins
wick.json = core.json

--- Samples as the loader reads them in an epoch, written as safetensors
-- ("<i>.<name>"): wick.save_samples(data, {0, 1, 2}, "s.safetensors", {epoch = 0, seed = 0}).
function wick.save_samples(data, indices, path, opts)
  opts = opts or {}
  core.save_samples(data, indices, path, opts.epoch or 0, opts.seed or 0)
end

--- true (and the signal number) once SIGINT or SIGTERM arrived.
function wick.interrupted() return core.interrupted() end

--- The device "auto" stands for: cuda when usable, else cpu.
function wick.device(name)
  if name == nil or name == "auto" then return core.cuda_available() and "cuda" or "cpu" end
  return name
end

--- Loss and metrics over a whole data set, without gradients.
-- opts: micro_batch (default 32), device (default "auto").
function wick.evaluate(model, data, opts)
  opts = opts or {}
  return core.evaluate(model, data, opts.micro_batch or 32, wick.device(opts.device))
end

--- A tokenizer as transformers' AutoTokenizer gives one: `path` is a model
-- folder (its tokenizer.json, and the chat template of its
-- chat_template.jinja or tokenizer_config.json), a tokenizer.json, or
-- "bytes". It is data "text" with no sources: tok:encode(text,
-- {add_special_tokens}), tok:decode(ids, {skip_special_tokens}),
-- tok:apply_chat_template(messages, {add_generation_prompt, tokenize, ...}).
function wick.tokenizer(path)
  if type(path) ~= "string" then
    error(core.where() .. "bad argument #1 to 'tokenizer' (a model folder or a tokenizer.json expected, got "
          .. type(path) .. ")", 0)
  end
  return core.data("text", { tokenizer = path })
end

--- A model folder that `transformers` and `wick generate` read: config.json
-- (for models that describe one, like decoder_lm) and model.safetensors;
-- `tokenizer` (a tokenizer.json path) is copied beside them. Called from
-- every rank, rank 0 writes the folder and the others go on (after the same
-- checks, so a model that cannot be saved fails on every rank).
function wick.save_pretrained(model, dir, tokenizer)
  local cfg = model.hf_config
  if not cfg then error(core.where() .. "save_pretrained: this model has no Hugging Face config", 0) end
  -- 4-bit layers would be written as nf4.* tensors, which neither
  -- transformers nor a model without quantize loads as weights
  local nf4 = model.nf4_layers or 0
  if nf4 > 0 then
    error(core.where() .. "save_pretrained: " .. nf4 .. " linear layers of the model are 4-bit NF4 (quantize = \"nf4\"), "
      .. "which transformers does not load, expected float layers: merge the adapters first "
      .. "(qlora:merge(model) turns the layers it adapted back into float weights), or save the adapters alone "
      .. "(qlora:save(model, dir)), or load the model without quantize to save it whole", 0)
  end
  local f
  if tokenizer then
    local err
    f, err = io.open(tokenizer, "rb")
    if not f then error(core.where() .. "save_pretrained: cannot read the tokenizer " .. tostring(err), 0) end
  end
  if not wick.is_main() then
    if f then f:close() end
    return
  end
  core.mkdirs(dir)
  core.write_file(dir .. "/config.json", cfg .. "\n")
  model:save(dir .. "/model.safetensors")
  if f then
    core.write_file(dir .. "/tokenizer.json", f:read("*a"))
    f:close()
  end
end

--- Memory presets (configs/presets): wick.preset("gpu_8gb") is the preset's
-- table; wick.preset("gpu_8gb", {model = m, ...}) is a copy with the recipe's
-- options on top (the recipe wins).
local presets_dir = (debug.getinfo(1, "S").source:match("^@(.*)/lua/wick/init%.lua$") or ".") .. "/presets"
function wick.preset(name, overrides)
  if type(name) ~= "string" or not name:match("^[%w_%-]+$") then
    error(core.where() .. "wick.preset: expected a preset name such as gpu_8gb, got " .. tostring(name), 0)
  end
  local path = presets_dir .. "/" .. name .. ".lua"
  local chunk = loadfile(path)
  if not chunk then
    local names = {}
    local p = io.popen('ls "' .. presets_dir .. '" 2>/dev/null')
    if p then
      for f in p:lines() do names[#names + 1] = f:match("^(.*)%.lua$") end
      p:close()
    end
    error(core.where() .. "wick.preset: no preset '" .. name .. "' (presets: " .. table.concat(names, ", ") .. ")", 0)
  end
  local t = {}
  for k, v in pairs(chunk()) do t[k] = v end
  for k, v in pairs(overrides or {}) do t[k] = v end
  return t
end

--- wick.train{...}: see `wick describe train`.
function wick.train(cfg)
  return require("wick.train").train(cfg)
end

-- Runs start from the same weights: seed 0 unless seed=N is on the command
-- line, read as wick.train's seed option reads it (a whole number >= 0).
if rawget(arg_values, "seed") ~= nil then args_used.seed = true end
core.seed(core.run_option_arg("seed") or 0)

return wick
