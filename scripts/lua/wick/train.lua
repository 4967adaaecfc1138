-- wick.train: the standard loop, written with the step-level primitives.
local core = require "wick.core"
local runlog = require "wick.runlog"
local fmt_bytes, fmt_time, read_json = runlog.fmt_bytes, runlog.fmt_time, runlog.read_json

local M = {}

-- name, type, default, doc. nil default: optional / required as the doc says.
M.options = {
  { "model", "object", nil, "model (wick.model); required" },
  { "data", "object", nil, "training data (wick.data); required" },
  { "optim", "object", nil, "optimizer (wick.optim); required" },
  { "schedule", "any", nil, "schedule object (wick.schedule) or 'constant' | 'linear' | 'cosine'" },
  { "warmup_steps", "number", 0, "warmup steps when schedule is given by name" },
  { "micro_batch", "any", 1, "samples per micro-batch (per rank), or 'auto': the largest that fits, found by probing (needs batch_size)" },
  { "accumulate", "number", 1, "micro-batches per optimizer step" },
  { "batch_size", "number", nil, "effective batch (micro_batch x accumulate x ranks) that micro_batch = 'auto' keeps" },
  { "epochs", "number", 1, "passes over the data" },
  { "max_steps", "number", 0, "stop after this many optimizer steps (0: no limit)" },
  { "drop_last", "boolean", false, "drop an epoch's last short window instead of stepping with its true item count" },
  { "shuffle", "boolean", true, "shuffle the data each epoch (by seed and epoch)" },
  { "seed", "number", 0, "seed for data order and random layers" },
  { "workers", "number", 0, "data worker threads (0: load on the training thread)" },
  { "prefetch", "number", 2, "micro-batches loaded ahead, at most" },
  { "precision", "string", "fp32", "fp32, bf16-mixed, fp16-mixed (autocast, fp32 master weights), bf16-true, fp16-true (half-precision weights)" },
  { "loss_scale", "any", nil, "fp16: a number (fixed scale) or {init = 65536, growth = 2, backoff = 0.5, interval = 2000} (dynamic, the default)" },
  { "checkpointing", "any", false, "activation checkpointing: false, true (every block the model declares), k (every k-th block) or a list of block names" },
  { "clip_grad_norm", "number", 0, "clip the global gradient norm to this, after unscaling (0: off; the norm is logged anyway)" },
  { "clip_grad_value", "number", 0, "clamp every gradient element to [-v, v], after unscaling (0: off)" },
  { "on_oom", "string", "split", "out of memory in a window: 'split' halves the micro-batch, doubles accumulate and redoes the window; 'fail' stops" },
  { "empty_cache_every", "number", 0, "CUDA: return cached memory to the device every N steps (0: never; no effect on cpu)" },
  { "memory_fraction", "number", 0, "CUDA: cap this process at this fraction of the device's memory (0: no cap; no effect on cpu)" },
  { "device", "string", "auto", "cpu, cuda, cuda:N or auto (cuda:LOCAL_RANK with several ranks)" },
  { "bucket_mb", "number", 25, "gradient all-reduce bucket size across ranks, MiB" },
  { "sync", "string", "window", "gradients cross ranks once per 'window' (with the last backward) or every 'micro_batch' (same result, more traffic)" },
  { "out", "string", nil, "run folder: metrics.jsonl, checkpoints/, run.json (nil: nothing written)" },
  { "save_every", "number", 0, "checkpoint every N steps (0: only at the end); needs out" },
  { "keep_checkpoints", "number", 3, "newest checkpoints kept" },
  { "resume", "boolean", false, "continue from the newest checkpoint in out/checkpoints" },
  { "eval_data", "object", nil, "evaluation data (wick.data)" },
  { "eval_every", "number", 0, "evaluate every N steps (0: only at the end)" },
  { "eval_micro_batch", "number", nil, "micro-batch for evaluation (default micro_batch * accumulate)" },
  { "log_every", "number", 10, "progress line every N steps when stderr is not a terminal" },
  { "quiet", "boolean", false, "no progress line or summary (ranks other than 0 are always quiet)" },
}

local by_name = {}
for _, o in ipairs(M.options) do by_name[o[1]] = o end

local function fail(msg) error(core.where() .. "wick.train: " .. msg, 0) end

function M.describe()
  print("wick.train options:")
  for _, o in ipairs(M.options) do
    local def = o[3] == nil and "" or (" default " .. tostring(o[3]))
    print(string.format("  %-18s %-8s%s\n      %s", o[1], o[2], def, o[4]))
  end
end

