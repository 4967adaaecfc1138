-- data "text" as a recipe uses it: files given by patterns, a held-out
-- split made twice (split = "train" for data, "eval" for eval_data) that
-- wick.train evaluates on, and documents packed apart (pack_attention =
-- "document") training a decoder with checkpointed blocks. (The split's draw and the packed samples
-- are tests/plugins/data/text's; packed logits against unpacked ones
-- tests/reference/test_pack_attention.py's.)
local H = dofile(assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree") .. "/tests/helpers.lua")

local dir = H.tmpdir()
teardown(function() os.execute("rm -rf " .. dir) end)

describe("data text", function()
  it("trains on the train split of patterned files, packed apart, and evaluates on the held-out split", function()
    os.execute("mkdir -p " .. dir .. "/data")
    for f = 1, 3 do
      local rows = {}
      for i = 1, 10 do rows[i] = '{"text": "file ' .. f .. ' row ' .. i .. ' says something"}' end
      H.write(dir .. "/data/f" .. f .. ".jsonl", table.concat(rows, "\n") .. "\n")
    end
    H.write(dir .. "/more.txt", "a plain document\n")
    local code, out, err = H.recipe(dir, "t.lua", [[
local wick = require "wick"
local o = { files = { "]] .. dir .. [[/data/*.jsonl", "]] .. dir .. [[/more.txt" }, eval_fraction = 0.1,
            pack = true, pack_attention = "document", max_length = 64, cache_dir = "none" }
local data = wick.data("text", o)
o.split = "eval"
local held = wick.data("text", o)
local model = wick.model("decoder_lm", { vocab_size = data.vocab_size, hidden_size = 16, layers = 1, heads = 2,
  intermediate_size = 32 })
local run = wick.train { model = model, data = data, eval_data = held, eval_every = 2, checkpointing = true,
  optim = wick.optim("adamw", { lr = 0.01 }), micro_batch = 4, quiet = true }
print("tokens", data.tokens + held.tokens)
print("steps", run.steps, run.eval.loss == run.eval.loss, run.eval.loss > 0)
]])
    assert.are.equal(0, code, err)
    -- 30 rows of 36 or 37 bytes and the end of text, and "a plain document\n" + 1: all of them, split apart
    local total = 0
    for f = 1, 3 do for i = 1, 10 do total = total + #("file " .. f .. " row " .. i .. " says something") + 1 end end
    total = total + #"a plain document\n" + 1
    assert.truthy(out:find("tokens\t" .. total .. "\n", 1, true), out)
    assert.truthy(out:find("steps\t%d+\ttrue\ttrue"), out)
  end)
end)
