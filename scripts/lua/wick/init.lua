-- The `wick` package: plugins, the step-level primitives and wick.train.
--   local wick = require "wick"
-- Everything here is plain Lua over `wick.core`, the engine's bindings.
local core = require "wick.core"

local wick = {}

wick.core = core
--- The key=value pairs given after the recipe on the command line. Reads go
-- through a proxy that notes each key read in the run context (pairs() reads
-- them all), so that a key the recipe never reads and no wick.train option
-- takes is named in a warning when the recipe ends (or at wick.train's start,
-- if no option of wick.train or of a plugin has its name: a likely typo).
local arg_values = core.args()
wick.args = setmetatable({}, {
  __index = function(_, k)
    if type(k) == "string" then core.arg_read(k) end
    return arg_values[k]
  end,
  __newindex = function(_, k, v) arg_values[k] = v end,
  __pairs = function()
    for k in next, arg_values do
      if type(k) == "string" then core.arg_read(k) end
    end
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

--- The device a name stands for, resolved as wick.train resolves its device
-- option: "auto" (or nil) is this rank's GPU (cuda, or cuda:N with several
-- ranks) when CUDA is usable, else cpu; another name is checked and returned.
function wick.device(name) return core.resolve_device(name) end

--- Loss and metrics over a whole data set, without gradients.
-- opts: micro_batch (default 32), device (default "auto").
function wick.evaluate(model, data, opts)
  opts = opts or {}
  return core.evaluate(model, data, opts.micro_batch or 32, core.resolve_device(opts.device, "wick.evaluate"))
end

--- A Hugging Face tokenizer: wick.tokenizer(path) with path a model folder
-- holding tokenizer.json, a tokenizer.json, or "bytes". :encode(text,
-- {add_special_tokens}), :decode(ids, {skip_special_tokens}),
-- :apply_chat_template(messages, {add_generation_prompt, tokenize, ...}) through
-- the folder's chat template (chat_template.jinja, else tokenizer_config.json's),
-- :token_id(token); .eos_token, .eos_id, .bos_token, .bos_id, .pad_token, .pad_id,
-- .vocab_size, .chat_template.
wick.tokenizer = core.tokenizer

-- A Hugging Face folder's tokenizer files, which save_pretrained copies from
-- the folder the model came from (or the tokenizer folder given)
local TOKENIZER_FILES = { "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                          "chat_template.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                          -- a vision-language model's image processor and processor
                          "preprocessor_config.json", "processor_config.json" }