-- Validates cfg against M.options, fills defaults and applies command-line
-- overrides (wick run recipe.lua epochs=3 resume=true).
local function resolve(cfg)
  if type(cfg) ~= "table" then fail("expected a table of options, got " .. type(cfg)) end
  local c = {}
  for k, v in pairs(cfg) do
    local o = by_name[k]
    if not o then
      local names = {}
      for _, x in ipairs(M.options) do names[#names + 1] = x[1] end
      fail("unknown option '" .. tostring(k) .. "' (known options: " .. table.concat(names, ", ") .. ")")
    end
    c[k] = v
  end
  local args = core.args()
  local overridden = {}
  for k, v in pairs(args) do
    local o = by_name[k]
    if o and (o[2] == "number" or o[2] == "boolean" or o[2] == "string") and c[k] ~= v then
      c[k] = v
      overridden[#overridden + 1] = k .. "=" .. tostring(v)
    end
  end
  if #overridden > 0 and not c.quiet then
    table.sort(overridden)
    io.stderr:write("wick.train: from the command line: " .. table.concat(overridden, " ") .. "\n")
  end
  for _, o in ipairs(M.options) do
    local name, ty, def = o[1], o[2], o[3]
    if c[name] == nil then c[name] = def end
    local v = c[name]
    if v ~= nil and ty ~= "any" then
      local got = type(v)
      if ty == "object" then
        if got ~= "userdata" then fail("option '" .. name .. "': expected a wick object, got " .. got) end
      elseif got ~= ty then
        fail("option '" .. name .. "': expected " .. ty .. ", got " .. got .. " " .. tostring(v))
      end
    end
  end
  for _, req in ipairs { "model", "data", "optim" } do
    if c[req] == nil then fail("option '" .. req .. "' is required") end
  end
  local function positive_int(name, min)
    local v = c[name]
    if v ~= math.floor(v) or v < min then
      fail("option '" .. name .. "': expected an integer >= " .. min .. ", got " .. tostring(v))
    end
  end
  if c.micro_batch == "auto" then
    if c.batch_size == nil then
      fail("option 'micro_batch': 'auto' needs batch_size, the effective batch to keep (micro_batch x accumulate x ranks)")
    end
    positive_int("batch_size", 1)
  elseif type(c.micro_batch) ~= "number" then
    fail("option 'micro_batch': expected an integer >= 1 or 'auto', got " .. type(c.micro_batch) .. " " .. tostring(c.micro_batch))
  else
    positive_int("micro_batch", 1)
    if c.batch_size ~= nil then fail("option 'batch_size' goes with micro_batch = 'auto'; with micro_batch given, set accumulate") end
  end
  positive_int("accumulate", 1); positive_int("epochs", 1)
  positive_int("empty_cache_every", 0)
  positive_int("max_steps", 0); positive_int("save_every", 0); positive_int("eval_every", 0)
  positive_int("workers", 0); positive_int("prefetch", 1); positive_int("log_every", 1)
  positive_int("keep_checkpoints", 1); positive_int("warmup_steps", 0)
  if c.clip_grad_norm < 0 then fail("option 'clip_grad_norm': expected a number >= 0, got " .. c.clip_grad_norm) end
  local precisions = { fp32 = true, ["bf16-mixed"] = true, ["fp16-mixed"] = true, ["bf16-true"] = true, ["fp16-true"] = true }
  if not precisions[c.precision] then
    fail("option 'precision': expected fp32, bf16-mixed, fp16-mixed, bf16-true or fp16-true, got " .. c.precision)
  end
  if c.clip_grad_value < 0 then fail("option 'clip_grad_value': expected a number >= 0, got " .. c.clip_grad_value) end
  if c.memory_fraction < 0 or c.memory_fraction > 1 then
    fail("option 'memory_fraction': expected a fraction in (0, 1] of the device's memory (0: no cap), got " .. c.memory_fraction)
  end
  if c.on_oom ~= "split" and c.on_oom ~= "fail" then fail("option 'on_oom': expected split or fail, got " .. c.on_oom) end
  local ck = c.checkpointing
  if type(ck) == "number" then
    if ck ~= math.floor(ck) or ck < 1 then
      fail("option 'checkpointing': expected true, false, an integer k >= 1 (every k-th block) or a list of block names, got " .. ck)
    end
  elseif type(ck) == "table" then
    local blocks = c.model:blocks()
    local known = {}
    for _, b in ipairs(blocks) do known[b] = true end
    for _, n in ipairs(ck) do
      if not known[n] then
        fail("option 'checkpointing': the model has no block '" .. tostring(n) .. "' (its blocks: " ..
          (#blocks > 0 and table.concat(blocks, ", ") or "none") .. ")")
      end
    end
  elseif type(ck) ~= "boolean" then
    fail("option 'checkpointing': expected true, false, an integer k >= 1 or a list of block names, got " .. type(ck))
  end
  if ck ~= false and #c.model:blocks() == 0 then
    fail("option 'checkpointing': the model declares no blocks to checkpoint")
  end
  local ls = c.loss_scale
  if ls ~= nil then
    if type(ls) == "number" then
      if not (ls > 0) or ls == math.huge then fail("option 'loss_scale': expected a fixed scale > 0, got " .. ls) end
    elseif type(ls) ~= "table" then
      fail("option 'loss_scale': expected a number (fixed) or a table {init, growth, backoff, interval}, got " .. type(ls))
    end
    if c.precision ~= "fp16-mixed" and c.precision ~= "fp16-true" and c.rank0 ~= false then
      io.stderr:write("wick.train: loss_scale applies to fp16 precisions only; with " .. c.precision .. " it has no effect\n")
    end
  end
  if c.sync ~= "window" and c.sync ~= "micro_batch" then
    fail("option 'sync': expected window or micro_batch, got " .. c.sync)
  end
  if c.resume and not c.out then fail("option 'resume' needs 'out', the run folder to resume from") end
  if c.save_every > 0 and not c.out then fail("option 'save_every' needs 'out', the run folder to save in") end
  if type(c.schedule) == "string" then
    local ok, s = pcall(core.optim, "schedule", { type = c.schedule, warmup_steps = c.warmup_steps })
    if not ok then fail("option 'schedule': " .. tostring(s)) end
    c.schedule = s
  end
  local dist = core.dist()
  if c.device == "auto" then
    c.device = core.cuda_available() and (dist.world_size > 1 and ("cuda:" .. dist.local_rank) or "cuda") or "cpu"
  end
  c.dist = dist
  c.rank0 = dist.rank == 0
  if c.micro_batch ~= "auto" then c.eval_micro_batch = c.eval_micro_batch or c.micro_batch * c.accumulate end
  return c
end

local function memory_now(cuda)
  local m = core.memory(cuda)
  return m, (m.cuda_allocated and m.cuda_peak) or m.peak_resident
end

-- The step record's memory fields: allocated, reserved and peak on CUDA;
-- resident and peak resident, and the bytes held by tensors, on the CPU.
local function add_memory(rec, m)
  if m.cuda_allocated then
    rec.mem_allocated, rec.mem_reserved, rec.mem_peak = m.cuda_allocated, m.cuda_reserved, m.cuda_peak
  else
    rec.mem_resident, rec.mem_peak_resident = m.resident, m.peak_resident
    rec.mem_tensors, rec.mem_tensors_peak = m.cpu_tensors, m.cpu_tensors_peak
  end
end

-- FNV-1a of a string, as 8 hex digits.
local function fnv1a(str)
  local bit = require "bit"
  local h = 0x811c9dc5
  for i = 1, #str do
    h = bit.bxor(h, str:byte(i))
    h = bit.tobit(h * 0x01000193)
  end
  return bit.tohex(h)
end

-- What every rank must agree on: the recipe's text and the resolved options.
local function fingerprint(c)
  local text = ""
  local f = arg and arg[0] and io.open(arg[0], "rb")
  if f then text = f:read("*a"); f:close() end
  local keys = {}
  for _, o in ipairs(M.options) do
    local v = c[o[1]]
    -- device, quiet and log_every differ between ranks by design (only rank 0 prints)
    local local_only = o[1] == "device" or o[1] == "quiet" or o[1] == "log_every"
    if type(v) ~= "userdata" and type(v) ~= "table" and not local_only and v ~= nil then
      keys[#keys + 1] = o[1] .. "=" .. tostring(v)
    end
  end
  local np = c.model:parameters()
  return string.format("recipe %s, data %d samples, model %d parameters, %s", fnv1a(text), c.data:size(), np,
    table.concat(keys, " "))
end

local function peak_of(m)
  return m.cuda_peak or m.cpu_tensors_peak
end

--- micro_batch = "auto": the largest micro-batch dividing the rank's share of
-- the batch whose forward and backward fit the device's memory (probed on the
-- data's first samples), with 10% to spare and room for the optimizer state
-- it will allocate and, with accumulation, for the summed gradients. Returns
-- micro_batch, accumulate.
function M.fit_micro_batch(trainer, c, per_rank)
  local avail = core.device_memory(c.device)
  local say = function(msg) if not c.quiet then io.stderr:write("wick.train: micro_batch auto: ", msg, "\n") end end
  if avail == 0 then
    say(string.format("no memory limit known on %s (WICK_CPU_MEMORY_LIMIT sets one): micro_batch %d", c.device, per_rank))
    return per_rank, 1
  end
  if c.memory_fraction > 0 then avail = avail * c.memory_fraction end
  local budget = avail * 0.9
  local tried = {}
  local m = per_rank
  while m >= 1 do
    if per_rank % m == 0 and m <= c.data:size() then
      local bd = trainer:memory_breakdown()
      -- optimizer state not yet allocated, and with accumulation the summed
      -- gradients a later micro-batch holds beside its own
      local opt_extra = math.max(0, bd.optimizer_expected - bd.optimizer) + (m < per_rank and bd.trainable or 0)
      core.reset_peak()
      local ok, err = trainer:probe(c.data:window(0, m))
      local peak = peak_of(core.memory(c.device:sub(1, 4) == "cuda"))
      if ok and peak + opt_extra <= budget then
        tried[#tried + 1] = string.format("%d fits (%s + %s optimizer state of %s)", m, fmt_bytes(peak),
          fmt_bytes(opt_extra), fmt_bytes(avail))
        say(table.concat(tried, ", ") .. string.format(": micro_batch %d x accumulate %d keeps the batch of %d",
          m, per_rank / m, c.batch_size))
        return m, per_rank / m
      end
      tried[#tried + 1] = ok and string.format("%d needs %s", m, fmt_bytes(peak + opt_extra)) or
        string.format("%d runs out of memory", m)
    end
    m = m - 1
    while m >= 1 and per_rank % m ~= 0 do m = m - 1 end
  end
  fail("micro_batch = 'auto': not even one sample fits in " .. fmt_bytes(avail) .. " on " .. c.device .. " (" ..
    table.concat(tried, ", ") .. "); try precision = 'bf16-mixed' or checkpointing = true")
end

--- `wick plan`: the recipe's wick.train call measures instead of training.
-- One optimizer step on one micro-batch of the recipe's data per setting (the
-- weights change, nothing is saved), peak memory held by tensors and time
-- for each; then the cheapest settings that fit the device's memory.
function M.plan(cfg)
  local c = resolve(cfg)
  if c.dist.world_size > 1 then fail("wick plan measures one process: run it without launch") end
  local cuda = c.device:sub(1, 4) == "cuda"
  local auto = c.micro_batch == "auto"
  local per_rank = auto and c.batch_size or c.micro_batch * c.accumulate
  local micro = auto and per_rank or c.micro_batch
  local avail = M.plan_mode.device_memory or 0
  if avail == 0 then avail = core.device_memory(c.device) end
  local blocks = c.model:blocks()
  local half_dtype = { ["bf16-true"] = true, ["fp16-true"] = true }
  if half_dtype[c.precision] then
    fail("wick plan: precision = '" .. c.precision .. "' converts the weights; plan the recipe with a mixed precision")
  end
  -- tensors held before any step, less the weights: data sets and the like,
  -- in host memory on a GPU run; left out of the estimate
  local host_only
  local function measure(o)
    collectgarbage()
    local trainer = core.trainer { model = c.model, optim = c.optim, device = c.device, precision = o.precision,
      checkpointing = o.checkpointing, on_oom = "fail", total_steps = 1, loss_scale = c.loss_scale }
    if not host_only then
      local b0, m0 = trainer:memory_breakdown(), core.memory(cuda)
      host_only = cuda and 0 or math.max(0, m0.cpu_tensors - b0.weights - b0.optimizer)
    end
    -- two micro-batches when the recipe accumulates: the second holds the
    -- summed gradients beside its own, as in training
    local m = math.min(o.micro, c.data:size())
    local n = math.min(per_rank / o.micro > 1 and 2 * m or m, c.data:size())
    local window = c.data:window(0, n, m)
    trainer:step(window)  -- first: allocates the optimizer state
    core.reset_peak()
    local dt = math.huge
    local ok, err
    for _ = 1, 2 do
      local t0 = core.now()
      ok, err = pcall(trainer.step, trainer, window)
      dt = math.min(dt, core.now() - t0)
    end
    local bd = trainer:memory_breakdown()
    -- with accumulation, a later micro-batch also holds the gradients summed so far
    local peak = peak_of(core.memory(cuda)) - host_only
    return { ok = ok, err = err, peak = peak, seconds = dt / n * per_rank, breakdown = bd, o = o }
  end
  local given_ck = c.checkpointing
  local rows = {}
  local function row(name, o)
    o.precision = o.precision or c.precision
    if o.checkpointing == nil then o.checkpointing = given_ck end
    o.micro = o.micro or micro
    local ok, r = pcall(measure, o)
    if not ok then r = { ok = false, err = r, o = o } end
    r.name = name
    rows[#rows + 1] = r
    return r
  end
  local base = row("as given", {})
  if not base.ok then fail("wick plan: one step of the recipe as given failed: " .. tostring(base.err)) end
  if c.precision == "fp32" then row("precision = \"bf16-mixed\"", { precision = "bf16-mixed" }) end
  if #blocks > 0 and given_ck ~= true then row("checkpointing = true", { checkpointing = true }) end
  if micro > 1 and micro % 2 == 0 then
    row(string.format("micro_batch = %d, accumulate x 2", micro / 2), { micro = micro / 2 })
  end
  local all = { precision = c.precision == "fp32" and "bf16-mixed" or c.precision, checkpointing = #blocks > 0 or given_ck }
  row("all of these", { precision = all.precision, checkpointing = all.checkpointing,
    micro = (micro > 1 and micro % 2 == 0) and micro / 2 or micro })

  local bd = base.breakdown
  print(string.format("wick plan: %s on %s, micro_batch %d x accumulate %d (batch %d per rank), precision %s",
    arg and arg[0] or "recipe", c.device, micro, per_rank / micro, per_rank, c.precision))
  print(string.format("  one step as given: peak %s = weights %s + gradients %s + optimizer %s + activations and data %s",
    fmt_bytes(base.peak), fmt_bytes(bd.weights), fmt_bytes(bd.gradients), fmt_bytes(bd.optimizer),
    fmt_bytes(math.max(0, base.peak - bd.weights - bd.gradients - bd.optimizer))))
  print(string.format("  estimate as given: %d bytes on the device", base.peak))
  print(string.format("  %-44s %12s %8s %14s", "setting", "peak", "saving", "time per batch"))
  for _, r in ipairs(rows) do
    if r.ok then
      print(string.format("  %-44s %12s %7.0f%% %13.2fx", r.name, fmt_bytes(r.peak), 100 * (1 - r.peak / base.peak),
        r.seconds / base.seconds))
    else
      print(string.format("  %-44s %s", r.name, "failed: " .. tostring(r.err):gsub("\n.*", "")))
    end
  end
  if avail > 0 then
    local budget = 0.9 * avail
    -- every candidate that keeps the batch, measured; the fastest that fits wins
    local function find(o)
      for _, x in ipairs(rows) do
        if x.o.precision == o.precision and x.o.checkpointing == o.checkpointing and x.o.micro == o.micro then return x end
      end
      return row("candidate", o)
    end
    local mixed = all.precision
    local cands = { {}, { precision = mixed } }
    if #blocks > 0 then
      cands[#cands + 1] = { checkpointing = true }
      cands[#cands + 1] = { precision = mixed, checkpointing = true }
    end
    local m = micro
    while m > 1 do
      m = math.floor(m / 2)
      while per_rank % m ~= 0 do m = m - 1 end
      cands[#cands + 1] = { micro = m }
      cands[#cands + 1] = { micro = m, precision = mixed, checkpointing = #blocks > 0 or given_ck }
    end
    local choice
    for _, o in ipairs(cands) do
      o.precision = o.precision or c.precision
      if o.checkpointing == nil then o.checkpointing = given_ck end
      o.micro = o.micro or micro
      local r = find(o)
      if r.ok and r.peak <= budget and (not choice or r.seconds < choice.seconds) then choice = r end
      -- smaller micro-batches only get slower: stop once one fits
      if choice and o.micro < micro then break end
    end
    if choice then
      local o = choice.o
      local ck = o.checkpointing
      print(string.format("fastest that fits %s (90%%: %s): precision = %q, checkpointing = %s, micro_batch = %d, accumulate = %d" ..
        " (peak %s, the batch of %d kept)", fmt_bytes(avail), fmt_bytes(budget), o.precision,
        type(ck) == "table" and ("{ " .. table.concat(ck, ", ") .. " }") or tostring(ck), o.micro, per_rank / o.micro,
        fmt_bytes(choice.peak), per_rank))
    else
      print(string.format("nothing tried fits %s: even one sample with bf16-mixed and checkpointing needs more; " ..
        "train fewer parameters (lora), shorten sequences or shrink images", fmt_bytes(avail)))
    end
  else
    print("no device memory given: --device-memory 8GiB suggests settings that fit")
  end
  io.stdout:flush()
  os.exit(0)
end

function M.train(cfg)
  if M.plan_mode then return M.plan(cfg) end
  local c = resolve(cfg)
  local cuda = c.device:sub(1, 4) == "cuda"
  local world = c.dist.world_size
  if not c.rank0 then c.quiet = true end
  -- A checkpoint made with another rank count: keep the effective batch by
  -- changing accumulate (before the loader is built on it).
  local resume_from = c.resume and core.latest_checkpoint(c.out .. "/checkpoints")
  if resume_from then
    local st = read_json(resume_from .. "/state.json")
    local e = st and st.extra or {}
    if e.world_size and e.world_size ~= world and c.micro_batch ~= "auto" then
      local effective = e.micro_batch * e.accumulate * e.world_size
      local acc = effective / (c.micro_batch * world)
      if acc ~= math.floor(acc) or acc < 1 then
        fail(string.format("cannot resume a run of effective batch %d (micro %d x accumulate %d x %d ranks) " ..
          "with micro_batch %d on %d ranks: %d is not a multiple of %d", effective, e.micro_batch, e.accumulate,
          e.world_size, c.micro_batch, world, effective, c.micro_batch * world))
      end
      if c.rank0 then
        io.stderr:write(string.format("wick.train: the checkpoint was made by %d ranks, this run has %d: " ..
          "accumulate %d -> %d keeps the effective batch of %d\n", e.world_size, world, c.accumulate, acc, effective))
      end
      c.accumulate = acc
    end
  end
  if world > 1 then core.check_same("recipe and wick.train options", fingerprint(c), c.device) end
  core.seed(c.seed)
  local auto = c.micro_batch == "auto"
  local per_rank_batch = auto and c.batch_size / world
  if auto and per_rank_batch ~= math.floor(per_rank_batch) then
    fail(string.format("option 'batch_size': %d is not a multiple of the %d ranks", c.batch_size, world))
  end
  local function make_loader(micro, acc)
    return core.loader(c.data, {
      micro_batch = micro, accumulate = acc, shuffle = c.shuffle, seed = c.seed,
      drop_last = c.drop_last, workers = c.workers, prefetch = c.prefetch, pin_memory = cuda,
    })
  end
  -- windows per epoch depend on the effective batch only, not on its split
  local per_epoch = make_loader(auto and per_rank_batch or c.micro_batch, auto and 1 or c.accumulate):windows_per_epoch()
  if per_epoch == 0 then
    fail(string.format("the data (%d samples) fill no window of %s x %d with drop_last = true",
      c.data:size(), tostring(c.micro_batch), c.accumulate))
  end
  local total = per_epoch * c.epochs
  if c.max_steps > 0 and c.max_steps < total then total = c.max_steps end
  local trainer = core.trainer {
    model = c.model, optim = c.optim, schedule = c.schedule,
    clip_grad_norm = c.clip_grad_norm, clip_grad_value = c.clip_grad_value, total_steps = total, device = c.device,
    bucket_mb = c.bucket_mb, sync = c.sync, precision = c.precision, loss_scale = c.loss_scale,
    checkpointing = c.checkpointing, on_oom = c.on_oom, empty_cache_every = c.empty_cache_every,
    memory_fraction = c.memory_fraction,
  }
  if not cuda and (c.empty_cache_every > 0 or c.memory_fraction > 0) and not c.quiet then
    io.stderr:write("wick.train: empty_cache_every and memory_fraction act on CUDA memory; on " .. c.device ..
      " they have no effect\n")
  end
  local coupled = c.model:window_coupled()
  if coupled and not c.quiet and c.rank0 then
    -- say which form of a contrastive loss this run uses
    io.stderr:write(string.format("wick.train: the model's loss couples the samples of a window: computed exactly " ..
      "over each window of micro_batch x accumulate x %d ranks, embeddings first, then backward per micro-batch " ..
      "(two forward passes each)\n", world))
  end
  if auto then
    c.micro_batch, c.accumulate = M.fit_micro_batch(trainer, c, per_rank_batch)
    c.eval_micro_batch = c.eval_micro_batch or c.micro_batch
  end
  local loader = make_loader(c.micro_batch, c.accumulate)

  local comm0 = trainer:comm()  -- traffic from here on: the steps', not the start's broadcast
  local ckpt_dir = c.out and (c.out .. "/checkpoints")
  local epoch, first_window = 0, 0
  if c.out and c.rank0 then core.mkdirs(c.out) end
  if c.resume then
    local latest = resume_from
    if latest then
      local extra = trainer:load(latest)
      epoch, first_window = extra.epoch or 0, extra.window or 0
      if not c.quiet then
        io.stderr:write(string.format("wick: resuming from %s (step %d)\n", latest, trainer:steps()))
      end
    elseif not c.quiet then
      io.stderr:write("wick: resume = true but " .. ckpt_dir .. " holds no checkpoint; starting fresh\n")
    end
  end

  local log  -- the run folder's metrics.jsonl, event file and run.json (rank 0)
  if c.out and c.rank0 then
    local opts = {}
    for _, o in ipairs(M.options) do
      local v = c[o[1]]
      if v ~= nil and type(v) ~= "userdata" then
        opts[o[1]] = type(v) == "table" and core.json(v) or v
      end
    end
    opts.micro_batch, opts.accumulate = c.micro_batch, c.accumulate
    opts.parameters, opts.samples, opts.world_size = c.model:parameters(), c.data:size(), world
    log = runlog.open(c.out, {
      recipe = arg and arg[0], options = opts, total_steps = total, start_step = trainer:steps(),
      extra = { device = c.device, precision = c.precision, world_size = world, item_name = c.model:item_name(),
                loss_scope = coupled and "window" or "micro_batch" },
    })
  end
  local run = { steps = trainer:steps(), skipped_steps = 0, history = {}, out = c.out, status = "running" }
  local tty = core.isatty(2)
  local t_start = core.now()
  local steps_at_start = trainer:steps()
  local items_seen = 0
  local peak = 0

  local function save(why)
    if not ckpt_dir then return end
    local e, w = loader:position()
    if w >= per_epoch then e, w = e + 1, 0 end
    run.checkpoint = trainer:save(ckpt_dir, { epoch = e, window = w, reason = why, world_size = world,
      micro_batch = c.micro_batch, accumulate = c.accumulate }, c.keep_checkpoints)
  end

  local function do_eval()
    local r = core.evaluate(c.model, c.eval_data, c.eval_micro_batch, c.device)
    r.step = trainer:steps()
    r.eval = true
    run.eval = r
    if log then log:record(r) end
    if not c.quiet then
      local extra = r.accuracy and string.format(" | accuracy %.4f", r.accuracy) or ""
      io.stderr:write(string.format("%seval @ step %d | loss %.4f%s\n", tty and "\r\27[K" or "", r.step, r.loss, extra))
    end
  end

  -- On a terminal: one line, redrawn in place each step and cut to the
  -- terminal's width (fields dropped from the right), so it never wraps. Not
  -- on a terminal: a plain line every log_every steps. Only rank 0 prints.
  local last_logged
  local function progress(rec, final)
    if c.quiet then return end
    local done = trainer:steps() - steps_at_start
    local elapsed = core.now() - t_start
    local rate = items_seen / math.max(elapsed, 1e-9)
    local eta = done > 0 and (total - trainer:steps()) * elapsed / done or 0
    local mem = rec.mem_allocated and string.format("mem %s (peak %s, reserved %s)", fmt_bytes(rec.mem_allocated),
      fmt_bytes(rec.mem_peak), fmt_bytes(rec.mem_reserved))
      or string.format("mem %s (peak %s, tensors %s)", fmt_bytes(rec.mem_resident), fmt_bytes(rec.mem_peak_resident),
        fmt_bytes(rec.mem_tensors))
    local parts = {
      string.format("step %d/%d", rec.step, total), string.format("%.1f %s/s", rate, c.model:item_name()),
      (final and "took " .. fmt_time(elapsed) or "ETA " .. fmt_time(eta)), string.format("loss %.4f", rec.loss),
      string.format("lr %.2e", rec.lr), mem, string.format("gnorm %.3g", rec.grad_norm),
    }
    if rec.loss_scale then parts[#parts + 1] = string.format("scale %g", rec.loss_scale) end
    if tty then
      local width = core.term_width(2)
      local line = parts[1]
      for i = 2, #parts do
        local longer = line .. " | " .. parts[i]
        if width > 0 and #longer >= width then break end
        line = longer
      end
      if width > 0 and #line >= width then line = line:sub(1, width - 1) end
      io.stderr:write("\r\27[K", line, final and "\n" or "")
    elseif (final and rec.step ~= last_logged) or (not final and (rec.step % c.log_every == 0 or rec.step == 1)) then
      last_logged = rec.step
      io.stderr:write(table.concat(parts, " | "), "\n")
    end
  end

  core.reset_peak()  -- the run's peak, from its first step
  -- tensors held before the first step besides weights and optimizer state
  -- (data sets loaded in memory, ...): not activations
  local held_before = 0
  do
    local bd, m = trainer:memory_breakdown(), core.memory(cuda)
    held_before = math.max(0, (cuda and m.cuda_allocated or m.cpu_tensors) - bd.weights - bd.gradients - bd.optimizer)
  end
  local interrupted, signal = false, 0
  local step_peak = 0  -- the most tensors held during any step
  local last
  -- An error from here on (out of memory with on_oom = "fail", a broken
  -- sample, a lost rank) marks the run folder's run.json failed, then ends
  -- the recipe as before.
  local ok, err = pcall(function()
  while trainer:steps() < total and epoch < c.epochs do
    loader:start_epoch(epoch, first_window)
    first_window = 0
    while trainer:steps() < total do
      local window = loader:next()
      if not window then break end
      local split_before = trainer:split()
      core.reset_peak()  -- each step's own peak; evaluation and saving between steps are not training memory
      local rec = trainer:step(window)
      window:free()  -- now, not when the collector runs: a window can be large
      local stop = rec.stop
      rec.stop = nil
      rec.epoch = epoch
      items_seen = items_seen + rec.items
      rec.skipped = rec.skipped or false
      rec.items_per_s = rec.items / math.max(rec.seconds, 1e-9)
      rec.time = core.now() - t_start
      local m, p = memory_now(cuda)
      add_memory(rec, m)
      if p > peak then peak = p end
      if peak_of(m) > step_peak then step_peak = peak_of(m) end
      if rec.split and rec.split > split_before and c.rank0 then
        io.stderr:write(string.format("%swick.train: out of memory in step %d: micro_batch %d -> %s, accumulate %d -> %d " ..
          "(the same batch); the window was redone from its start\n", tty and "\r\27[K" or "", rec.step, c.micro_batch,
          c.micro_batch % rec.split == 0 and tostring(c.micro_batch / rec.split) or ("~" .. math.ceil(c.micro_batch / rec.split)),
          c.accumulate, c.accumulate * rec.split))
      end
      if rec.skipped and c.rank0 and not c.quiet then
        io.stderr:write(string.format("%swick.train: step %d skipped: inf/nan gradients at loss scale %g\n",
          tty and "\r\27[K" or "", rec.step, rec.loss_scale or 0))
      end
      run.history[#run.history + 1] = rec
      if log then log:record(rec) end
      last = rec
      progress(rec, false)
      -- agreed over all ranks inside trainer:step, so every rank stops after the same step
      if stop then
        interrupted = true
        signal = select(2, core.interrupted())
        break
      end
      if c.save_every > 0 and rec.step % c.save_every == 0 and rec.step < total then save("every") end
      if c.eval_data and c.eval_every > 0 and rec.step % c.eval_every == 0 and rec.step < total then do_eval() end
    end
    if interrupted then break end
    epoch = epoch + 1
  end
  if last then progress(last, true) end

  if interrupted then
    save("interrupted")
    run.status = "interrupted"
    if c.rank0 then
      local name = signal == 15 and "SIGTERM" or signal == 2 and "SIGINT" or "a signal on another rank"
      io.stderr:write(string.format("wick: %s at step %d%s\n", name,
        trainer:steps(), run.checkpoint and ("; checkpoint saved to " .. run.checkpoint) or ""))
    end
  else
    if c.eval_data then do_eval() end
    save("end")
    run.status = "finished"
  end
  end)
  if not ok then
    if log then
      log:finish { status = "failed", error = tostring(err), steps = trainer:steps(), final_loss = last and last.loss,
        seconds = core.now() - t_start }
    end
    error(err, 0)
  end

  run.steps = trainer:steps()
  run.skipped_steps = trainer:skipped_steps()
  run.loss_scale = trainer:loss_scale()
  -- after out-of-memory splits: the micro-batch and accumulation actually used
  run.micro_batch = math.ceil(c.micro_batch / trainer:split())
  run.accumulate = c.accumulate * trainer:split()
  if trainer:split() > 1 then run.split = trainer:split() end
  -- Where the peak went: weights, gradients, optimizer state, data buffers,
  -- and activations (the rest of the peak).
  do
    local bd = trainer:memory_breakdown()
    local m = core.memory(cuda)
    local tensor_peak = step_peak
    local data = loader:buffered_bytes()
    local held = bd.weights + bd.gradients + bd.optimizer + (cuda and 0 or data) + held_before
    run.memory = {
      device = c.device, peak = tensor_peak, weights = bd.weights, gradients = bd.gradients,
      optimizer = bd.optimizer, data = data, other = held_before, activations = math.max(0, tensor_peak - held),
      resident_peak = m.peak_resident,
    }
  end
  -- media data sets count the files they skipped (each named once when it happened)
  local skipped_files = c.data.skipped_files
  if type(skipped_files) == "number" and skipped_files > 0 then run.skipped_files = skipped_files end
  run.final_loss = last and last.loss
  run.peak_memory = peak
  run.seconds = core.now() - t_start
  run.interrupted = interrupted
  local comm1 = trainer:comm()
  run.comm = { collectives = comm1.collectives - comm0.collectives, bytes = comm1.bytes - comm0.bytes }
  if log then
    local best
    for _, r in ipairs(run.history) do
      if not r.skipped and (not best or r.loss < best) then best = r.loss end
    end
    log:finish {
      status = run.status, steps = run.steps, final_loss = run.final_loss, best_loss = best,
      peak_memory = run.peak_memory, seconds = run.seconds, eval = run.eval, checkpoint = run.checkpoint,
      micro_batch = run.micro_batch, accumulate = run.accumulate, epochs = c.epochs, seed = c.seed,
      checkpointing = #trainer:checkpointed_blocks() > 0 and trainer:checkpointed_blocks() or false,
      skipped_steps = run.skipped_steps, loss_scale = run.loss_scale, memory = run.memory, split = run.split,
      skipped_files = run.skipped_files,
    }
  end
  if not c.quiet then
    local ev = run.eval and run.eval.accuracy and string.format(", eval accuracy %.4f", run.eval.accuracy)
      or (run.eval and string.format(", eval loss %.4f", run.eval.loss)) or ""
    io.stderr:write(string.format("wick: %s %d steps in %s, final loss %s%s, peak memory %s\n", run.status,
      run.steps, fmt_time(run.seconds), run.final_loss and string.format("%.4f", run.final_loss) or "-", ev,
      fmt_bytes(run.peak_memory)))
    local mm = run.memory
    io.stderr:write(string.format("wick: memory on %s: peak %s held by tensors = weights %s + gradients %s + " ..
      "optimizer %s + %sactivations %s + other %s%s\n", mm.device, fmt_bytes(mm.peak), fmt_bytes(mm.weights),
      fmt_bytes(mm.gradients), fmt_bytes(mm.optimizer), cuda and "" or ("data buffers " .. fmt_bytes(mm.data) .. " + "),
      fmt_bytes(mm.activations), fmt_bytes(mm.other),
      cuda and (" (data buffers in host memory: " .. fmt_bytes(mm.data) .. ")") or " (other: data sets and tensors held before the first step)"))
    if run.skipped_files then
      io.stderr:write(string.format("wick: %d data files could not be decoded and were skipped (named above)\n",
        run.skipped_files))
    end
    if run.skipped_steps > 0 then
      io.stderr:write(string.format("wick: %d of %d steps skipped for inf/nan gradients (fp16 loss scale now %g)\n",
        run.skipped_steps, run.steps, run.loss_scale or 0))
    end
  end
  return run
end

return M
