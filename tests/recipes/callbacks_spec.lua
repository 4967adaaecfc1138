-- Callbacks (on_step, on_eval, on_save), the best checkpoints by an
-- evaluation metric (monitor, keep_best, checkpoints/best) and early stopping
-- (patience), end to end through `wick run`. Each recipe checks the run's
-- files itself (metrics.jsonl, run.json, the checkpoints folder) and prints
-- OK; the spec checks that and the exit code.
local H = dofile(assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree") .. "/tests/helpers.lua")

local dir = H.tmpdir()
teardown(function() os.execute("rm -rf " .. dir) end)

-- a small classifier, its training and held-out data, and readers of a run folder
local prelude = [[
local wick = require "wick"
local core = wick.core
local data = wick.data("synthetic", { size = 64, inputs = 8, classes = 3, seed = 1 })
local held = wick.data("synthetic", { size = 32, inputs = 8, classes = 3, seed = 2 })
local model = wick.model("mlp", { inputs = 8, hidden = { 16 }, outputs = 3 })
local function records(out)
  local steps, evals = {}, {}
  for line in io.lines(out .. "/metrics.jsonl") do
    local r = core.json_decode(line)
    if r.eval then evals[#evals + 1] = r else steps[#steps + 1] = r end
  end
  return steps, evals
end
local function run_json(out)
  local f = assert(io.open(out .. "/run.json"))
  local r = core.json_decode(f:read("*a"))
  f:close()
  return r
end
local function checkpoints(out)
  local names = {}
  for _, e in ipairs(core.list_dir(out .. "/checkpoints")) do
    local n = type(e) == "table" and e.name or e
    if n:match("^step%-") then names[#names + 1] = n end
  end
  table.sort(names)
  return names
end
local function first_line(path)
  local f = assert(io.open(path))
  local l = f:read("*l")
  f:close()
  return l
end
local function check(cond, ...) if not cond then error(string.format(...), 2) end end
]]

local function run_ok(name, body, args)
  local code, out, err = H.recipe(dir, name, prelude .. body, args)
  assert.are.equal(0, code, err)
  assert.truthy(out:find("OK", 1, true), out .. err)
  return out, err
end

local function fails_with(name, body, expected)
  local code, _, err = H.recipe(dir, name, prelude .. body)
  assert.are.equal(1, code, err)
  for _, e in ipairs(type(expected) == "table" and expected or { expected }) do
    assert.truthy(err:find(e, 1, true), "expected <" .. e .. "> in:\n" .. err)
  end
  assert.falsy(err:find("frame #", 1, true), err)
  return err
end

describe("callbacks", function()
  it("on_step sees every step, logs scalars into metrics.jsonl and stops the run", function()
    run_ok("step.lua", [[
local out = wick.args.out
local seen = {}
local run = wick.train { model = model, data = data, optim = wick.optim("sgd", { lr = 0.1 }), micro_batch = 8,
  epochs = 5, out = out, quiet = true, log_every = 100,
  on_step = function(rec)
    seen[#seen + 1] = rec.step
    check(type(rec.loss) == "number" and type(rec.lr) == "number", "a step record without loss or lr")
    if rec.step == 11 then return { stop = "enough", log = { twice = rec.step * 2 } } end
    return { log = { twice = rec.step * 2 } }
  end }
check(#seen == 11, "on_step ran %d times, expected 11", #seen)
for i, s in ipairs(seen) do check(s == i, "step %d came as %s", i, tostring(s)) end
check(run.steps == 11 and run.status == "stopped", "steps %d, status %s", run.steps, run.status)
check(run.stopped.by == "on_step" and run.stopped.reason == "enough" and run.stopped.step == 11, "stopped %s",
  core.json(run.stopped))
local steps = records(out)
check(#steps == 11, "%d records", #steps)
for _, r in ipairs(steps) do check(r.twice == 2 * r.step, "step %d logged %s", r.step, tostring(r.twice)) end
local meta = run_json(out)
check(meta.status == "stopped" and meta.stopped.by == "on_step", "run.json: %s", core.json(meta.stopped or {}))
-- the last checkpoint is the stop's, and a resume has nothing to do
check(checkpoints(out)[#checkpoints(out)] == "step-00000011", "checkpoints %s", table.concat(checkpoints(out), " "))
print("OK")
]], "out=" .. dir .. "/s")
    -- a stopped run stays stopped
    local code, out, err = H.recipe(dir, "again.lua", prelude .. [[
local run = wick.train { model = model, data = data, optim = wick.optim("sgd", { lr = 0.1 }), micro_batch = 8,
  epochs = 5, out = wick.args.out, resume = true, quiet = false,
  on_step = function() return { stop = true } end }
print(run.status, run.steps, run.already_finished)
]], "out=" .. dir .. "/s")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("stopped\t11\ttrue", 1, true), out)
    assert.truthy(err:find("stopped at step 11 (on_step): nothing to resume", 1, true), err)
  end)

  it("on_eval gets each evaluation and logs into its record; on_save gets each checkpoint folder", function()
    run_ok("eval.lua", [[
local out = wick.args.out
local evals, saves = {}, {}
local run = wick.train { model = model, data = data, eval_data = held, optim = wick.optim("sgd", { lr = 0.1 }),
  micro_batch = 8, epochs = 2, eval_every = 4, save_every = 8, out = out, quiet = true,
  on_eval = function(rec)
    evals[#evals + 1] = rec
    return { log = { loss_x10 = rec.loss * 10 } }
  end,
  on_save = function(ckpt)
    check(io.open(ckpt .. "/model.safetensors") ~= nil, "on_save got %s, which holds no model", ckpt)
    saves[#saves + 1] = ckpt:match("step%-0*(%d+)$")
    return { log = { saved = 1 } }
  end }
-- 16 steps: evaluations after 4, 8, 12 and at the end; checkpoints at 8 and at the end
check(#evals == 4, "%d evaluations", #evals)
for i, step in ipairs({ 4, 8, 12, 16 }) do check(evals[i].step == step, "evaluation %d at %s", i, evals[i].step) end
check(table.concat(saves, ",") == "8,16", "saves %s", table.concat(saves, ","))
local steps, logged = records(out)
check(#logged == 4, "%d eval records", #logged)
for _, r in ipairs(logged) do check(math.abs(r.loss_x10 - 10 * r.loss) < 1e-9, "eval at %d logged %s", r.step, r.loss_x10) end
-- on_save's scalar goes with the next step's record: the one after step 8
for _, r in ipairs(steps) do check((r.saved ~= nil) == (r.step == 9), "step %d: saved = %s", r.step, tostring(r.saved)) end
check(run.logged and run.logged.saved == 1, "the end's on_save log not in the summary")
print("OK")
]], "out=" .. dir .. "/e")
  end)

  it("each parameter group's lr is in the step records, scaled by the schedule", function()
    run_ok("groups.lua", [[
local out = wick.args.out
local optim = wick.optim("adamw", { lr = 0.01, groups = { { params = "bias", weight_decay = 0 },
  { params = "2", lr = 0.03, name = "head" } } })
wick.train { model = model, data = data, optim = optim, schedule = "cosine", warmup_steps = 3, micro_batch = 8,
  epochs = 2, out = out, quiet = true,
  on_step = function(r)
    check(math.abs(r.lr_head - 3 * r.lr) < 1e-12 and math.abs(r.lr_group1 - r.lr) < 1e-12,
      "step %d: lr %s, lr_head %s, lr_group1 %s", r.step, r.lr, tostring(r.lr_head), tostring(r.lr_group1))
  end }
local steps = records(out)
check(#steps == 16 and steps[2].lr_head > steps[1].lr_head and steps[16].lr_head < steps[4].lr_head,
  "the head's lr does not follow the schedule")
print("OK")
]], "out=" .. dir .. "/g")
  end)

  it("a callback's error names the recipe's line; bad answers are named", function()
    fails_with("boom.lua", [[
wick.train { model = model, data = data, optim = wick.optim("sgd", { lr = 0.1 }), micro_batch = 8, quiet = true,
  out = wick.args.out,
  on_step = function(rec)
    if rec.step == 2 then error("boom") end
  end }
]], { "boom.lua:36: on_step (step 2) failed: ", "boom.lua:39: boom" })
    fails_with("number.lua", [[
wick.train { model = model, data = data, optim = wick.optim("sgd", {}), quiet = true, on_step = function() return 5 end }
]], "on_step (step 1) returned a number: expected nil or a table {log = {name = number, ...}, stop = true or a reason}")
    fails_with("key.lua", [[
wick.train { model = model, data = data, optim = wick.optim("sgd", {}), quiet = true,
  on_step = function() return { logg = { x = 1 } } end }
]], "on_step (step 1) returned a table with 'logg'")
    fails_with("value.lua", [[
wick.train { model = model, data = data, optim = wick.optim("sgd", {}), quiet = true,
  on_step = function() return { log = { x = "high" } } end }
]], "on_step (step 1): log: expected names (strings) with numbers, got a string with a string")
    fails_with("clash.lua", [[
wick.train { model = model, data = data, optim = wick.optim("sgd", {}), quiet = true,
  on_step = function() return { log = { loss = 1 } } end }
]], "on_step logged 'loss', which the record holds already")
    fails_with("stop.lua", [[
wick.train { model = model, data = data, optim = wick.optim("sgd", {}), quiet = true,
  on_step = function() return { stop = 1 } end }
]], "on_step (step 1): stop: expected true, false or a reason (a string), got a number")
    fails_with("notfn.lua", [[
wick.train { model = model, data = data, optim = wick.optim("sgd", {}), on_eval = "print" }
]], "wick.train: option 'on_eval': expected a function, got a string")
    fails_with("trainer.lua", [[
wick.trainer { model = model, optim = wick.optim("sgd", {}), on_step = function() end }
]], "wick.trainer: option 'on_step' is wick.train's")
  end)
end)

describe("the best checkpoints and early stopping", function()
  it("keeps the best by the monitored metric beside the newest, and names it", function()
    run_ok("best.lua", [[
local out = wick.args.out
-- the held-out loss falls, so with mode max the best is the first evaluation: kept while newer ones go
local run = wick.train { model = model, data = data, eval_data = held, optim = wick.optim("sgd", { lr = 0.1 }),
  micro_batch = 8, epochs = 3, eval_every = 2, out = out, quiet = true,
  monitor = "eval_loss", monitor_mode = "max", keep_best = 2, keep_checkpoints = 1 }
local _, evals = records(out)
check(#evals == 12, "%d evaluations", #evals)
-- the expected best two, from the records: the two highest losses (the earliest step among equals)
local order = {}
for i, r in ipairs(evals) do order[i] = r end
table.sort(order, function(a, b) if a.loss ~= b.loss then return a.loss > b.loss end return a.step < b.step end)
local want = { [string.format("step-%08d", order[1].step)] = true, [string.format("step-%08d", order[2].step)] = true,
  ["step-00000024"] = true }
local have = checkpoints(out)
local n = 0
for _ in pairs(want) do n = n + 1 end
check(#have == n, "kept %s", table.concat(have, " "))
for _, c in ipairs(have) do check(want[c], "kept %s, not among the best two or the newest", c) end
check(order[1].step < 22, "the test needs a best that is not among the newest (best at %d)", order[1].step)
check(first_line(out .. "/checkpoints/best") == string.format("step-%08d", order[1].step), "best names %s",
  first_line(out .. "/checkpoints/best"))
check(run.best.step == order[1].step and run.best.value == order[1].loss and run.best.metric == "eval_loss",
  "run.best %s", core.json(run.best))
local meta = run_json(out)
check(meta.best_step == order[1].step and meta.best.checkpoint:match("step%-%d+$"), "run.json best %s",
  core.json(meta.best or {}))
print("OK")
]], "out=" .. dir .. "/b")
  end)

  it("patience stops the run, and the count survives a resume", function()
    run_ok("patience.lua", [[
local out = wick.args.out
-- mode max on a falling loss: no evaluation after the first improves
local function go(epochs, resume)
  return wick.train { model = wick.model("mlp", { inputs = 8, hidden = { 16 }, outputs = 3 }), data = data,
    eval_data = held, optim = wick.optim("sgd", { lr = 0.1 }), micro_batch = 8, epochs = epochs, eval_every = 2,
    out = out, quiet = true, resume = resume, monitor = "loss", monitor_mode = "max", patience = 3 }
end
-- 8 steps: evaluations after 2, 4, 6 and 8; the last three do not improve: stopped at 8
local run = go(2, false)
check(run.status == "stopped" and run.steps == 8, "status %s after %d steps", run.status, run.steps)
check(run.stopped.by == "patience" and run.stopped.reason:find("loss did not improve", 1, true), "stopped %s",
  core.json(run.stopped))
check(run.best.step == 2, "best at %d", run.best.step)
print("OK")
]], "out=" .. dir .. "/p")
    -- stopped after 2 evaluations without improvement (6 steps), then resumed with more epochs: one more stops it
    run_ok("patience2.lua", [[
local out = wick.args.out
local function go(epochs, resume, max_steps)
  return wick.train { model = wick.model("mlp", { inputs = 8, hidden = { 16 }, outputs = 3 }), data = data,
    eval_data = held, optim = wick.optim("sgd", { lr = 0.1 }), micro_batch = 8, epochs = epochs, eval_every = 2,
    out = out, quiet = true, resume = resume, monitor = "eval_loss", monitor_mode = "max", patience = 3,
    max_steps = max_steps }
end
local run = go(1, false, 6)  -- evaluations after 2, 4 and at the end (6): two without improvement
check(run.status == "finished" and run.steps == 6, "status %s after %d steps", run.status, run.steps)
run = go(3, true)
check(run.status == "stopped" and run.steps == 8, "resumed: status %s after %d steps", run.status, run.steps)
print("OK")
]], "out=" .. dir .. "/q")
  end)

  it("refuses monitor settings that cannot work", function()
    local base = "wick.train { model = model, data = data, optim = wick.optim('sgd', {}), quiet = true, "
    fails_with("m1.lua", base .. "monitor = 'eval_loss', out = wick.args.out or '/tmp/x' }\n",
      "option 'monitor' needs 'eval_data'")
    fails_with("m2.lua", base .. "eval_data = held, monitor = 'eval_loss' }\n", "option 'monitor' needs 'out'")
    fails_with("m3.lua", base .. "patience = 2 }\n", "option 'patience' needs 'monitor'")
    fails_with("m4.lua", base .. "eval_data = held, monitor = 'eval_loss', out = '" .. dir .. "/m4', patience = 2 }\n",
      "option 'patience' needs eval_every > 0")
    fails_with("m5.lua", base .. "eval_data = held, monitor = 'eval_acc', out = '" .. dir .. "/m5', overwrite = true }\n",
      "option 'monitor': the evaluation has no metric 'eval_acc' (it has eval_accuracy, eval_loss)")
    fails_with("m6.lua", base .. "eval_data = held, monitor = 'eval_loss', monitor_mode = 'up', out = '" .. dir .. "/m6' }\n",
      "option 'monitor_mode'")
  end)
end)
