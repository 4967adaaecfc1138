-- The seeds' workloads at their real shapes (configs/seeds/, random weights):
-- for each, real optimizer steps on this machine's CPU with the seed's
-- settings, and the most bytes held by tensors during a step (the counting
-- allocator: the stand-in for CUDA's allocated bytes), broken down into
-- weights, gradients, optimizer state, data and activations (the rest of the
-- peak: block inputs kept for backward, one block's recomputation, the
-- chunked head's logits), next to the seed's own figure.
-- A full-depth step of a 7 B model takes long on 2 cores: each model is
-- measured at 1 and 2 depth units (a unit: the same fraction of every tower's
-- layers, e.g. 4 of LLaMA-2-7B's 32 layers and 3 of the ViT-L's 24) and the
-- figures extrapolated per unit (weights, gradients, state and kept block
-- inputs grow by layer; the rest does not). full=true also measures every
-- seed whose full depth fits here (000 and 004 by default) to show the
-- extrapolation holds.
--   wick run bench/seeds.lua clips=DIR [seeds=000,001,...] [full=000]
-- DIR: clips made with bench/seeds.sh (images at 224 and 336 px, 100-frame clips).
-- Each optimizer step is a window of 2 micro-batches (the peak does not grow
-- with the window: the second micro-batch adds into gradients that exist).
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
  for s in tostring(v):gmatch("[^,]+") do out[#out + 1] = s:match("^%d+$") and string.format("%03d", tonumber(s)) or s end
  return out
end
local wanted = names(a.seeds or "000,001,002,003,004")
local full = {}
for _, s in ipairs(names(a.full or "")) do full[s] = true end

local function recipe_of(name)
  local got
  _G.wick_seed_collect = function(r) got = r end
  dofile(root .. assert(files[name], "no seed " .. name))
  _G.wick_seed_collect = nil
  return got
end

local GiB = 2 ^ 30
local keys = { "weights", "gradients", "optimizer", "data", "activations", "peak" }

-- one run of two optimizer steps at `depth` units; its memory record
local function measure(recipe, depth, dir, optim)
  collectgarbage()
  wick.seed(1)
  local t = lib.train_table(recipe, "real", clips, { accumulate = 2, max_steps = 2, epochs = 1, quiet = true,
    shuffle = false, out = dir, overwrite = true, overrides = false, save_every = 0, optim = optim }, depth)
  local total, trainable = t.model:parameters()
  local t0 = wick.core.now()
  local run = wick.train(t)
  local m = run.memory
  local row = { params = total, trainable = trainable, seconds = (wick.core.now() - t0) / 2, loss = run.final_loss }
  for _, k in ipairs(keys) do row[k] = tonumber(m[k]) or 0 end
  row.data = row.data + (tonumber(m.other) or 0)
  t = nil
  collectgarbage()
  return row
end

local tmp = os.tmpname()
os.remove(tmp)
local function show(label, r, goal)
  print(string.format("  %-22s %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f %9.2fx %s", label, r.weights / GiB,
    r.gradients / GiB, r.optimizer / GiB, r.data / GiB, r.activations / GiB, r.peak / GiB, r.peak / goal,
    r.peak <= goal and "yes" or "NO"))
end

local summary = {}
for _, name in ipairs(wanted) do
  local recipe = recipe_of(name)
  local units = recipe.units.count
  print(string.format("seed %s: %s", name, recipe.title))
  print(string.format("  settings: micro-batch %d x accumulate %d (measured with 2), precision %s, checkpointing %s%s",
    recipe.train.micro_batch, recipe.train.accumulate, recipe.train.precision or "fp32",
    tostring(recipe.train.checkpointing or false), recipe.transform and (", " .. recipe.transform[1]) or ""))
  print(string.format("  %-22s %8s %8s %8s %8s %8s %8s %10s %s", "GiB held by tensors", "weights", "grads", "optim",
    "data", "activ.", "peak", "of goal", "fits"))
  local r1 = measure(recipe, 1, tmp .. "-" .. name .. "-1")
  show(string.format("1 unit (%d params)", r1.params), r1, recipe.goal)
  local rows = { r1 }
  local est
  if units > 1 then
    local r2 = measure(recipe, 2, tmp .. "-" .. name .. "-2")
    show(string.format("2 units (%d)", r2.params), r2, recipe.goal)
    est = {}
    for _, k in ipairs(keys) do est[k] = r1[k] + (units - 1) * (r2[k] - r1[k]) end
    show(string.format("%d units, extrapolated", units), est, recipe.goal)
  else
    est = r1
  end
  local measured
  if full[name] then
    measured = measure(recipe, units, tmp .. "-" .. name .. "-full")
    show(string.format("%d units, measured", units), measured, recipe.goal)
    print(string.format("  extrapolated / measured peak: %.4f (%d parameters, %.1f s per step)", est.peak / measured.peak,
      measured.params, measured.seconds))
  end
  if recipe.forward_backward then
    -- the seed's own measurement: forward and backward alone; plain SGD keeps no state
    local fb = measure(recipe, units, tmp .. "-" .. name .. "-fb", wick.optim("sgd", { lr = 1e-3 }))
    show("forward + backward", fb, recipe.goal)
    print(string.format("  forward + backward (sgd: no optimizer state) at full depth: %.3f GiB against the seed's %.2f GiB",
      fb.peak / GiB, recipe.goal / GiB))
  end
  print(string.format("  the seed's figure: %s; goal %.2f GiB", recipe.figure, recipe.goal / GiB))
  summary[#summary + 1] = { name = name, est = measured or est, goal = recipe.goal, measured = measured ~= nil,
    title = recipe.title }
  os.execute("rm -rf '" .. tmp .. "-" .. name .. "'-*")
end
print("")
print(string.format("%-5s %-58s %10s %10s %8s", "seed", "workload", "peak GiB", "goal GiB", "ratio"))
for _, s in ipairs(summary) do
  print(string.format("%-5s %-58s %10.3f %10.2f %7.2fx %s", s.name, s.title, s.est.peak / GiB, s.goal / GiB,
    s.est.peak / s.goal, s.measured and "measured" or "extrapolated"))
end
print("activ.: the step's peak above weights, gradients, state and data (0 when the peak is the optimizer's update).")
print("CPU figures: bytes held by CPU tensors at the step's peak. A CUDA run adds its context (300-500 MiB,")
print("outside the allocator's count) and the caching allocator's reserve above what tensors hold.")
