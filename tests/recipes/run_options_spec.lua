-- wick.train's one schema: command-line overrides for every option, typed as
-- the option declares; wick.trainer checked by the same schema; `wick
-- describe train` shows types and defaults.
local H = dofile(assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree") .. "/tests/helpers.lua")

local dir = H.tmpdir()

teardown(function() os.execute("rm -rf " .. dir) end)

local recipe = [[
local wick = require "wick"
local data = wick.data("synthetic", { size = 64, inputs = 8, classes = 3, seed = 1 })
local model = wick.model("mlp", { inputs = 8, hidden = { 16, 16 }, outputs = 3 })
local run = wick.train {
  model = model, data = data, optim = wick.optim("sgd", { lr = 0.1 }),
  micro_batch = 8, accumulate = 2, checkpointing = true, schedule = "linear", quiet = true,
}
print(string.format("micro %d accumulate %d steps %d checkpointing %s lr1 %.6f", run.micro_batch, run.accumulate,
  run.steps, tostring(run.checkpointing), run.history[1].lr))
]]

describe("wick.train options", function()
  it("the command line overrides options of every type, read as each declares", function()
    H.write(dir .. "/r.lua", recipe)
    local code, out, err = H.recipe(dir, "r.lua", recipe, "micro_batch=4 checkpointing=false schedule=cosine warmup_steps=0")
    assert.are.equal(0, code, err)
    -- 64 samples in windows of 4 x 2: 8 steps; cosine without warmup starts at the full lr
    assert.truthy(out:find("micro 4 accumulate 2 steps 8 checkpointing false lr1 0.100000", 1, true), out)
    -- as the recipe says: linear warmup of 0 steps from the full lr too, but checkpointing on and micro 8
    code, out, err = H.recipe(dir, "r.lua", recipe, "")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("micro 8 accumulate 2 steps 4 checkpointing", 1, true), out)
    assert.falsy(out:find("checkpointing false", 1, true), out)
  end)

  it("a command-line value the option cannot take is an error naming key, value and what was expected", function()
    local code, _, err = H.recipe(dir, "r.lua", recipe, "micro_batch=two")
    assert.are.equal(1, code)
    assert.truthy(err:find("micro_batch=two: expected integer >= 1 or string (auto)", 1, true), err)
    code, _, err = H.recipe(dir, "r.lua", recipe, "epochs=nan")
    assert.are.equal(1, code)
    assert.truthy(err:find("epochs=nan: expected integer >= 1", 1, true), err)
    code, _, err = H.recipe(dir, "r.lua", recipe, "clip_grad_norm=inf")
    assert.are.equal(1, code)
    assert.truthy(err:find("clip_grad_norm=inf: expected number >= 0", 1, true), err)
    code, _, err = H.recipe(dir, "r.lua", recipe, "precision=fp8")
    assert.are.equal(1, code)
    assert.truthy(err:find("precision=fp8: expected string (fp32 | bf16-mixed", 1, true), err)
  end)

  it("a misspelt value of a choice option is refused, not read as the default", function()
    local code, _, err = H.recipe(dir, "s.lua", (recipe:gsub("quiet = true", "quiet = true, sync = 'windw'")))
    assert.are.equal(1, code)
    assert.truthy(err:find("s.lua:4: wick.train: option 'sync': expected one of window, micro_batch, got string \"windw\"", 1, true), err)
  end)

  it("wick.trainer rejects unknown keys and checks values with the same schema", function()
    local pre = "local wick = require 'wick'\nlocal m = wick.model('mlp', { inputs = 4, outputs = 2 })\n"
    local code, _, err = H.recipe(dir, "t.lua", pre .. "wick.trainer { model = m, optim = wick.optim('sgd', {}), epochs = 2 }\n")
    assert.are.equal(1, code)
    assert.truthy(err:find("t.lua:3: wick.trainer: unknown option 'epochs' (known options: model, optim, schedule,", 1, true), err)
    code, _, err = H.recipe(dir, "t.lua", pre .. "wick.trainer { model = m, optim = wick.optim('sgd', {}), sync = 'windw' }\n")
    assert.are.equal(1, code)
    assert.truthy(err:find("wick.trainer: option 'sync': expected one of window, micro_batch", 1, true), err)
    code, _, err = H.recipe(dir, "t.lua", pre .. "wick.trainer { model = m, optim = wick.optim('sgd', {}), bucket_mb = 0 }\n")
    assert.are.equal(1, code)
    assert.truthy(err:find("option 'bucket_mb': expected a value in", 1, true), err)
    code, _, err = H.recipe(dir, "t.lua", pre .. "wick.trainer { model = m }\n")
    assert.are.equal(1, code)
    assert.truthy(err:find("wick.trainer: option 'optim' is required", 1, true), err)
  end)

  it("describe train lists every option with its types and default, and the objects", function()
    local code, out = H.run("describe train")
    assert.are.equal(0, code)
    assert.truthy(out:find("micro_batch%s+integer >= 1 or string %(auto%)%s+default 1"), out)
    assert.truthy(out:find("checkpointing%s+boolean or integer >= 1 or list of strings%s+default false"), out)
    assert.truthy(out:find("precision%s+string %(fp32 | bf16%-mixed | fp16%-mixed | bf16%-true | fp16%-true%)%s+default \"fp32\""), out)
    assert.truthy(out:find("model%s+model%s+%(required%)"), out)
    assert.truthy(out:find("total_steps.-%[trainer only%]"), out)
  end)

  it("an error object with __tostring is shown through it", function()
    local code, _, err = H.recipe(dir, "e.lua",
      "error(setmetatable({}, { __tostring = function() return 'a custom error' end }))\n")
    assert.are.equal(1, code)
    assert.truthy(err:find("a custom error", 1, true), err)
  end)
end)
