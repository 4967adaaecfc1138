-- Nothing of a run is lost: a folder holding a run is refused unless the
-- recipe continues it (resume) or replaces it (overwrite); a finished run
-- resumed stays as it was; a damaged newest checkpoint is named and the run
-- resumes from the newest intact one; records after the checkpoint go.
local H = dofile(assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree") .. "/tests/helpers.lua")

local dir = H.tmpdir()

teardown(function() os.execute("rm -rf " .. dir) end)

local recipe = H.write(dir .. "/r.lua", [[
local wick = require "wick"
local data = wick.data("synthetic", { size = 256, inputs = 8, classes = 3, seed = 1 })
local model = wick.model("mlp", { inputs = 8, hidden = { 16 }, outputs = 3 })
local run = wick.train {
  model = model, data = data, optim = wick.optim("adamw", { lr = 1e-2 }), micro_batch = 8, epochs = 10,
  save_every = 10, keep_checkpoints = 2, log_every = 1, quiet = true,
}
print(string.format("status %s steps %d final %.6f", run.status, run.steps, run.final_loss or -1))
]])

-- The folder's files with their contents, to see that nothing changed.
local function snapshot(d)
  local code, out = H.sh("cd " .. d .. " && find . -type f | sort | xargs md5sum")
  assert(code == 0)
  return out
end

local function run(args) return H.run("run " .. recipe .. " " .. args) end

describe("run folders", function()
  it("a folder that holds a run is refused without resume or overwrite, and left as it was", function()
    local out = dir .. "/reuse"
    local code, _, err = run("out=" .. out .. " max_steps=40")
    assert.are.equal(0, code, err)
    local before = snapshot(out)
    code, _, err = run("out=" .. out .. " max_steps=20")
    assert.are.equal(1, code)
    assert.truthy(err:find("out '" .. out .. "' holds a run (status finished, 40 of 40 steps); resume = true continues it, " ..
      "overwrite = true replaces it", 1, true), err)
    assert.are.equal(before, snapshot(out))
  end)

  it("overwrite = true replaces the run: only the new run's records and checkpoints remain", function()
    local out = dir .. "/over"
    assert.are.equal(0, (run("out=" .. out .. " max_steps=40")))
    local code, _, err = run("out=" .. out .. " max_steps=20 overwrite=true")
    assert.are.equal(0, code, err)
    assert.truthy(err:find("overwrite = true: removed the run that was in", 1, true), err)
    local steps = 0
    for line in io.lines(out .. "/metrics.jsonl") do
      local s = tonumber(line:match('"step":(%d+)'))
      assert.truthy(s and s <= 20, line)
      steps = steps + 1
    end
    assert.are.equal(20, steps)
    local _, ls = H.sh("ls " .. out .. "/checkpoints")
    assert.are.equal("last\nstep-00000010\nstep-00000020\n", ls)
    assert.are.equal("step-00000020\n", H.read(out .. "/checkpoints/last"))
  end)

  it("resuming a finished run changes nothing and gives its numbers", function()
    local out = dir .. "/done"
    local code, first = run("out=" .. out .. " max_steps=30")
    assert.are.equal(0, code)
    local before = snapshot(out)
    local again, err
    code, again, err = run("out=" .. out .. " max_steps=30 resume=true")
    assert.are.equal(0, code, err)
    assert.are.equal(first, again)  -- status, steps and final loss as the run ended
    assert.are.equal(before, snapshot(out))
  end)

  it("a damaged newest checkpoint is named and the run resumes from the newest intact one", function()
    local out = dir .. "/damaged"
    assert.are.equal(0, (run("out=" .. out .. " max_steps=20")))
    -- 64 bytes of 0xFF inside the newest model file
    assert.are.equal(0, (H.sh("printf '\\377%.0s' $(seq 64) | dd of=" .. out ..
      "/checkpoints/step-00000020/model.safetensors bs=1 seek=200 conv=notrunc 2>/dev/null")))
    local code, outp, err = run("out=" .. out .. " max_steps=30 resume=true")
    assert.are.equal(0, code, err)
    assert.truthy(err:find("skipping a damaged checkpoint: " .. out ..
      "/checkpoints/step-00000020: model.safetensors has CRC-32C ", 1, true), err)
    assert.truthy(err:find("model%.safetensors has CRC%-32C %x+, state%.json recorded %x+"), err)
    assert.truthy(outp:find("status finished steps 30", 1, true), outp)
    -- a newest checkpoint without its state.json is named too
    os.remove(out .. "/checkpoints/step-00000030/state.json")
    code, outp, err = run("out=" .. out .. " max_steps=40 resume=true")
    assert.are.equal(0, code, err)
    assert.truthy(err:find("step%-00000030 has no state%.json"), err)
    assert.truthy(outp:find("status finished steps 40", 1, true), outp)
  end)

  it("no intact checkpoint to resume from is an error naming each", function()
    local out = dir .. "/none"
    assert.are.equal(0, (run("out=" .. out .. " max_steps=20")))
    for _, s in ipairs { "10", "20" } do
      H.sh("truncate -s 100 " .. out .. "/checkpoints/step-000000" .. s .. "/rng.safetensors")
    end
    local code, _, err = run("out=" .. out .. " max_steps=30 resume=true")
    assert.are.equal(1, code)
    assert.truthy(err:find("no checkpoint in " .. out .. "/checkpoints is intact", 1, true), err)
    assert.truthy(err:find("step-00000010: rng.safetensors holds 100 bytes", 1, true), err)
  end)

  it("records logged after the checkpoint a resumed run starts from are dropped, not duplicated", function()
    local out = dir .. "/after"
    assert.are.equal(0, (run("out=" .. out .. " max_steps=20")))
    -- as after a kill -9 at step 25: steps 21..25 logged, no checkpoint of them
    local f = assert(io.open(out .. "/metrics.jsonl", "a"))
    for s = 21, 25 do f:write('{"step":' .. s .. ',"loss":9}\n') end
    f:write('{"step":26,"lo')  -- half a line
    f:close()
    local code, _, err = run("out=" .. out .. " max_steps=30 resume=true")
    assert.are.equal(0, code, err)
    local seen = {}
    for line in io.lines(out .. "/metrics.jsonl") do
      local s = tonumber(line:match('"step":(%d+)'))
      assert.falsy(seen[s], "step " .. tostring(s) .. " twice")
      seen[s] = true
      assert.falsy(line:find('"loss":9,', 1, true) or line:find('"loss":9}', 1, true), line)
    end
    for s = 1, 30 do assert.truthy(seen[s], "step " .. s .. " missing") end
  end)

  it("overwrite = true in the recipe's own folder removes the earlier run but never the recipe", function()
    local here = dir .. "/own"
    os.execute("mkdir -p " .. here)
    local text = H.read(recipe)
    H.write(here .. "/recipe.lua", text)
    for _ = 1, 2 do
      local code, _, err = H.sh("cd " .. here .. " && " .. H.wick .. " run recipe.lua out=. max_steps=10 overwrite=true")
      assert.are.equal(0, code, err)
    end
    assert.are.equal(text, H.read(here .. "/recipe.lua"))
    assert.truthy(H.read(here .. "/metrics.jsonl"):find('"step":10', 1, true))
  end)

  it("a resume that would repeat or skip samples, or read another data set's position, is refused naming both", function()
    local r2 = H.write(dir .. "/r2.lua", [[
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = a.size or 256, inputs = 8, classes = 3, seed = 1 })
local model = wick.model("mlp", { inputs = 8, hidden = { 16 }, outputs = 3 })
local optim = a.opt == "sgd" and wick.optim("sgd", { lr = 1e-2, momentum = 0.9 })
  or a.opt == "plain" and wick.optim("sgd", { lr = 1e-2 }) or wick.optim("adamw", { lr = 1e-2 })
local run = wick.train { model = model, data = data, optim = optim, micro_batch = 8, epochs = 10, save_every = 10,
  quiet = true }
print(string.format("status %s steps %d", run.status, run.steps))
]])
    local out = dir .. "/windows"
    local function go(args) return H.run("run " .. r2 .. " out=" .. out .. " " .. args) end
    assert.are.equal(0, (go("max_steps=20")))
    local before = snapshot(out)
    local code, _, err = go("max_steps=30 resume=true micro_batch=4")
    assert.are.equal(1, code)
    assert.truthy(err:find("was written with windows of micro_batch 8 x accumulate 1 = 8 samples per rank, this " ..
      "run's hold 4 x 1 = 4: its position would repeat or skip samples", 1, true), err)
    code, _, err = go("max_steps=30 resume=true size=128")
    assert.are.equal(1, code)
    assert.truthy(err:find("was written training on 256 samples, this run's data holds 128", 1, true), err)
    -- stopped at window 20 of 32: another order of the epoch's samples
    code, _, err = go("max_steps=30 resume=true seed=7")
    assert.are.equal(1, code)
    assert.truthy(err:find("stopped in the middle of an epoch whose samples were shuffled with seed 0; this run's " ..
      "are shuffled with seed 7: its position would repeat some samples and skip others; resume with shuffle = " ..
      "true, seed = 0", 1, true), err)
    code, _, err = go("max_steps=30 resume=true shuffle=false")
    assert.are.equal(1, code)
    assert.truthy(err:find("this run's are in order (shuffle = false)", 1, true), err)
    code, _, err = go("max_steps=30 resume=true opt=sgd")
    assert.are.equal(1, code)
    assert.truthy(err:find("holds optimizer state this run's optimizer does not take (0.bias.exp_avg, ", 1, true), err)
    assert.are.equal(before, snapshot(out))
    -- a checkpoint of an optimizer that keeps no state, resumed by one that keeps some
    local plain = dir .. "/stateless"
    assert.are.equal(0, (H.run("run " .. r2 .. " out=" .. plain .. " max_steps=20 opt=plain")))
    local kept = snapshot(plain)
    code, _, err = H.run("run " .. r2 .. " out=" .. plain .. " max_steps=30 resume=true")
    assert.are.equal(1, code)
    assert.truthy(err:find("holds no optimizer state after 20 steps taken, and this run's optimizer keeps some", 1, true), err)
    assert.are.equal(kept, snapshot(plain))
    assert.are.equal(0, (H.run("run " .. r2 .. " out=" .. plain .. " max_steps=30 resume=true opt=plain")))
    -- steps skipped on an fp16 overflow made no optimizer state, and a
    -- checkpoint of such steps only resumes as any other
    local r3 = H.write(dir .. "/r3.lua", [[
local wick = require "wick"
local data = wick.data("synthetic", { size = 256, inputs = 8, classes = 3, seed = 1 })
local model = wick.model("mlp", { inputs = 8, hidden = { 16 }, outputs = 3 })
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 1e-2 }), micro_batch = 8,
  epochs = 10, save_every = 2, quiet = true, precision = "fp16-mixed", loss_scale_init = 1e30 }
print(string.format("status %s steps %d skipped %d", run.status, run.steps, run.skipped_steps or -1))
]])
    local skipped = dir .. "/skipped"
    local outs
    code, outs, err = H.run("run " .. r3 .. " out=" .. skipped .. " max_steps=4")
    assert.are.equal(0, code, err)
    assert.truthy(H.read(skipped .. "/checkpoints/step-00000004/state.json"):find('"skipped_steps": 4', 1, true))
    code, outs, err = H.run("run " .. r3 .. " out=" .. skipped .. " max_steps=6 resume=true")
    assert.are.equal(0, code, err)
    assert.truthy(outs:find("status finished steps 6", 1, true), outs)
    -- the same windows cut otherwise continue
    local outp
    code, outp, err = go("max_steps=30 resume=true micro_batch=4 accumulate=2")
    assert.are.equal(0, code, err)
    assert.truthy(outp:find("status finished steps 30", 1, true), outp)
  end)

  it("a checkpoint whose state.json lost the run's position is refused, not read as epoch 0", function()
    local out = dir .. "/position"
    assert.are.equal(0, (run("out=" .. out .. " max_steps=20")))
    for _, s in ipairs { "10", "20" } do
      local f = out .. "/checkpoints/step-000000" .. s .. "/state.json"
      local text, n = H.read(f):gsub('"window": %d+,%s*', "")
      assert.are.equal(1, n)
      H.write(f, text)
    end
    local code, _, err = run("out=" .. out .. " max_steps=30 resume=true")
    assert.are.equal(1, code)
    assert.truthy(err:find("step-00000020 has no extra.window in its state.json", 1, true), err)
  end)

  it("a damaged checkpoint of a later step never costs the one just written", function()
    local out = dir .. "/later"
    assert.are.equal(0, (run("out=" .. out .. " max_steps=20")))
    -- a checkpoint of step 40, damaged (as a resume found it), beside the intact 10 and 20
    local ck = out .. "/checkpoints/"
    H.sh("cp -r " .. ck .. "step-00000020 " .. ck .. "step-00000040")
    local st = ck .. "step-00000040/state.json"
    H.write(st, (H.read(st):gsub('"step": 20', '"step": 40')))
    H.sh("printf 'x' >> " .. ck .. "step-00000040/model.safetensors")
    local code, outp, err = run("out=" .. out .. " max_steps=30 resume=true keep_checkpoints=1")
    assert.are.equal(0, code, err)
    assert.truthy(outp:find("status finished steps 30", 1, true), outp)
    assert.are.equal("step-00000030\n", H.read(ck .. "last"))
    local _, ls = H.sh("ls " .. ck)
    assert.are.equal("last\nstep-00000030\nstep-00000040\n", ls)
    code, outp, err = run("out=" .. out .. " max_steps=30 resume=true keep_checkpoints=1")
    assert.are.equal(0, code, err)
    assert.truthy(outp:find("status finished steps 30", 1, true), outp)
  end)

  it("resume and overwrite together are refused", function()
    local code, _, err = run("out=" .. dir .. "/both resume=true overwrite=true")
    assert.are.equal(1, code)
    assert.truthy(err:find("options 'resume' and 'overwrite' exclude each other", 1, true), err)
  end)
end)
