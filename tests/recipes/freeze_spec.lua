-- model:freeze / model:unfreeze from a recipe: counts returned as
-- model:parameters() gives them, training runs with the rest, and bad
-- patterns are refused in one line naming the call.
local H = dofile(assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree") .. "/tests/helpers.lua")

local dir = H.tmpdir()
teardown(function() os.execute("rm -rf " .. dir) end)

local head = [[
local wick = require "wick"
local data = wick.data("synthetic", { size = 64, inputs = 8, classes = 3 })
local model = wick.model("mlp", { inputs = 8, hidden = { 16 }, outputs = 3 })
]]

describe("model:freeze", function()
  it("returns the total and trainable counts and trains the rest", function()
    local code, out, err = H.recipe(dir, "f.lua", head .. [[
local total, trainable = model:freeze("0")
print("frozen", total, trainable)
print("again", model:parameters())
total, trainable = model:unfreeze({ "0.bias" })
print("unfrozen", total, trainable)
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }), micro_batch = 16, quiet = true }
print("steps", run.steps)
]])
    assert.are.equal(0, code, err)
    -- 0: 16x8 + 16; 2: 3x16 + 3
    assert.truthy(out:find("frozen\t195\t51", 1, true), out)
    assert.truthy(out:find("again\t195\t51", 1, true), out)
    assert.truthy(out:find("unfrozen\t195\t67", 1, true), out)
    assert.truthy(out:find("steps\t4", 1, true), out)
  end)

  it("refuses to unfreeze, in a callback, what the run's optimizer does not hold, and allows it after", function()
    local code, out, err = H.recipe(dir, "cb.lua", head .. [[
model:freeze("0")
local ok, why = pcall(wick.train, { model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }),
  micro_batch = 16, quiet = true, on_step = function(rec) if rec.step == 2 then model:unfreeze("0") end end })
print("in callback", ok, why)
-- unfreezing what the run already trains is harmless; after the run, anything goes
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }), micro_batch = 16,
  quiet = true, on_step = function(rec) if rec.step == 2 then model:unfreeze("2") end end }
print("same", run.steps)
print("after", model:unfreeze("0"))
]])
    assert.are.equal(0, code, err)
    assert.truthy(out:find("in callback	false", 1, true), out)
    assert.truthy(out:find("unfreeze: '0.weight' and 1 more would train, but the model is being trained by a " ..
      "trainer whose optimizer was made without them", 1, true), out)
    assert.truthy(out:find("same	4", 1, true), out)
    assert.truthy(out:find("after	195	195", 1, true), out)
  end)

  for _, case in ipairs {
    { "model:freeze('vision_tower')", "freeze: 'vision_tower' names no parameter of the model" },
    { "model:freeze(3)", "bad argument #2 to 'freeze' (string or list of strings expected, got number)" },
    { "model:unfreeze({ '0', 7 })", "bad argument #2 to 'unfreeze' (a list of strings expected, item 2 is a number)" },
    { "model:freeze({})", "freeze: expected a pattern or a list of patterns, got none" },
  } do
    it("refuses " .. case[1], function()
      local code, _, err = H.recipe(dir, "bad.lua", head .. case[1] .. "\n")
      assert.are_not.equal(0, code)
      assert.truthy(err:find(case[2], 1, true), err)
      assert.truthy(err:find("bad.lua:4", 1, true), err)  -- the recipe's line
      assert.falsy(err:find("frame #", 1, true), err)
    end)
  end
end)
