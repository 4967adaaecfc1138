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
-- does not). full= also measures those seeds at full depth; check= runs one
-- in fp32 with micro-batch 1 (fast kernels on any CPU) at k, 2k and all
-- layers: the check that the extrapolation holds.
--   wick run bench/seeds.lua clips=DIR [seeds=000,001,...] [full=004] [check=000] [k=2]
-- DIR: media made by bench/seeds.sh (images resized to 224 and 336 px,
-- 100-frame clips). Each optimizer step is a window of 2 micro-batches (the
-- peak does not grow with the window: later micro-batches add into gradients
-- that exist).
local wick = require "wick"
local a = wick.args
local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
local root = here .. "/../configs/seeds/"
local lib = dofile(root .. "lib.lua")
local clips = a.clips or error("clips=DIR: run bench/seeds.sh, which makes them", 0)

local files = { ["000"] = "000_microvlm.lua", ["001"] = "001_video_llm.lua", ["002"] = "002_car_clip.lua",
  ["003"] = "003_llava_qlora.lua", ["004"] = "004_gearhead_lm.lua" }
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

local function recipe_of(name)
  local got
  _G.wick_seed_collect = function(r) got = r end
  dofile(root .. files[name])
  _G.wick_seed_collect = nil
  return got
end

local GiB = 2 ^ 30
local keys = { "weights", "gradients", "optimizer", "data", "activations", "peak" }
local tmp = os.tmpname()
os.remove(tmp)
local runs = 0

-- one run of two optimizer steps with the towers at `depth` layers ({layers = 1, ...}; nil: the real depth)
local function measure(recipe, depth, optim, over)
  collectgarbage()
  wick.seed(1)
  runs = runs + 1
  local extra = { accumulate = 2, max_steps = 2, epochs = 1, quiet = true, shuffle = false, out = tmp .. "-" .. runs,
    overwrite = true, overrides = false, save_every = 0, optim = optim }
  for k, v in pairs(over or {}) do extra[k] = v end
  local t = lib.train_table(recipe, "real", clips, extra, depth)
  local total, trainable = t.model:parameters()
  local t0 = wick.core.now()
  local run = wick.train(t)
  if run.steps < 2 then
    error(string.format("seed %s: the data gave %d step(s) of micro-batch %d x 2, expected 2: make more media " ..
      "(bench/seeds.sh makes enough)", recipe.name, run.steps, t.micro_batch), 0)
  end
  local m = run.memory
  local row = { params = total, trainable = trainable, seconds = (wick.core.now() - t0) / 2 }
  for _, k in ipairs(keys) do row[k] = tonumber(m[k]) or 0 end
  row.data = row.data + (tonumber(m.other) or 0)
  t = nil
  collectgarbage()
  os.execute("rm -rf '" .. tmp .. "-" .. runs .. "'")
  return row
end

local function header()
  print(string.format("  %-30s %8s %8s %8s %8s %8s %8s %8s %s", "GiB held by tensors", "weights", "grads", "optim",
    "data", "activ.", "peak", "of goal", "fits"))
end
local function show(label, r, goal)
  print(string.format("  %-30s %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f %7.2fx %s", label, r.weights / GiB,
    r.gradients / GiB, r.optimizer / GiB, r.data / GiB, r.activations / GiB, r.peak / GiB, r.peak / goal,
    r.peak <= goal and "yes" or "NO"))
end
local function describe(recipe, depth)
  local parts = {}
  for _, k in ipairs(recipe.depth) do parts[#parts + 1] = k .. " " .. depth[k] end
  return table.concat(parts, ", ")
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
  local base = measure(recipe, base_depth, optim, over)
  show(describe(recipe, base_depth), base, recipe.goal)
  local est = {}
  for _, k in ipairs(keys) do est[k] = base[k] end
  for _, key in ipairs(recipe.depth) do
    local d = {}
    for _, k in ipairs(recipe.depth) do d[k] = K end
    d[key] = 2 * K
    local r = measure(recipe, d, optim, over)
    show(describe(recipe, d), r, recipe.goal)
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
  print(string.format("check, seed %s in fp32 with micro-batch 1: extrapolated from %d and %d layers, and measured", name, K, 2 * K))
  header()
  local est = extrapolated(recipe, nil, over)
  local m = measure(recipe, nil, nil, over)
  show("full depth, measured", m, recipe.goal)
  print(string.format("  extrapolated / measured peak: %.4f (%d parameters, %.1f s per step)", est.peak / m.peak,
    m.params, m.seconds))
  return
end

local summary = {}
for _, name in ipairs(wanted) do
  local recipe = recipe_of(name)
  print(string.format("seed %s: %s", name, recipe.title))
  print(string.format("  settings: micro-batch %d x accumulate %d (measured with 2), precision %s, checkpointing %s%s",
    recipe.train.micro_batch, recipe.train.accumulate, recipe.train.precision or "fp32",
    tostring(recipe.train.checkpointing or false), recipe.transform and (", " .. recipe.transform[1]) or ""))
  header()
  local est = extrapolated(recipe)
  local measured
  if full[name] then
    measured = measure(recipe, nil)
    show("full depth, measured", measured, recipe.goal)
    print(string.format("  extrapolated / measured peak: %.4f (%d parameters, %.1f s per step)", est.peak / measured.peak,
      measured.params, measured.seconds))
  end
  if recipe.forward_backward then
    -- the seed's own measurement: forward and backward alone; plain SGD keeps no state
    local fb = measure(recipe, nil, wick.optim("sgd", { lr = 1e-3 }))
    show("forward + backward (sgd)", fb, recipe.goal)
    summary[#summary + 1] = { name = name .. "fb", est = fb, goal = recipe.goal, how = "measured",
      title = recipe.title .. ": forward + backward" }
  end
  print(string.format("  the seed's figure: %s; goal %.2f GiB", recipe.figure, recipe.goal / GiB))
  summary[#summary + 1] = { name = name, est = measured or est, goal = recipe.goal,
    how = measured and "measured" or "extrapolated", title = recipe.title }
end
print("")
print(string.format("%-6s %-62s %9s %9s %8s", "seed", "workload", "peak GiB", "goal GiB", "ratio"))
for _, s in ipairs(summary) do
  print(string.format("%-6s %-62s %9.3f %9.2f %7.2fx %s", s.name, s.title, s.est.peak / GiB, s.goal / GiB,
    s.est.peak / s.goal, s.how))
end
print("activ.: the step's peak above weights, gradients, state and data (0 when the peak is the optimizer's update).")
print("CPU figures: bytes held by CPU tensors at the step's peak. A CUDA run adds its context (300-500 MiB,")
print("outside the allocator's count) and the caching allocator's reserve above what tensors hold.")
