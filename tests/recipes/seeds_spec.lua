-- The seed recipes (configs/seeds/) in their small form: each trains end to
-- end on media wick makes, with the seed's own settings (micro-batch x
-- accumulation, LoRA / QLoRA, frames, ...), and its loss falls. Their real
-- shapes are measured by bench/seeds.sh.
local H = dofile(assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree") .. "/tests/helpers.lua")

local dir = H.tmpdir()
teardown(function() os.execute("rm -rf " .. dir) end)

local function losses(out, name)
  local first, final = out:match("seed " .. name .. ": %d+ steps, first loss ([%d.]+), final loss ([%d.]+)")
  return tonumber(first), tonumber(final)
end

describe("seed recipes, small shapes", function()
  setup(function()
    -- 25-frame clips (padded to the 100 frames seed 001 reads) and still images
    local code, _, err = H.run("make-clips " .. dir .. "/clips --classes 3 --per-class 16 --size 64x48 --seconds 1 " ..
      "--fps 25 --no-extras")
    assert.are.equal(0, code, err)
  end)

  for _, case in ipairs {
    { "000", "000_microvlm.lua", "epochs=3" },
    { "001", "001_video_llm.lua", "epochs=2 micro_batch=2" },
    { "002", "002_car_clip.lua", "epochs=4" },
    { "003", "003_llava_qlora.lua", "epochs=2" },
    { "004", "004_gearhead_lm.lua", "epochs=6" },
  } do
    local name, file, args = case[1], case[2], case[3]
    it(file .. " trains in its small form and its loss falls", function()
      local code, out, err = H.run("run " .. H.source .. "/configs/seeds/" .. file .. " clips=" .. dir .. "/clips out=" ..
        dir .. "/run" .. name .. " " .. args, "OMP_NUM_THREADS=1")
      assert.are.equal(0, code, err)
      assert.truthy(out:find("seed " .. name .. " (", 1, true), out)
      local first, final = losses(out, name)
      assert.truthy(first and final, out)
      assert.is_true(final < first, string.format("seed %s: loss %.4f -> %.4f", name, first, final))
    end)
  end

  it("shape= other than small or real is refused by name", function()
    local code, _, err = H.run("run " .. H.source .. "/configs/seeds/004_gearhead_lm.lua clips=" .. dir ..
      "/clips shape=huge out=" .. dir .. "/bad")
    assert.are_not.equal(0, code)
    assert.truthy(err:find("shape=huge: expected small or real", 1, true), err)
  end)
end)