-- Files an earlier save may have left that describe another model: removed when a whole model's save
-- writes none (an adapter folder beside the weights would make transformers load the adapter's base)
local SAVED_FILES = { "generation_config.json", "model.safetensors.index.json", "adapter_config.json",
                      "adapter_model.safetensors" }

local read_all = require("wick.runlog").read_file  -- a file's bytes, or nil

local function is_dir(path)
  return core.list_dir(path) ~= nil
end

-- generation_config.json from config.json's special token ids, as
-- transformers' GenerationConfig.from_model_config takes them
local function generation_config(cfg_text)
  local cfg = core.json_decode(cfg_text)
  -- a vision-language model's ids are its language model's
  if cfg.text_config and cfg.bos_token_id == nil and cfg.eos_token_id == nil then cfg = cfg.text_config end
  local lines = {}
  for _, k in ipairs({ "bos_token_id", "eos_token_id", "pad_token_id" }) do
    if cfg[k] ~= nil then lines[#lines + 1] = '  "' .. k .. '": ' .. core.json(cfg[k]) end
  end
  if #lines == 0 then return nil end
  return "{\n" .. table.concat(lines, ",\n") .. "\n}\n"
end

--- A model folder that `transformers` and `wick generate` read as they read
-- the folder it came from: config.json (for models that describe one, like
-- decoder_lm, with its special token ids), model.safetensors,
-- generation_config.json (the source folder's, else the config's ids), and
-- the tokenizer files and chat template of the source folder (TOKENIZER_FILES).
-- `tokenizer` replaces those: a tokenizer folder (its files), or a
-- tokenizer.json (that file alone). The options (a table, fourth argument or
-- in place of the tokenizer): tokenizer, merge. 4-bit NF4 layers (quantize =
-- "nf4", qlora) are written dequantized to the model's dtype. A model
-- carrying LoRA adapters needs merge: true writes the whole model with the
-- adapters folded in (the model in memory keeps them), as PEFT's
-- merge_and_unload() then save_pretrained; false writes the adapters alone as
-- PEFT's save_pretrained does (adapter_config.json, whose
-- base_model_name_or_path is the folder the model was read from, and
-- adapter_model.safetensors) with the tokenizer files, for
-- peft.PeftModel.from_pretrained(base, dir). Everything is read and checked
-- first and written into a folder beside `dir`, renamed into place when
-- whole: an error leaves no half-written folder. Called from every rank, rank
-- 0 writes the folder and the others go on (after the same checks, so a
-- model that cannot be saved fails on every rank).
function wick.save_pretrained(model, dir, tokenizer, opts)
  if type(tokenizer) == "table" and opts == nil then opts, tokenizer = tokenizer, tokenizer.tokenizer end
  opts = opts or {}
  if type(opts) ~= "table" then
    error(core.where() .. "save_pretrained: expected a table of options (tokenizer, merge) after the tokenizer, got a "
          .. type(opts), 0)
  end
  for k in pairs(opts) do
    if k ~= "tokenizer" and k ~= "merge" then
      error(core.where() .. "save_pretrained: unknown option '" .. tostring(k) .. "', expected tokenizer or merge", 0)
    end
  end
  local merge = opts.merge
  if merge ~= nil and type(merge) ~= "boolean" then
    error(core.where() .. "save_pretrained: merge is " .. tostring(merge) .. ", expected true (the adapters folded "
          .. "into the weights) or false (the adapters alone, as PEFT saves them)", 0)
  end
  local adapters, adapted = core.adapters_of(model)
  if adapted > 0 and merge == nil then
    error(core.where() .. "save_pretrained: " .. adapted .. " linear layers of the model carry LoRA adapters, "
          .. "expected merge = true (one model with the adapters folded into its weights, which transformers loads "
          .. "alone) or merge = false (the adapters alone, adapter_config.json and adapter_model.safetensors, which "
          .. "peft.PeftModel.from_pretrained loads over the base model)", 0)
  end
  if merge == false and (adapted == 0 or not adapters) then
    error(core.where() .. "save_pretrained: merge = false saves a model's LoRA adapters alone, but the model "
          .. "carries none, expected merge left out (the whole model is saved)", 0)
  end
  local adapters_only = merge == false
  local cfg = model.hf_config
  if not cfg and not adapters_only then
    local why = model.hf_config_refused
    error(core.where() .. "save_pretrained: this model has no Hugging Face config"
          .. (why and (": transformers' class for it cannot describe " .. why) or ""), 0)
  end
  dir = tostring(dir):gsub("(.)/+$", "%1")
  local there = io.open(dir, "rb")
  if there then
    there:close()
    if not is_dir(dir) then
      error(core.where() .. "save_pretrained: " .. dir .. " is a file, expected a folder to write (or a path where "
            .. "none is yet)", 0)
    end
  end
  -- what the folder will hold besides the weights: { name, bytes }
  local files = adapters_only and {} or { { "config.json", cfg .. "\n" } }
  local source = model.source_path
  if source == "" then source = nil end
  local tok_dir
  if tokenizer ~= nil then
    tokenizer = tostring(tokenizer)
    if is_dir(tokenizer) then
      tok_dir = tokenizer
      if not read_all(tokenizer .. "/tokenizer.json") then
        error(core.where() .. "save_pretrained: the tokenizer folder " .. tokenizer .. " has no tokenizer.json, "
              .. "expected a folder holding one (with its tokenizer_config.json and chat template) or a tokenizer.json", 0)
      end
    else
      local f, err = io.open(tokenizer, "rb")
      if not f then error(core.where() .. "save_pretrained: cannot read the tokenizer " .. tostring(err), 0) end
      files[#files + 1] = { "tokenizer.json", f:read("*a") }
      f:close()
    end
  else
    tok_dir = source
  end
  if tok_dir then
    for _, name in ipairs(TOKENIZER_FILES) do
      local bytes = read_all(tok_dir .. "/" .. name)
      if bytes then files[#files + 1] = { name, bytes } end
    end
  end
  -- a model made from options, saved with a tokenizer folder: the special
  -- token ids its config lacks, from the tokenizer's (transformers' generate
  -- stops at eos_token_id); a model read from a folder keeps that folder's
  if not source and tok_dir and not adapters_only then
    local tok = core.tokenizer(tok_dir)
    local have, add = core.json_decode(cfg), {}
    for _, k in ipairs({ "bos", "eos", "pad" }) do
      local id = tok[k .. "_id"]
      if have[k .. "_token_id"] == nil and id then add[#add + 1] = '  "' .. k .. '_token_id": ' .. id .. ",\n" end
    end
    if #add > 0 then
      cfg = cfg:gsub("^{\n", "{\n" .. table.concat(add), 1)
      files[1] = { "config.json", cfg .. "\n" }
    end
  end
  local gen = not adapters_only and source and read_all(source .. "/generation_config.json")
  if gen then
    local ok, err = pcall(core.json_decode, gen, source .. "/generation_config.json")
    if not ok then
      local where = core.where()
      if err:sub(1, #where) == where then err = err:sub(#where + 1) end
      error(where .. "save_pretrained: " .. err, 0)
    end
  elseif not adapters_only then
    gen = generation_config(cfg)
  end
  if gen then files[#files + 1] = { "generation_config.json", gen } end
  if not wick.is_main() then return end

  -- written beside the folder, then renamed into place
  local parent = dir:match("^(.*)/[^/]*$")
  if parent and parent ~= "" then core.mkdirs(parent) end
  local stage = dir .. ".saving-" .. core.process().pid
  local function clear_stage()
    local entries = core.list_dir(stage)
    for _, e in ipairs(entries or {}) do os.remove(stage .. "/" .. e.name) end
    os.remove(stage)
  end
  clear_stage()
  core.mkdirs(stage)
  local ok, err = pcall(function()
    for _, f in ipairs(files) do core.write_file(stage .. "/" .. f[1], f[2]) end
    if adapters_only then
      adapters:save(model, stage)
      -- PEFT names the base the adapters go over: the folder the model was read from
      if source then
        local path = stage .. "/adapter_config.json"
        local text = read_all(path):gsub('"base_model_name_or_path": null',
                                         function() return '"base_model_name_or_path": ' .. core.json(source) end, 1)
        core.write_file(path, text)
      end
    else
      core.save_pretrained_weights(model, stage .. "/model.safetensors", merge)
    end
  end)
  if not ok then
    clear_stage()
    error(err, 0)  -- the writer's message, with the recipe's line
  end
  if not is_dir(dir) then
    local renamed, why = os.rename(stage, dir)
    if not renamed then
      clear_stage()
      error(core.where() .. "save_pretrained: cannot rename the saved folder into " .. dir .. ": " .. tostring(why), 0)
    end
    return
  end
  -- a folder already there: each file renamed over its old self (each
  -- rename atomic); a generation config or shard index an earlier save left
  -- and this one does not write is removed (another model's ids, shards)
  local written = {}
  for _, f in ipairs(core.list_dir(stage)) do written[f.name] = true end
  for _, name in ipairs(core.list_dir(stage)) do
    local renamed, why = os.rename(stage .. "/" .. name.name, dir .. "/" .. name.name)
    if not renamed then
      clear_stage()
      error(core.where() .. "save_pretrained: cannot move " .. name.name .. " into " .. dir .. ": " .. tostring(why), 0)
    end
  end
  os.remove(stage)
  if adapters_only then return end  -- the folder may hold the base model, which stays
  for _, name in ipairs(SAVED_FILES) do
    if not written[name] then os.remove(dir .. "/" .. name) end
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

--- wick.profile(fn [, {trace = "profile.json", steps = N}]) -> summary, fn's results
-- Runs fn under PyTorch's profiler (a custom loop's steps, or any code; wick.train
-- has its own `profile` option): the trace written whole to `trace` if given (for
-- Perfetto or chrome://tracing), and where the time went, per step over `steps`
-- (default 1: the whole call): {steps, seconds_per_step, phases_ms = {data, forward,
-- backward, optimizer, step}, host_ops, on a GPU device_ops, device_ms_per_step and
-- cuda_runtime, trace (nil without one), trace_error (one that could not be
-- written), text (the lines wick.train prints)}. One profile at a time in a process.
local profile_keys = { trace = true, steps = true }
function wick.profile(fn, opts)
  local where = core.where() .. "wick.profile: "
  if type(fn) ~= "function" then
    error(where .. "expected a function to run under the profiler, got " .. type(fn), 0)
  end
  if opts ~= nil and type(opts) ~= "table" then
    error(where .. "expected a table of options (trace, steps) after the function, got " .. type(opts), 0)
  end
  opts = opts or {}
  for k in pairs(opts) do
    if not profile_keys[k] then
      error(where .. "unknown option '" .. tostring(k) .. "', expected trace (a file for the trace) or steps (the "
        .. "steps the call holds)", 0)
    end
  end
  if opts.trace ~= nil and (type(opts.trace) ~= "string" or opts.trace == "") then
    error(where .. "trace is " .. tostring(opts.trace) .. ", expected the path of a file to write the trace to", 0)
  end
  local steps = opts.steps or 1
  if type(steps) ~= "number" or steps < 1 or steps ~= math.floor(steps) or steps > 2 ^ 53 then
    error(where .. "steps is " .. tostring(steps) .. ", expected a whole number >= 1 (the steps the call holds: "
      .. "the summary's figures are per step)", 0)
  end
  core.profile_start()
  local results = { pcall(fn) }
  if not results[1] then
    core.profile_abort()
    error(results[2], 0)
  end
  return core.profile_stop(opts.trace, steps), unpack(results, 2, table.maxn(results))
end

--- wick.train{...}: see `wick describe train`.
function wick.train(cfg)
  return require("wick.train").train(cfg)
end

-- Runs start from the same weights: seed 0 unless seed=N is on the command
-- line, read as wick.train's seed option reads it (a whole number >= 0).
if rawget(arg_values, "seed") ~= nil then core.arg_read("seed") end
core.seed(core.run_option_arg("seed") or 0)

return wick
