-- Bad input in recipes: each error names what, where (file:line) and what was
-- expected, and exits non-zero.
local H = dofile(assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree") .. "/tests/helpers.lua")

local dir = H.tmpdir()

teardown(function() os.execute("rm -rf " .. dir) end)

local function fails_with(text, expected, args, env)
  local code, _, err = H.recipe(dir, "recipe.lua", text, args, env)
  assert.are.equal(1, code, err)
  for _, e in ipairs(type(expected) == "table" and expected or { expected }) do
    assert.truthy(err:find(e, 1, true), "expected <" .. e .. "> in:\n" .. err)
  end
  assert.falsy(err:find("terminate called", 1, true))
  assert.falsy(err:find("frame #", 1, true))
  return err
end

describe("recipe errors", function()
  it("a syntax error gives file, line and message", function()
    fails_with("local wick = require 'wick'\nlocal x = = 1\n", { "recipe.lua:2:", "unexpected symbol" })
  end)

  it("a runtime error gives file, line and message", function()
    fails_with("local wick = require 'wick'\nerror('boom')\n", "recipe.lua:2: boom")
  end)

  it("an unknown plugin lists the known ones", function()
    fails_with("local wick = require 'wick'\n\nwick.model('mpl', {})\n",
      { "recipe.lua:3: unknown plugin 'mpl'", "known plugins: adamw, adamw8bit, clip, decoder_lm, image_folder, lora, mlp, qlora, schedule, sgd, synthetic, tensors, text, video_classifier, video_folder, vit, vlm" })
  end)

  it("an unknown option names plugin and key and lists the options", function()
    fails_with("local wick = require 'wick'\nwick.model('mlp', { hiden = 3 })\n",
      { "recipe.lua:2: model 'mlp': unknown option 'hiden'", "known options: inputs, hidden, outputs" })
  end)

  it("a wrong type says what was expected and what was given", function()
    fails_with("local wick = require 'wick'\nwick.model('mlp', { inputs = 'four' })\n",
      "recipe.lua:2: model 'mlp': option 'inputs': expected integer, got string \"four\"")
  end)

  it("a value out of range says the range", function()
    fails_with("local wick = require 'wick'\nwick.optim('adamw', { lr = -1 })\n",
      "recipe.lua:2: optim 'adamw': option 'lr': expected a value >= 0, got integer -1")
    fails_with("local wick = require 'wick'\nwick.model('mlp', { activation = 'swish' })\n",
      "option 'activation': expected one of relu, gelu, tanh, sigmoid, silu, got string \"swish\"")
  end)

  it("a bad argument reads like Lua's own", function()
    fails_with("local wick = require 'wick'\nwick.data(42)\n",
      "recipe.lua:2: bad argument #1 to 'data' (string expected, got number)")
  end)

  it("a plugin built for another ABI is refused with both versions", function()
    local abi = H.read(H.source .. "/sdk/wick/plugin.hpp"):match("#define WICK_ABI_VERSION (%d+)")
    fails_with("local wick = require 'wick'\nwick.model('bad_abi', {})\n",
      { "recipe.lua:2: plugin 'bad_abi'", "test_bad_abi.so", "ABI 999", "this host has ABI " .. abi },
      nil, "WICK_PLUGIN_PATH=" .. H.test_plugins)
  end)

  it("a plugin whose factory throws is named with its message", function()
    fails_with("local wick = require 'wick'\nwick.model('throws', { size = 5 })\n",
      { "recipe.lua:2: model 'throws'", "failed to build: deliberate failure (size 5)" },
      nil, "WICK_PLUGIN_PATH=" .. H.test_plugins)
  end)

  it("a plugin may be named by its path", function()
    local code, _, err = H.recipe(dir, "path.lua", string.format(
      "local wick = require 'wick'\nlocal m = wick.model(%q, { inputs = 3 })\nassert(m:parameters() > 0)\n",
      H.test_plugins .. "/../plugins/mlp.so"))
    assert.are.equal(0, code, err)
  end)

  it("a missing weights file is named", function()
    fails_with("local wick = require 'wick'\nlocal m = wick.model('mlp', {})\nm:load('nope.safetensors')\n",
      "recipe.lua:3: cannot open safetensors file nope.safetensors")
  end)

  it("a corrupt weights file is named with the problem", function()
    H.write(dir .. "/bad.safetensors", "\16\0\0\0\0\0\0\0{\"a\": garbage!!}")
    fails_with("local wick = require 'wick'\nlocal m = wick.model('mlp', {})\nm:load('" .. dir .. "/bad.safetensors')\n",
      { "recipe.lua:3: corrupt safetensors file " .. dir .. "/bad.safetensors", "not valid JSON" })
  end)

  it("a missing data file is named", function()
    fails_with("local wick = require 'wick'\nwick.data('tensors', { file = 'missing.safetensors' })\n",
      { "recipe.lua:2: data 'tensors'", "cannot open safetensors file missing.safetensors" })
  end)

  it("a required option left out is named", function()
    fails_with("local wick = require 'wick'\nwick.data('tensors', {})\n",
      "recipe.lua:2: data 'tensors': option 'file' is required")
  end)

  it("wick.train errors point at the recipe line that called it", function()
    local prelude = "local wick = require 'wick'\nlocal d = wick.data('synthetic', { size = 8 })\n" ..
      "local m = wick.model('mlp', { inputs = 16, outputs = 4 })\nlocal o = wick.optim('sgd', {})\n"
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, epoch = 2 }\n",
      { "recipe.lua:5: wick.train: unknown option 'epoch'", "epochs" })
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, micro_batch = 0 }\n",
      "recipe.lua:5: wick.train: option 'micro_batch': expected a value >= 1, got integer 0")
    fails_with(prelude .. "wick.train { model = m, data = d }\n",
      "recipe.lua:5: wick.train: option 'optim' is required")
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, resume = true }\n",
      "recipe.lua:5: wick.train: option 'resume' needs 'out'")
    -- memory knobs: bad values named with what was expected
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, precision = 'fp8' }\n",
      'recipe.lua:5: wick.train: option \'precision\': expected one of fp32, bf16-mixed, fp16-mixed, bf16-true, fp16-true, got string "fp8"')
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, checkpointing = -1 }\n",
      "recipe.lua:5: wick.train: option 'checkpointing': expected a value >= 1, got integer -1")
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, checkpointing = { '0', 'nope' } }\n",
      "option 'checkpointing': the model has no block 'nope' (its blocks: 0)")
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, memory_fraction = 2 }\n",
      "recipe.lua:5: wick.train: option 'memory_fraction': expected a value in [0, 1], got integer 2")
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, micro_batch = 'auto' }\n",
      "option 'micro_batch': 'auto' needs batch_size")
    -- options that would have been ignored without a word
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, micro_batch = 'auto', batch_size = 8, accumulate = 2 }\n",
      "recipe.lua:5: wick.train: option 'accumulate' goes with a micro_batch given: micro_batch = 'auto' finds accumulate")
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, out = '', save_every = 1 }\n",
      "recipe.lua:5: wick.train: option 'out': expected a run folder's path, got \"\"")
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, seed = 2^53 + 1 }\n",
      "option 'seed': expected integer, got number 9007199254740992 (past 2^53 = 9007199254740992, where Lua's numbers are no longer exact integers")
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, ema_start = 10 }\n",
      "recipe.lua:5: wick.train: option 'ema_start' needs 'ema'")
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, precision = 'fp16-mixed', loss_scale = { 1, 2 } }\n",
      "loss_scale: expected a number or a table of named keys (init, growth, backoff, interval), got a list")
    fails_with(prelude .. "wick.train { model = m, data = d, optim = o, precision = 'fp16-mixed', loss_scale = { init = 8, growht = 2 } }\n",
      "loss_scale: unknown key 'growht' (expected init, growth, backoff, interval)")
    fails_with(prelude .. "wick.train(wick.preset('gpu_9gb', { model = m, data = d, optim = o }))\n",
      { "recipe.lua:5: wick.preset: no preset 'gpu_9gb'", "gpu_8gb", "max_speed" })
    -- an engine error inside the Lua train loop: a model that does not fit the data
    local err = fails_with(prelude .. "wick.train { model = wick.model('mlp', { inputs = 3 }), data = d, optim = o, quiet = true }\n",
      { "recipe.lua:5: step 1, micro-batch 1 of 1: the model's forward failed on {x Float [1, 16], y Long [1]}",
        "mat1 and mat2 shapes cannot be multiplied" })
    assert.falsy(err:find("frame #", 1, true), err)
  end)

  it("parameter groups: each bad group is named with what was expected", function()
    local prelude = "local wick = require 'wick'\nlocal d = wick.data('synthetic', { size = 8 })\n" ..
      "local m = wick.model('mlp', { inputs = 16, outputs = 4 })\n"
    local function optim(groups) return "local o = wick.optim('adamw', { lr = 0.01, groups = " .. groups .. " })\n" end
    local train = "wick.train { model = m, data = d, optim = o, quiet = true }\n"
    fails_with(prelude .. optim("'bias'"),
      "recipe.lua:4: optim 'adamw': groups: expected a list of tables {params = patterns, <options>}, got a string")
    fails_with(prelude .. optim("{ { weight_decay = 0 } }"),
      "recipe.lua:4: optim 'adamw': groups[1]: expected params = a pattern or a list of patterns")
    fails_with(prelude .. optim("{ { params = { 'bias', 3 } } }"),
      "optim 'adamw': groups[1]: params[2]: expected a pattern (a string), got a number")
    fails_with(prelude .. optim("{ { params = 'bias', name = 'no_decay', wieght_decay = 0 } }"),
      { "recipe.lua:4: optim 'adamw': group 'no_decay': ", "unknown option 'wieght_decay'" })
    fails_with(prelude .. optim("{ { params = 'bias', lr = -1 } }"),
      { "optim 'adamw': groups[1]: ", "option 'lr': expected a value >= 0" })
    fails_with(prelude .. optim("{ { params = 're:(bias' } }"),
      "optim 'adamw': groups[1]: 're:(bias' is not a valid regular expression")
    fails_with("local wick = require 'wick'\nwick.optim('schedule', { type = 'cosine', groups = { { params = 'x' } } })\n",
      "recipe.lua:2: optim 'schedule': groups: only an optimizer has parameter groups; this makes a schedule")
    -- a group that names nothing trainable: found when the optimizer meets the model
    fails_with(prelude .. optim("{ { params = 'lm_head' } }") .. train,
      { "recipe.lua:5: ", "optim 'adamw': groups[1] (params 'lm_head') takes no trainable parameter",
        "named like " })
    -- two groups of one name logged their learning rates under one key
    fails_with(prelude .. optim("{ { params = 'bias', name = 'a' }, { params = 'weight', name = 'a' } }") .. train,
      "optim 'adamw': groups[1] and groups[2] are both named 'a' (each group's learning rate is logged as lr_<name>)")
    -- an earlier group took everything the second names
    fails_with(prelude .. optim("{ { params = '*' }, { params = 'bias', name = 'late' } }") .. train,
      "optim 'adamw': late (params 'bias') takes no trainable parameter (an earlier group takes what it names")
  end)
end)
