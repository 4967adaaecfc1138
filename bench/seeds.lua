-- The seeds' workloads at their real shapes (configs/seeds/, random weights):
-- for each, real optimizer steps on this machine's CPU with the seed's
-- settings, and the most bytes held by tensors during a step (the counting
-- allocator: the stand-in for CUDA's allocated bytes), broken down into
-- weights, gradients, optimizer state, data and activations (the rest of the
-- peak: block inputs kept for backward, one block's recomputation, the
-- chunked head's logits), next to the seed's own figure.
-- A full-depth step of a 7 B model takes long on 2 cores, so each model runs
-- with every tower (the options recipe.depth names: the language model's
-- layers, the vision tower's, CLIP's text layers) at k layers (k= , default
-- 2), then each tower at 2k, and the figures are extrapolated per layer of each tower
-- (weights, gradients, state and kept block inputs grow by layer; the rest
-- does not). full= also measures those seeds at full depth (full_only=1: at
-- full depth alone, without the k and 2k layer runs); check= runs one
-- in fp32 with micro-batch 1 (fast kernels on any CPU) at k, 2k and all
-- layers: the check that the extrapolation holds.
--   wick run bench/seeds.lua clips=DIR [seeds=000,001,...] [full=004] [full_only=1] [check=000] [k=2] [device=cpu|cuda]
--     [profile=DIR [profile_only=1] [profile_full=1]]
-- DIR: media made by bench/seeds.sh (images resized to 224 and 336 px,
-- 100-frame clips). Each optimizer step is a window of 2 micro-batches (the
-- peak does not grow with the window: later micro-batches add into gradients
-- that exist).
-- device=cuda (or cuda:N): the same runs on a GPU, 5 steps each (steps=N),
-- every step's numbers read back (a synchronisation) so that the time between
-- two steps' ends is one step's time (s/step: the median of those after the
-- first step, the warm-up, so one slow step moves it not), the media decoded by 4 worker
-- threads (workers=N) while the device computes, the caching allocator emptied
-- between runs (a run's reserve never holds the last run's blocks). Each row
-- adds the allocator's peak reserved bytes, the process's device memory
-- (context + peak reserved: run.memory.reserved_peak, device_peak) and
-- seconds per step; each seed ends with a row against its goal and its card
-- (8 GiB for 003, 12 GiB for the others) and a line
--   RESULT seed=000 how=extrapolated peak=B reserved=B device=B sps=S goal=B card=B fits_goal=yes fits_card=yes
-- (bytes; n/a where the device does not count it), or RESULT seed=000 error="..."
-- when the seed failed (the next seed still runs).
local wick = require "wick"
local a = wick.args
-- each line out as it is printed (a run stopped by `timeout` keeps what it printed)
pcall(function() io.stdout:setvbuf("line") end)
local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
local root = here .. "/../configs/seeds/"
local lib = dofile(root .. "lib.lua")
local clips = a.clips or error("clips=DIR: run bench/seeds.sh, which makes them", 0)

local device = tostring(a.device or "cpu")
local cuda = device:match("^cuda") ~= nil
if not cuda and device ~= "cpu" then error("device=" .. device .. ": expected cpu, cuda or cuda:N", 0) end
if cuda and not wick.core.cuda_available() then
  error("device=" .. device .. ": this wick sees no usable CUDA device", 0)
end
-- optimizer steps per run: 2 on the CPU (the peak); on a GPU 5, the first a
-- warm-up, the median of the others' times the step's time
local STEPS = tonumber(a.steps or (cuda and 5 or 2))
if not STEPS or STEPS < 2 or STEPS % 1 ~= 0 then error("steps=" .. tostring(a.steps) .. ": expected a whole number >= 2", 0) end
-- cuda: data worker threads (workers=N; the recipes load on the training thread)
local WORKERS = tonumber(a.workers or 4)

local files = { ["000"] = "000_microvlm.lua", ["001"] = "001_video_llm.lua", ["002"] = "002_car_clip.lua",
  ["003"] = "003_llava_qlora.lua", ["004"] = "004_gearhead_lm.lua" }
-- the seeds' cards: 003 fine-tunes on an 8 GB card, the others have 12 GB
-- (001: 8-16 GB)
local GiB = 2 ^ 30
local cards = { ["000"] = 12 * GiB, ["001"] = 12 * GiB, ["002"] = 12 * GiB, ["003"] = 8 * GiB, ["004"] = 12 * GiB }
-- seeds=004 arrives as the number 4: names are three digits
local function names(v)
  local out = {}
  for s in tostring(v):gmatch("[^,]+") do
    s = s:match("^%d+$") and string.format("%03d", tonumber(s)) or s
    if not files[s] then error("no seed " .. s .. " (expected 000 to 004)", 0) end
    out[#out + 1] = s
  end
  return out
end
local wanted = names(a.seeds or "000,001,002,003,004")
local full = {}
for _, s in ipairs(names(a.full or "")) do full[s] = true end
local full_only = a.full_only
if full_only ~= nil and full_only ~= 0 and full_only ~= 1 and full_only ~= true and full_only ~= false then
  error("full_only=" .. tostring(full_only) .. ": expected 1 or 0", 0)
end
full_only = full_only == 1 or full_only == true
if full_only and not next(full) then error("full_only=1 needs full=, the seeds to measure at full depth alone", 0) end

local function recipe_of(name)
  local got
  _G.wick_seed_collect = function(r) got = r end
  dofile(root .. files[name])
  _G.wick_seed_collect = nil
  return got
end

-- reserved, device and sps (seconds per step) are 0 where not counted (the CPU's reserve and device)
local keys = { "weights", "gradients", "optimizer", "data", "activations", "peak", "reserved", "device", "sps" }
local tmp = os.tmpname()
os.remove(tmp)
local runs = 0

-- CUDA: the caching allocator's free blocks given back to the device, so
-- that a run's reserve is its own (the last run's blocks, cached, would
-- otherwise stand in its reserved peak). wick.core.empty_cache where this
-- wick has it; else a one-step run of a tiny model with empty_cache_every =
-- 1, whose step ends by emptying the cache.
local random_tokens = dofile(here .. "/random_tokens.lua")
local profile_lines = dofile(here .. "/profile_lines.lua")
local function empty_cache()
  collectgarbage()
  collectgarbage()
  if not cuda then return end
  if wick.core.empty_cache then
    wick.core.empty_cache()
    return
  end
  local file = random_tokens(2, 16)
  local ok, err = pcall(function()
    local m = wick.model("decoder_lm", { vocab_size = 257, hidden_size = 8, intermediate_size = 16, layers = 1, heads = 1 })
    wick.train { model = m, data = wick.data("text", { file = file, max_length = 16 }),
      optim = wick.optim("sgd", { lr = 0 }), micro_batch = 1, max_steps = 1, epochs = 1, shuffle = false, quiet = true,
      overrides = false, empty_cache_every = 1, device = device }
  end)
  os.remove(file)
  collectgarbage()
  if not ok then io.stderr:write("seeds.lua: emptying the CUDA cache failed: " .. tostring(err) .. "\n") end
end

-- one run of STEPS optimizer steps with the towers at `depth` layers ({layers = 1, ...}; nil: the real depth)
local function measure(recipe, depth, optim, over)
  empty_cache()
  wick.seed(1)
  runs = runs + 1
  local extra = { accumulate = 2, max_steps = STEPS, epochs = 1, quiet = true, shuffle = false, overrides = false,
    save_every = 0, optim = optim, device = device }
  if cuda then
    -- every step's numbers read at its end: the clock between steps is the
    -- device's time; the media decoded by worker threads while the device
    -- computes (as a Python DataLoader's workers do)
    extra.log_every = 1
    extra.workers = WORKERS
  else
    extra.out, extra.overwrite = tmp .. "-" .. runs, true
  end
  for k, v in pairs(over or {}) do extra[k] = v end
  local t = lib.train_table(recipe, "real", clips, extra, depth)
  local total, trainable = t.model:parameters()
  local t0 = wick.core.now()
  local run = wick.train(t)
  local wall = wick.core.now() - t0
  if run.status == "interrupted" then
    error(string.format("seed %s: interrupted by a signal after %d step(s) (a time limit?)", recipe.name, run.steps), 0)
  end
  if run.steps < STEPS then
    error(string.format("seed %s: the data gave %d step(s) of micro-batch %d x 2, expected %d: make more media " ..
      "(bench/seeds.sh makes enough)", recipe.name, run.steps, t.micro_batch, STEPS), 0)
  end
  local m = run.memory
  local row = { params = total, trainable = trainable, seconds = wall / run.steps, profile = run.profile }
  for _, k in ipairs(keys) do row[k] = tonumber(m[k]) or 0 end
  -- on CUDA the loader's buffers wait in (pinned) host memory, outside the
  -- device's peak: the data column there is what the device held before the
  -- first step (about 64 MiB on the H200, beside the weights)
  row.data = (cuda and 0 or row.data) + (tonumber(m.other) or 0)
  row.reserved = tonumber(m.reserved_peak) or 0
  row.device = tonumber(m.device_peak) or 0
  local h = run.history or {}
  if cuda and #h >= 2 and h[#h].time and h[#h - 1].time then
    -- step i's time: when its launch ended, after which the run waited for
    -- it; so from step i-1's to step i's is step i-1's whole time (and the
    -- loading of the next window), less its launch, plus step i's launch.
    -- The first interval holds the warm-up's device time; the median of the
    -- others is the step's time (with 3 steps, the one interval after it)
    local d = {}
    for i = math.min(3, #h), #h do
      if h[i].time and h[i - 1].time then d[#d + 1] = h[i].time - h[i - 1].time end
    end
    table.sort(d)
    local m = math.floor(#d / 2)
    row.sps = #d % 2 == 1 and d[m + 1] or (d[m] + d[m + 1]) / 2
  else
    row.sps = row.seconds
  end
  t, run = nil, nil
  collectgarbage()
  if not cuda then os.execute("rm -rf '" .. tmp .. "-" .. runs .. "'") end
  return row
end

local function gib(x) return x > 0 and string.format("%8.3f", x / GiB) or string.format("%8s", "n/a") end
local function header()
  print(string.format("  %-30s %8s %8s %8s %8s %8s %8s %8s %-4s%s", "GiB held by tensors", "weights", "grads", "optim",
    "data", "activ.", "peak", "of goal", "fits", cuda and string.format(" %8s %8s %8s", "reserved", "device", "s/step") or ""))
end
local function show(label, r, goal)
  print(string.format("  %-30s %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f %7.2fx %-4s%s", label, r.weights / GiB,
    r.gradients / GiB, r.optimizer / GiB, r.data / GiB, r.activations / GiB, r.peak / GiB, r.peak / goal,
    r.peak <= goal and "yes" or "NO",
    cuda and string.format(" %s %s %8.4f", gib(r.reserved), gib(r.device), r.sps) or ""))
end
local function describe(recipe, depth)
  local parts = {}
  for _, k in ipairs(recipe.depth) do parts[#parts + 1] = k .. " " .. depth[k] end
  return table.concat(parts, ", ")
end
local function bytes(x) return x > 0 and string.format("%d", math.floor(x + 0.5)) or "n/a" end
-- one measured run, machine-readable (the depth as layers=2,vision_layers=4; full: every tower at its real depth)
local function raw(name, what, r)
  print(string.format("MEASURE seed=%s %s peak=%s reserved=%s device=%s sps=%.6f params=%d", name, what, bytes(r.peak),
    bytes(r.reserved), bytes(r.device), r.sps, r.params))
end
local function depth_tag(recipe, depth)
  local parts = {}
  for _, k in ipairs(recipe.depth) do parts[#parts + 1] = k .. "=" .. (depth and depth[k] or recipe.model.real[k]) end
  return "depth=" .. table.concat(parts, ",")
end

-- every tower at k layers, then each at 2k; the full depth extrapolated per
-- layer of each tower. k = 2 by default: with one layer the step's peak can
-- sit elsewhere (the head, the tower) than where it sits at depth (one
-- block's recomputation above every kept block input), and the slope from
-- 1 to 2 layers then mixes the two (seed 003: 48 MiB a layer, against the
-- 8 MiB its block inputs add from 2 layers on).
local K = tonumber(a.k or 2)
if not K or K < 1 or K % 1 ~= 0 then error("k=" .. tostring(a.k) .. ": expected a whole number of layers >= 1", 0) end
local function extrapolated(recipe, optim, over)
  local base_depth = {}
  for _, k in ipairs(recipe.depth) do base_depth[k] = K end
  -- on CUDA the process's first run also pays for loading kernels, the
  -- cuBLAS handles and the allocator's first blocks: measured once unshown
  -- (on the H200, 2.2 s a step against 0.06 after), or the per-layer slope
  -- of the time comes out negative
  if cuda then measure(recipe, base_depth, optim, over) end
  local base = measure(recipe, base_depth, optim, over)
  show(describe(recipe, base_depth), base, recipe.goal)
  raw(recipe.name, depth_tag(recipe, base_depth), base)
  local est = {}
  for _, k in ipairs(keys) do est[k] = base[k] end
  for _, key in ipairs(recipe.depth) do
    local d = {}
    for _, k in ipairs(recipe.depth) do d[k] = K end
    d[key] = 2 * K
    local r = measure(recipe, d, optim, over)
    show(describe(recipe, d), r, recipe.goal)
    raw(recipe.name, depth_tag(recipe, d), r)
    local real = recipe.model.real[key]
    for _, k in ipairs(keys) do est[k] = est[k] + (real - K) / K * (r[k] - base[k]) end
  end
  local parts = {}
  for _, k in ipairs(recipe.depth) do parts[#parts + 1] = k .. " " .. recipe.model.real[k] end
  show(table.concat(parts, ", ") .. " (extrap.)", est, recipe.goal)
  return est
end

if a.check then
  local name = names(a.check)[1]
  local recipe = recipe_of(name)
  recipe.model.real.dtype = "fp32"
  local over = { precision = "fp32", micro_batch = 1 }
  print(string.format("check, seed %s in fp32 with micro-batch 1 on %s: extrapolated from %d and %d layers, and measured",
    name, device, K, 2 * K))
  header()
  local est = extrapolated(recipe, nil, over)
  local m = measure(recipe, nil, nil, over)
  show("full depth, measured", m, recipe.goal)
  print(string.format("  extrapolated / measured peak: %.4f (%d parameters, %.1f s per step)", est.peak / m.peak,
    m.params, m.seconds))
  return
end

-- profile=DIR: one more run at k layers (profile_full=1: at full depth), its
-- steps after the first under PyTorch's profiler (wick.train's profile), the
-- trace in DIR/wick-NNN/ (wick-NNNfull/) and where a step's time went printed
-- (PROFILE lines); profile_only=1: that run alone
local profile_full = a.profile_full
if profile_full ~= nil and profile_full ~= 0 and profile_full ~= 1 and profile_full ~= true and profile_full ~= false then
  error("profile_full=" .. tostring(profile_full) .. ": expected 1 or 0", 0)
end
profile_full = profile_full == 1 or profile_full == true
if profile_full and not a.profile then error("profile_full=1 needs profile=DIR, the folder for the traces", 0) end
local function profiled(recipe, name)
  local depth = nil
  if not profile_full then
    depth = {}
    for _, k in ipairs(recipe.depth) do depth[k] = K end
  end
  local dir = a.profile .. "/wick-" .. name .. (profile_full and "full" or "")
  local r = measure(recipe, depth, nil, { out = dir, overwrite = true, profile = { 2, STEPS } })
  if not r.profile then error("seed " .. name .. ": profile=" .. a.profile .. ": the run returned no profile", 0) end
  profile_lines(name .. (profile_full and "full" or ""), depth_tag(recipe, depth), r.profile)
end

local function quote(s) return '"' .. tostring(s):gsub("[\r\n]+", " "):gsub('"', "'") .. '"' end
local summary = {}
for _, name in ipairs(wanted) do
  local ok, err = pcall(function()
    local recipe = recipe_of(name)
    print(string.format("seed %s: %s", name, recipe.title))
    print(string.format("  settings: micro-batch %d x accumulate %d (measured with 2), precision %s, checkpointing %s%s%s",
      recipe.train.micro_batch, recipe.train.accumulate, recipe.train.precision or "fp32",
      tostring(recipe.train.checkpointing or false), recipe.transform and (", " .. recipe.transform[1]) or "",
      recipe.train.offload_activations and ", block inputs offloaded to host memory" or "")
      .. (recipe.train.offload_embeddings and ", input embedding in host memory" or ""))
    if a.profile_only then  -- profile_only=1: the profiled run alone
      if not a.profile then error("profile_only=1 needs profile=DIR, the folder for the traces", 0) end
      return profiled(recipe, name)
    end
    header()
    -- full_only=1: a seed of full= at full depth alone (its k-layer figures
    -- measured elsewhere; a 7 B model's small builds cost a lease's time)
    local est = not (full[name] and full_only) and extrapolated(recipe) or nil
    local measured
    if full[name] then
      measured = measure(recipe, nil)
      show("full depth, measured", measured, recipe.goal)
      raw(name, depth_tag(recipe, nil), measured)
      if est then
        print(string.format("  extrapolated / measured peak: %.4f (%d parameters, %.3f s per step)",
          est.peak / measured.peak, measured.params, measured.sps))
      end
    end
    if recipe.forward_backward then
      -- the seed's own measurement: forward and backward alone; plain SGD keeps no state
      local fb = measure(recipe, nil, wick.optim("sgd", { lr = 1e-3 }))
      show("forward + backward (sgd)", fb, recipe.goal)
      raw(name .. "fb", depth_tag(recipe, nil), fb)
      summary[#summary + 1] = { name = name .. "fb", est = fb, goal = recipe.goal, how = "measured",
        title = recipe.title .. ": forward + backward", card = cards[name] }
    end
    if a.profile then profiled(recipe, name) end
    print(string.format("  the seed's figure: %s; goal %.2f GiB", recipe.figure, recipe.goal / GiB))
    summary[#summary + 1] = { name = name, est = measured or est, goal = recipe.goal,
      how = measured and "measured" or "extrapolated", title = recipe.title, card = cards[name] }
  end)
  if not ok then
    print(string.format("seed %s: error: %s", name, tostring(err)))
    summary[#summary + 1] = { name = name, error = tostring(err) }
    empty_cache()
  end
end
if a.profile_only then return end
print("")
if cuda then
  print(string.format("on %s: bytes at full depth (extrapolated per layer from %d and %d layers, or measured); s/step: one optimizer step of 2 micro-batches",
    device, K, 2 * K))
  print(string.format("%-6s %12s %12s %12s %9s %9s %-4s %9s %-4s %s", "seed", "peak alloc", "reserved", "device", "s/step",
    "goal GiB", "fits", "card GiB", "fits", "how"))
  for _, s in ipairs(summary) do
    if s.error then
      print(string.format("%-6s error: %s", s.name, s.error))
    else
      local e = s.est
      -- the goal is a count of bytes held by tensors (allocated); the card must also hold the context and the reserve
      local on_card = e.device > 0 and e.device or e.reserved > 0 and e.reserved or e.peak
      print(string.format("%-6s %12.3f %12s %12s %9.4f %9.2f %-4s %9.0f %-4s %s", s.name, e.peak / GiB,
        e.reserved > 0 and string.format("%.3f", e.reserved / GiB) or "n/a",
        e.device > 0 and string.format("%.3f", e.device / GiB) or "n/a", e.sps, s.goal / GiB,
        e.peak <= s.goal and "yes" or "NO", s.card / GiB, on_card <= s.card and "yes" or "NO", s.how))
    end
  end
  print("peak alloc: the caching allocator's most allocated bytes during a step (run.memory.peak); reserved: its most")
  print("reserved (run.memory.reserved_peak); device: the process's device memory, CUDA context included")
  print("(run.memory.device_peak). fits: peak alloc against the seed's goal; device against the seed's card (GiB).")
else
  print(string.format("%-6s %-62s %9s %9s %8s", "seed", "workload", "peak GiB", "goal GiB", "ratio"))
  for _, s in ipairs(summary) do
    if s.error then
      print(string.format("%-6s error: %s", s.name, s.error))
    else
      print(string.format("%-6s %-62s %9.3f %9.2f %7.2fx %s", s.name, s.title, s.est.peak / GiB, s.goal / GiB,
        s.est.peak / s.goal, s.how))
    end
  end
  print("activ.: the step's peak above weights, gradients, state and data (0 when the peak is the optimizer's update).")
  print("CPU figures: bytes held by CPU tensors at the step's peak. A CUDA run adds its context (300-500 MiB,")
  print("outside the allocator's count) and the caching allocator's reserve above what tensors hold.")
end
for _, s in ipairs(summary) do
  if s.error then
    print(string.format("RESULT seed=%s on=%s error=%s", s.name, device, quote(s.error)))
  else
    local e = s.est
    local on_card = e.device > 0 and e.device or e.reserved > 0 and e.reserved or e.peak
    print(string.format("RESULT seed=%s on=%s how=%s peak=%s reserved=%s device=%s sps=%.6f goal=%s card=%s fits_goal=%s fits_card=%s",
      s.name, device, s.how, bytes(e.peak), bytes(e.reserved), bytes(e.device), e.sps, bytes(s.goal), bytes(s.card),
      e.peak <= s.goal and "yes" or "no", on_card <= s.card and "yes" or "no"))
  end
end
