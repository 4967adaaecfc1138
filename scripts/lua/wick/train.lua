-- wick.train: the standard loop, written with the step-level primitives.
local core = require "wick.core"

local M = {}

-- name, type, default, doc. nil default: optional / required as the doc says.
M.options = {
  { "model", "object", nil, "model (wick.model); required" },
  { "data", "object", nil, "training data (wick.data); required" },
  { "optim", "object", nil, "optimizer (wick.optim); required" },
  { "schedule", "any", nil, "schedule object (wick.schedule) or 'constant' | 'linear' | 'cosine'" },
  { "warmup_steps", "number", 0, "warmup steps when schedule is given by name" },
  { "micro_batch", "number", 1, "samples per micro-batch (per rank)" },
  { "accumulate", "number", 1, "micro-batches per optimizer step" },
  { "epochs", "number", 1, "passes over the data" },
  { "max_steps", "number", 0, "stop after this many optimizer steps (0: no limit)" },
  { "drop_last", "boolean", false, "drop an epoch's last short window instead of stepping with its true item count" },
  { "shuffle", "boolean", true, "shuffle the data each epoch (by seed and epoch)" },
  { "seed", "number", 0, "seed for data order and random layers" },
  { "workers", "number", 0, "data worker threads (0: load on the training thread)" },
  { "prefetch", "number", 2, "micro-batches loaded ahead, at most" },
  { "precision", "string", "fp32", "arithmetic precision (this build: fp32)" },
  { "clip_grad_norm", "number", 0, "clip the global gradient norm to this (0: off; the norm is logged anyway)" },
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
  positive_int("micro_batch", 1); positive_int("accumulate", 1); positive_int("epochs", 1)
  positive_int("max_steps", 0); positive_int("save_every", 0); positive_int("eval_every", 0)
  positive_int("workers", 0); positive_int("prefetch", 1); positive_int("log_every", 1)
  positive_int("keep_checkpoints", 1); positive_int("warmup_steps", 0)
  if c.clip_grad_norm < 0 then fail("option 'clip_grad_norm': expected a number >= 0, got " .. c.clip_grad_norm) end
  if c.precision ~= "fp32" then
    fail("option 'precision': expected fp32 (mixed and half precision are not in this build yet), got " .. c.precision)
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
  c.eval_micro_batch = c.eval_micro_batch or c.micro_batch * c.accumulate
  return c
end

local function fmt_bytes(n)
  if not n then return "?" end
  if n >= 2 ^ 30 then return string.format("%.2f GiB", n / 2 ^ 30) end
  return string.format("%.0f MiB", n / 2 ^ 20)
end

local function fmt_time(s)
  s = math.max(0, math.floor(s + 0.5))
  if s >= 3600 then return string.format("%d:%02d:%02d", s / 3600, (s % 3600) / 60, s % 60) end
  return string.format("%d:%02d", s / 60, s % 60)
end

local function memory_now(cuda)
  local m = core.memory(cuda)
  return m, (m.cuda_allocated and m.cuda_peak) or m.peak_resident
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
    if type(v) ~= "userdata" and type(v) ~= "table" and o[1] ~= "device" and v ~= nil then
      keys[#keys + 1] = o[1] .. "=" .. tostring(v)
    end
  end
  local np = c.model:parameters()
  return string.format("recipe %s, data %d samples, model %d parameters, %s", fnv1a(text), c.data:size(), np,
    table.concat(keys, " "))
end

local function read_json(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return core.json_decode(s)
end

function M.train(cfg)
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
    if e.world_size and e.world_size ~= world then
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
  local loader = core.loader(c.data, {
    micro_batch = c.micro_batch, accumulate = c.accumulate, shuffle = c.shuffle, seed = c.seed,
    drop_last = c.drop_last, workers = c.workers, prefetch = c.prefetch, pin_memory = cuda,
  })
  local per_epoch = loader:windows_per_epoch()
  if per_epoch == 0 then
    fail(string.format("the data (%d samples) fill no window of %d x %d with drop_last = true",
      c.data:size(), c.micro_batch, c.accumulate))
  end
  local total = per_epoch * c.epochs
  if c.max_steps > 0 and c.max_steps < total then total = c.max_steps end
  local trainer = core.trainer {
    model = c.model, optim = c.optim, schedule = c.schedule,
    clip_grad_norm = c.clip_grad_norm, total_steps = total, device = c.device, bucket_mb = c.bucket_mb,
    sync = c.sync,
  }

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

  local metrics_file
  if c.out and c.rank0 then
    metrics_file = assert(io.open(c.out .. "/metrics.jsonl", trainer:steps() > 0 and "a" or "w"))
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
    if metrics_file then metrics_file:write(core.json(r), "\n"); metrics_file:flush() end
    if not c.quiet then
      local extra = r.accuracy and string.format(" | accuracy %.4f", r.accuracy) or ""
      io.stderr:write(string.format("%seval @ step %d | loss %.4f%s\n", tty and "\r\27[K" or "", r.step, r.loss, extra))
    end
  end

  local function progress(rec, final)
    if c.quiet then return end
    local done = trainer:steps() - steps_at_start
    local elapsed = core.now() - t_start
    local rate = items_seen / math.max(elapsed, 1e-9)
    local eta = done > 0 and (total - trainer:steps()) * elapsed / done or 0
    local line = string.format("step %d/%d | %.1f %s/s | ETA %s | loss %.4f | lr %.2e | mem %s",
      rec.step, total, rate, c.model:item_name(), fmt_time(eta), rec.loss, rec.lr, fmt_bytes(rec.memory))
    if tty then
      io.stderr:write("\r\27[K", line, final and "\n" or "")
    elseif final or rec.step % c.log_every == 0 or rec.step == 1 then
      io.stderr:write(line, "\n")
    end
  end

  local interrupted, signal = false, 0
  local last
  while trainer:steps() < total and epoch < c.epochs do
    loader:start_epoch(epoch, first_window)
    first_window = 0
    while trainer:steps() < total do
      local window = loader:next()
      if not window then break end
      local rec = trainer:step(window)
      local stop = rec.stop
      rec.stop = nil
      rec.epoch = epoch
      items_seen = items_seen + rec.items
      local m, p = memory_now(cuda)
      rec.memory = m.cuda_allocated or m.resident
      rec.peak_memory = p
      if p > peak then peak = p end
      run.history[#run.history + 1] = rec
      if metrics_file then metrics_file:write(core.json(rec), "\n"); metrics_file:flush() end
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
  if metrics_file then metrics_file:close() end

  run.steps = trainer:steps()
  run.final_loss = last and last.loss
  run.peak_memory = peak
  run.seconds = core.now() - t_start
  run.interrupted = interrupted
  local comm1 = trainer:comm()
  run.comm = { collectives = comm1.collectives - comm0.collectives, bytes = comm1.bytes - comm0.bytes }
  if c.out and c.rank0 then
    core.write_file(c.out .. "/run.json", core.json {
      status = run.status, steps = run.steps, final_loss = run.final_loss, peak_memory = run.peak_memory,
      seconds = run.seconds, eval = run.eval, checkpoint = run.checkpoint, recipe = arg and arg[0],
      micro_batch = c.micro_batch, accumulate = c.accumulate, epochs = c.epochs, seed = c.seed, device = c.device,
      world_size = world,
    } .. "\n")
  end
  if not c.quiet then
    local ev = run.eval and run.eval.accuracy and string.format(", eval accuracy %.4f", run.eval.accuracy)
      or (run.eval and string.format(", eval loss %.4f", run.eval.loss)) or ""
    io.stderr:write(string.format("wick: %s %d steps in %s, final loss %s%s, peak memory %s\n", run.status,
      run.steps, fmt_time(run.seconds), run.final_loss and string.format("%.4f", run.final_loss) or "-", ev,
      fmt_bytes(run.peak_memory)))
  end
  return run
end

return M
