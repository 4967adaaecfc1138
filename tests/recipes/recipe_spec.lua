-- Recipes end to end: wick.args, require from anywhere, run folders, resume
-- and SIGTERM.
local H = dofile(assert(os.getenv("WICK_SOURCE"), "WICK_SOURCE must name the source tree") .. "/tests/helpers.lua")

local dir = H.tmpdir()

teardown(function() os.execute("rm -rf " .. dir) end)

describe("recipes", function()
  it("wick.args holds the command line's key=value pairs as Lua values", function()
    local code, out, err = H.recipe(dir, "args.lua",
      "local wick = require 'wick'\nprint(wick.args.lr + 1, wick.args.name, wick.args.flag == true)\n",
      "lr=0.5 name=abc flag=true")
    assert.are.equal(0, code, err)
    assert.are.equal("1.5\tabc\ttrue\n", out)
  end)

  it("require 'wick' works from any directory", function()
    local path = H.write(dir .. "/any.lua", "local wick = require 'wick'\nprint(type(wick.train))\n")
    local code, out = H.sh("cd / && " .. H.wick .. " run " .. path)
    assert.are.equal(0, code)
    assert.are.equal("function\n", out)
  end)

  it("the default recipe learns: loss falls and held-out accuracy is well above chance", function()
    local out_dir = dir .. "/default"
    local code, out, err = H.run("run " .. H.source .. "/configs/default.lua out=" .. out_dir .. " epochs=3")
    assert.are.equal(0, code, err)
    -- the recipe says epochs = 8: the command line's value wins, and says so
    assert.truthy(err:find("wick.train: from the command line: epochs=3", 1, true), err)
    assert.truthy(err:find("step 192/192", 1, true), err)
    local acc = tonumber(out:match("held%-out accuracy ([%d%.]+)"))
    -- measured over the recipe's seeds and wick.seed(k) + seed=k, k = 1..5,
    -- ATEN_CPU_CAPABILITY avx2 and avx512 alike: accuracy 0.854-0.877, the
    -- last logged loss over the first 0.129-0.183 (bounds 0.6 and 0.6)
    assert.truthy(acc and acc > 0.6, out)  -- 4 classes: chance is 0.25
    -- the first and last logged losses, from the metrics file
    local first, last
    for line in io.lines(out_dir .. "/metrics.jsonl") do
      local l = tonumber(line:match('"loss":([%d%.e%-]+)'))
      if l and not line:find('"eval"', 1, true) then
        first = first or l
        last = l
      end
    end
    assert.truthy(first > 1.0 and last < 0.6 * first, string.format("first %s last %s", first, last))
    assert.truthy(H.read(out_dir .. "/run.json"):find('"status":"finished"', 1, true))
    assert.truthy(H.read(out_dir .. "/checkpoints/step-00000192/state.json"):find('"step": 192', 1, true))
  end)

  -- A long run stopped by SIGTERM saves a checkpoint and exits 0; resuming it
  -- ends at exactly the weights of an unbroken run of the same length.
  it("SIGTERM saves a valid checkpoint and a resumed run ends where the unbroken run ends", function()
    local recipe = H.write(dir .. "/long.lua", [[
local wick = require "wick"
local data = wick.data("synthetic", { size = 512, inputs = 64, classes = 8, max_items = 4, seed = 3 })
local model = wick.model("mlp", { inputs = 64, hidden = { 256, 256 }, outputs = 8 })
local run = wick.train {
  model = model, data = data, optim = wick.optim("adamw", { lr = 1e-3 }),
  micro_batch = 8, accumulate = 2, epochs = 100000, max_steps = wick.args.max_steps,
  out = wick.args.out, resume = wick.args.resume or false, log_every = 1,
}
model:save(wick.args.out .. "/final.safetensors")
print("status " .. run.status .. " steps " .. run.steps)
]])
    local a = dir .. "/a"
    -- stop it once it has logged a step
    local code, out, err = H.sh(string.format(
      "%s run %s out=%s max_steps=1000000 & pid=$!; " ..
      "for i in $(seq 600); do [ -s %s/metrics.jsonl ] && break; sleep 0.1; done; kill -TERM $pid; wait $pid",
      H.wick, recipe, a, a))
    assert.are.equal(0, code, err)
    assert.truthy(err:find("SIGTERM at step %d+; checkpoint saved"), err)
    local stopped = tonumber(out:match("status interrupted steps (%d+)"))
    assert.truthy(stopped and stopped >= 1, out)
    assert.truthy(H.read(a .. "/run.json"):find('"status":"interrupted"', 1, true))
    local n = stopped + 15
    code, out, err = H.run(string.format("run %s out=%s resume=true max_steps=%d", recipe, a, n))
    assert.are.equal(0, code, err)
    assert.truthy(err:find("resuming from .*step%-0*" .. stopped), err)
    assert.truthy(out:find("status finished steps " .. n, 1, true), out)
    local b = dir .. "/b"
    code, out, err = H.run(string.format("run %s out=%s max_steps=%d", recipe, b, n))
    assert.are.equal(0, code, err)
    local wa, wb = H.read(a .. "/final.safetensors"), H.read(b .. "/final.safetensors")
    assert.truthy(#wa > 1000)
    assert.are.equal(wb, wa)  -- bit for bit
  end)
end)

describe("step-level primitives", function()
  it("the custom loop example trains and its held-out loss falls", function()
    local code, out, err = H.run("run " .. H.source .. "/examples/custom_loop/loop.lua epochs=3")
    assert.are.equal(0, code, err)
    local losses = {}
    for l in out:gmatch("held%-out loss ([%d%.]+)") do losses[#losses + 1] = tonumber(l) end
    assert.are.equal(3, #losses, out)
    assert.truthy(losses[3] < losses[1], out)
  end)

  it("a loop written with the primitives ends where wick.train ends", function()
    local code, out, err = H.recipe(dir, "same.lua", [[
local wick = require "wick"
local data = wick.data("synthetic", { size = 100, inputs = 8, classes = 3, max_items = 3, seed = 4 })
local function fresh() wick.seed(5); return wick.model("mlp", { inputs = 8, hidden = { 12 }, outputs = 3 }) end
local opts = { lr = 0.01, weight_decay = 0.1 }

local a = fresh()
wick.train { model = a, data = data, optim = wick.optim("adamw", opts), schedule = "cosine", warmup_steps = 2,
  micro_batch = 3, accumulate = 4, epochs = 2, seed = 9, clip_grad_norm = 0.5, quiet = true }

local b = fresh()
local loader = wick.loader(data, { micro_batch = 3, accumulate = 4, seed = 9 })
local trainer = wick.trainer { model = b, optim = wick.optim("adamw", opts),
  schedule = wick.schedule("cosine", { warmup_steps = 2 }), clip_grad_norm = 0.5,
  total_steps = 2 * loader:windows_per_epoch() }
for epoch = 0, 1 do
  loader:start_epoch(epoch)
  for w in loader.next, loader do trainer:step(w) end
end
a:save(wick.args.dir .. "/a.safetensors")
b:save(wick.args.dir .. "/b.safetensors")
print(trainer:steps())
]], "dir=" .. dir)
    assert.are.equal(0, code, err)
    assert.are.equal("18\n", out)  -- ceil(100 / 12) windows x 2 epochs
    local wa, wb = H.read(dir .. "/a.safetensors"), H.read(dir .. "/b.safetensors")
    assert.truthy(#wa > 500)
    assert.are.equal(wa, wb)
  end)
end)

describe("language model recipe", function()
  it("lm_scratch learns the license texts: the loss falls and it writes a sample", function()
    local out_dir = dir .. "/lm"
    local code, out, err = H.run("run " .. H.source .. "/configs/lm_scratch.lua epochs=1 out=" .. out_dir)
    assert.are.equal(0, code, err)
    assert.truthy(out:find("before: This License", 1, true), out)
    assert.truthy(out:find("after:  This License", 1, true), out)
    local first, last
    for line in io.lines(out_dir .. "/metrics.jsonl") do
      local l = tonumber(line:match('"loss":([%d%.e%-]+)'))
      first = first or l
      last = l
    end
    -- last / first 0.495-0.536 over the recipe's seeds and wick.seed(k) + seed=k,
    -- k = 1, 2, avx2 and avx512 alike (bound 0.7; the first loss is ~5.6)
    assert.truthy(first > 4.5 and last < 0.7 * first, string.format("first %s last %s", first, last))
    -- the saved folder continues a prompt from the shell
    -- (byte tokens: the folder has no tokenizer.json, which wick generate refuses unless told tokenizer=bytes)
    code, out, err = H.run("generate " .. out_dir .. "/model tokenizer=bytes prompt='This License ' max_new_tokens=20 seed=3")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("^This License "), out)
    assert.truthy(#out > #"This License " + 10, out)
    -- and LoRA fine-tunes the saved model on other licenses
    code, out, err = H.run("run " .. H.source .. "/configs/lm_lora.lua epochs=1 base=" .. out_dir .. "/model out=" .. dir .. "/lora")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("LoRA on 21 layers: %d+ of %d+ parameters train"), out)
    assert.truthy(H.read(dir .. "/lora/adapter/adapter_config.json"):find('"peft_type": "LORA"', 1, true))
  end)
end)

describe("generate", function()
  it("on_token sees each token as it is chosen, the same ids generate returns, sampled or greedy", function()
    local code, out, err = H.recipe(dir, "generate.lua", [[
local wick = require "wick"
local m = wick.model("decoder_lm", { vocab_size = 32, hidden_size = 16, intermediate_size = 32, layers = 1, heads = 2 })
for _, o in ipairs({ { max_new_tokens = 12 }, { max_new_tokens = 12, temperature = 0.9, top_k = 8, top_p = 0.9, seed = 5 } }) do
  local seen = {}
  o.on_token = function(id) seen[#seen + 1] = id end
  local ids = m:generate({ 1, 2, 3 }, o)
  assert(#ids == 12 and #seen == 12, #ids .. " ids, " .. #seen .. " seen")
  for i = 1, #ids do assert(ids[i] == seen[i], "token " .. i .. " differs") end
  o.on_token = nil
  local again = m:generate({ 1, 2, 3 }, o)
  for i = 1, #ids do assert(ids[i] == again[i], "without on_token, token " .. i .. " differs") end
end
print("same")
]])
    assert.are.equal(0, code, err)
    assert.are.equal("same\n", out)
  end)

  it("stops where on_token returns true or after any of eos_ids; repetition_penalty 1 changes nothing", function()
    local code, out, err = H.recipe(dir, "generate_stop.lua", [[
local wick = require "wick"
local m = wick.model("decoder_lm", { vocab_size = 32, hidden_size = 16, intermediate_size = 32, layers = 1, heads = 2 })
local all = m:generate({ 1, 2, 3 }, { max_new_tokens = 12 })
local n = 0
local cut = m:generate({ 1, 2, 3 }, { max_new_tokens = 12, on_token = function() n = n + 1; return n == 4 end })
assert(#cut == 4 and n == 4, #cut .. " ids, " .. n .. " calls")
local at = m:generate({ 1, 2, 3 }, { max_new_tokens = 12, eos_ids = { 99, all[5] } })
assert(#at <= 5 and at[#at] == all[5], #at .. " ids")
local same = m:generate({ 1, 2, 3 }, { max_new_tokens = 12, repetition_penalty = 1.0 })
for i = 1, #all do assert(all[i] == cut[i] or i > 4, "token " .. i) ; assert(all[i] == same[i], "penalty 1: token " .. i) end
local tok = wick.tokenizer("bytes")
assert(tok:decode(tok:encode("h\195\169"), { skip_special_tokens = true }) == "h\195\169")
assert(tok:decode({ 104, 195 }) == "h\239\191\189", "a broken character is U+FFFD")
print("ok")
]])
    assert.are.equal(0, code, err)
    assert.are.equal("ok\n", out)
  end)
end)

describe("vision recipes", function()
  -- the video recipe in a small setting that learns in about a minute on two
  -- cores: 400 clips per class at 64x48, two frames, a one-layer ViT of width 32
  -- (held-out accuracy 0.63-0.74 over recipe seeds 1-4 with transformers' init;
  -- over wick.seed(k) + seed=k, k = 0 the recipe as it is: avx2 0.635, 0.677, 0.719, 0.729, 0.594 for
  -- k = 0, 1, 2, 3, 5 and avx512 0.667, 0.594 for k = 5, 6)
  it("video.lua learns the made clips' shapes: held-out accuracy well above chance (1/3)", function()
    for _, part in ipairs({ { "train", 400, 1 }, { "held_out", 32, 7 } }) do
      local code, _, err = H.run(string.format("make-clips %s/vclips/%s --classes 3 --per-class %d --size 64x48 " ..
        "--seconds 0.5 --seed %d --no-extras --no-images", dir, part[1], part[2], part[3]))
      assert.are.equal(0, code, err)
    end
    local code, out, err = H.run("run " .. H.source .. "/configs/video.lua clips=" .. dir .. "/vclips epochs=30 " ..
      "accumulate=1 micro_batch=8 image_size=48 patch=8 max_frames=2 hidden=32 layers=1 lr=1e-3 pool=mean log_every=1000 " ..
      "out=" .. dir .. "/video", "OMP_NUM_THREADS=1")  -- one thread: 4500 small steps, immune to a busy second core
    assert.are.equal(0, code, err)
    local acc = tonumber(out:match("max_frames 2, image_size 48: final loss [%d.]+, held%-out accuracy ([%d.]+), 4500 steps"))
    assert.truthy(acc, out)
    -- 96 held-out clips: the worst of the runs above was 0.594 (57 right), within
    -- 16% of the old bound 0.5; 0.45 (44 right) has probability 0.007 for a
    -- guesser (32 +- 4.6 right) and a model that does not learn, which
    -- answers one class, scores 1/3
    assert.is_true(acc >= 0.45, "held-out accuracy " .. acc .. " is not clearly above chance")
    assert.truthy(H.read(dir .. "/video/metrics.jsonl"):find('"loss"', 1, true))
  end)

  it("qlora on a vlm adapts the language model's layers only and trains", function()
    local code, _, err = H.run("make-clips " .. dir .. "/qclips --classes 2 --per-class 8 --size 64x48 --seconds 0.2 --no-extras")
    assert.are.equal(0, code, err)
    local out
    code, out, err = H.recipe(dir, "qlora_vlm.lua", [[
local wick = require "wick"
local d = wick.data("image_folder", { manifest = wick.args.m, image_size = 32, resize = "exact", tokenizer = "bytes",
  prompt = "<image>" })
local m = wick.model("vlm", { image_token_id = d.image_token_id, vocab_size = d.vocab_size, image_size = 32,
  patch_size = 8, vision_hidden_size = 32, vision_intermediate_size = 64, vision_layers = 2, vision_heads = 2,
  hidden_size = 64, intermediate_size = 128, layers = 2, heads = 4 })
local q = wick.optim("qlora", { r = 4, target_modules = { "all-linear" }, modules_to_save = { "multi_modal_projector" },
  compute_dtype = "fp32" })
q:apply(m)
local r = wick.train { model = m, data = d, optim = wick.optim("adamw", { lr = 3e-3 }), micro_batch = 8, epochs = 8,
  quiet = true }
print(q.layers, r.history[1].loss, r.history[#r.history].loss)
]], "m=" .. dir .. "/qclips/images/manifest.csv")
    assert.are.equal(0, code, err)
    local layers, first, last = out:match("^(%d+)\t(%S+)\t(%S+)")
    -- 2 decoder layers x 7 linear layers; the vision tower's 2 x 6 are not adapted
    assert.are.equal("14", layers, out)
    assert.truthy(tonumber(last) < tonumber(first), out)
  end)

  it("vlm.lua runs its stages and captions held-out images", function()
    local code, _, err = H.run("make-clips " .. dir .. "/iclips --classes 3 --per-class 32 --size 64x48 --seconds 0.2 --no-extras")
    assert.are.equal(0, code, err)
    local out
    code, out, err = H.run("run " .. H.source .. "/configs/vlm.lua clips=" .. dir .. "/iclips epochs=1 image_size=32 out=" ..
      dir .. "/vlm")
    assert.are.equal(0, code, err)
    for _, want in ipairs({ "stage 0: vision tower", "stage 0: language model", "stage 1: projector alone",
                            "stage 2: LoRA on %d+ layers %+ projector", "shape accuracy on %d+ held%-out images" }) do
      assert.truthy(out:find(want), want .. " not in:\n" .. out)
    end
    assert.truthy(H.read(dir .. "/vlm/adapter/adapter_config.json"):find("multi_modal_projector", 1, true))
  end)
end)

-- Memory knobs from a recipe: a CPU tensor cap (WICK_CPU_MEMORY_LIMIT) makes
-- allocations fail as a full GPU does, through the same recovery code.
local MEMORY_RECIPE = [[
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 512, inputs = 32, classes = 4, seed = 3 })
wick.seed(1)
-- activations (256 samples x 64 features per layer) outweigh weights
local model = wick.model("mlp", { inputs = 32, hidden = { 64, 64, 64 }, outputs = 4 })
local opts = { model = model, data = data, optim = wick.optim("sgd", { lr = 0.2, momentum = 0.9 }), epochs = 2,
  shuffle = false, out = a.out, micro_batch = a.micro or 256, accumulate = a.acc or 1 }
if a.auto then opts.micro_batch, opts.batch_size = "auto", 256 end
if a.precision then opts.precision = a.precision end
if a.preset then opts = wick.preset(a.preset, opts) end
local run = wick.train(opts)
print(string.format("micro %d acc %d eval %.7f", run.micro_batch, run.accumulate, wick.evaluate(model, data).loss))
]]

describe("memory knobs", function()
  local path = H.write(dir .. "/memory.lua", MEMORY_RECIPE)
  local function run(args, env)
    local code, out, err = H.run("run " .. path .. " " .. args, env)
    assert.are.equal(0, code, err)
    local micro, acc, eval = out:match("micro (%d+) acc (%d+) eval ([%d%.]+)")
    return tonumber(micro), tonumber(acc), tonumber(eval), err
  end

  it("report memory per step and its breakdown at the end", function()
    local _, _, _, err = run("out=" .. dir .. "/mem0")
    assert.truthy(err:find("wick: memory on cpu: peak [%d%.]+ %a+ held by tensors = weights [%d%.]+ KiB %+ gradients " ..
      "[%d%.]+ KiB %+ optimizer [%d%.]+ KiB %+ data buffers [%d%.]+ KiB %+ activations [%d%.]+ %a+ %+ other"), err)
    local line = H.read(dir .. "/mem0/metrics.jsonl"):match("[^\n]+")
    for _, k in ipairs { "mem_resident", "mem_peak_resident", "mem_tensors", "mem_tensors_peak", "grad_norm" } do
      assert.truthy(line:find('"' .. k .. '":', 1, true), k .. " missing in " .. line)
    end
  end)

  it("out of memory splits the window and micro_batch = 'auto' fits a cap, both ending where the plain run ends", function()
    local _, _, plain = run("out=" .. dir .. "/mem1")
    local json = H.read(dir .. "/mem1/run.json")
    local peak, act = tonumber(json:match('"peak":(%d+)')), tonumber(json:match('"activations":(%d+)'))
    assert.truthy(peak and act and act > 0.4 * peak, json)
    local cap = "WICK_CPU_MEMORY_LIMIT=" .. math.floor(peak - act / 3)
    -- a fixed micro-batch of 256 that does not fit: split, and the same result
    local micro, acc, eval, err = run("", cap)
    assert.truthy(err:find("wick.train: out of memory in step %d+: micro_batch 256 %-> %d+, accumulate 1 %-> %d+"), err)
    assert.truthy(micro < 256 and micro * acc == 256, micro .. " x " .. acc)
    assert.truthy(math.abs(eval - plain) < 1e-5, eval .. " vs " .. plain)
    assert.falsy(err:find("micro_batch auto", 1, true))
    -- auto: probed down to a micro-batch that fits, accumulate keeps the batch
    micro, acc, eval, err = run("auto=true", cap)
    assert.truthy(err:find("wick.train: micro_batch auto: 256 [rn][ue][ne][sd]") and err:find("keeps the batch of 256", 1, true), err)
    assert.truthy(micro < 256 and micro * acc == 256, micro .. " x " .. acc)
    assert.truthy(math.abs(eval - plain) < 1e-5, eval .. " vs " .. plain)
    -- a cap so tight that splitting ends at one sample: auto gets there too (its probe counted
    -- the accumulated gradients twice, so one sample "needed" more than the cap and it gave up)
    micro, acc, eval = run("", "WICK_CPU_MEMORY_LIMIT=250KiB")
    assert.truthy(micro * acc == 256 and math.abs(eval - plain) < 1e-5, micro .. " x " .. acc .. " " .. eval)
    micro, acc, eval, err = run("auto=true", "WICK_CPU_MEMORY_LIMIT=250KiB")
    assert.truthy(micro * acc == 256 and math.abs(eval - plain) < 1e-5, micro .. " x " .. acc .. " " .. eval .. err)
    -- on_oom = "fail" stops with the reason instead
    local code, _, ferr = H.run("run " .. path .. " on_oom=fail", cap)
    assert.are.equal(1, code)
    assert.truthy(ferr:find("out of memory", 1, true) and ferr:find('on_oom = "fail"', 1, true), ferr)
  end)

  it("wick plan measures each knob without training, suggests what fits, and its estimate matches the run", function()
    local code, out, err = H.run("plan " .. path .. " --device-memory 1MiB out=" .. dir .. "/plan")
    assert.are.equal(0, code, err)
    for _, want in ipairs { "as given", 'precision = "bf16-mixed"', "checkpointing = true",
      "micro_batch = 128, accumulate x 2", "all of these" } do
      assert.truthy(out:find(want, 1, true), want .. " missing in\n" .. out)
    end
    assert.truthy(out:find("fastest that fits 1.0 MiB", 1, true) or out:find("nothing tried fits", 1, true), out)
    assert.falsy(io.open(dir .. "/plan/run.json"), "plan trained")
    local estimate = tonumber(out:match("estimate as given: (%d+) bytes"))
    run("out=" .. dir .. "/plan_run")
    local json = H.read(dir .. "/plan_run/run.json")
    local measured = tonumber(json:match('"peak":(%d+)')) - tonumber(json:match('"other":(%d+)'))
    assert.truthy(math.abs(estimate - measured) < 0.15 * measured, estimate .. " vs " .. measured)
    -- a cap the recipe as given does not fit: the suggestion changes something
    local _, out2 = H.run("plan " .. path .. " --device-memory " .. math.floor(estimate * 0.95) .. "B")
    assert.truthy(out2:find("fastest that fits", 1, true), out2)
    assert.falsy(out2:find('precision = "fp32", checkpointing = false, micro_batch = 256,', 1, true), out2)
    assert.falsy(out2:find("the recipe as given fits", 1, true), out2)
    -- room to spare: that the recipe fits as given is said first, and it stays the advice
    local _, out3 = H.run("plan " .. path .. " --device-memory " .. math.floor(estimate * 3) .. "B")
    local fits = out3:find("the recipe as given fits", 1, true)
    assert.truthy(fits and fits < out3:find("fastest that fits", 1, true), out3)
    local bad, _, berr = H.run("plan " .. path .. " --device-memory lots")
    assert.are.equal(2, bad, berr)  -- a usage error
    assert.truthy(berr:find("--device-memory: expected a size such as 8GiB", 1, true), berr)
    -- a number alone would be bytes: 12 means 12 GB to whoever typed it
    bad, _, berr = H.run("plan " .. path .. " --device-memory 12")
    assert.are.equal(2, bad, berr)
    assert.truthy(berr:find("--device-memory: '12' has no unit: expected a size such as 12GiB or 12GB", 1, true), berr)
  end)

  -- One step of one setting stalled (another process took the core for 3 s)
  -- must not decide the advice: each setting's time is the median of five
  -- steps. The stall falls in the second timed step as given (optimizer step
  -- 3: one untimed, then five timed), and the step after it is slower too
  -- (caches gone cold: about 2x here, which a median of three took). A mean or
  -- a maximum would make the recipe as given 0.6-3 s a step and every other
  -- setting about 0.01x of it; measured with the median, the ratios stay
  -- 0.5x-2.5x over repeated runs, 0.16x-3.2x with both cores kept busy.
  it("wick plan takes each setting's median step: one stalled step changes no ratio", function()
    local recipe = H.write(dir .. "/stall.lua", [[
local wick = require "wick"
wick.train { model = wick.model("mlp", { inputs = 256, hidden = { 1024, 1024 }, outputs = 4 }),
  data = wick.data("synthetic", { size = 256, inputs = 256, classes = 4, seed = 1 }),
  optim = wick.optim("stall_once", { lr = 0.01, stall_at = 3, stall_s = 3 }), micro_batch = 64, epochs = 1 }
]])
    local env = "WICK_PLUGIN_PATH=" .. H.test_plugins .. "/optim"
    local code, out, err = H.run("plan " .. recipe .. " --device-memory 1GiB", env)
    assert.are.equal(0, code, err)
    assert.truthy(err:find("stall_once: step 3 stalls 3.0 s", 1, true), err)
    local rows = 0
    for name, ratio in out:gmatch("\n  (%S[^\n]-)%s+%d[%d%.]* %a?i?B%s+%-?%d+%% +([%d%.]+)x") do
      rows = rows + 1
      -- a step of this model takes milliseconds, the stall 3 s
      assert.truthy(tonumber(ratio) >= 0.05, name .. ": " .. ratio .. "x in\n" .. out)
    end
    assert.truthy(rows >= 3, out)
    assert.truthy(out:find("the recipe as given fits", 1, true), out)
  end)

  it("wick plan plans a recipe whose weights are converted (bf16-true) in that precision alone", function()
    local code, out, err = H.run("plan " .. path .. " precision=bf16-true --device-memory 1MiB")
    assert.are.equal(0, code, err)
    assert.truthy(out:find("precision bf16-true", 1, true), out)
    assert.truthy(out:find("micro_batch = 128, accumulate x 2", 1, true), out)
    -- no row leaves bf16-true: the weights it converted are not fp32 again
    assert.falsy(out:find('precision = "bf16-mixed"', 1, true), out)
    assert.falsy(out:find('precision = "fp32"', 1, true), out)
    assert.falsy(out:find("failed", 1, true), out)
    local estimate = tonumber(out:match("estimate as given: (%d+) bytes"))
    run("precision=bf16-true out=" .. dir .. "/plan_true")
    local json = H.read(dir .. "/plan_true/run.json")
    local measured = tonumber(json:match('"peak":(%d+)')) - tonumber(json:match('"other":(%d+)'))
    assert.truthy(math.abs(estimate - measured) < 0.15 * measured, estimate .. " vs " .. measured)
    -- checkpointing too: "all of these" changes only the micro-batch, as the
    -- row before it does, whose figures it repeats (not measured twice)
    local code2, out2, err2 = H.run("plan " .. path .. " precision=bf16-true checkpointing=true --device-memory 1MiB")
    assert.are.equal(0, code2, err2)
    local half = out2:match("\n  micro_batch = 128, accumulate x 2%s+([^\n]-)%s*\n")
    local all, same = out2:match("\n  all of these%s+([^\n]-)%s+%(the settings of \"([^\"]+)\"%)\n")
    assert.truthy(half and all, out2)
    assert.are.equal("micro_batch = 128, accumulate x 2", same)
    assert.are.equal(half, all)
    assert.falsy(out2:find("checkpointing = true  ", 1, true), out2)  -- (given: no row of its own)
  end)

  it("presets merge into a recipe and train with their knobs", function()
    local _, _, plain = run("out=" .. dir .. "/mem3")
    local _, _, eval = run("preset=gpu_8gb out=" .. dir .. "/mem2")
    local json = H.read(dir .. "/mem2/run.json")
    assert.truthy(json:find('"precision":"bf16-mixed"', 1, true), json)
    assert.truthy(json:find('"checkpointing":["0","2","4"]', 1, true), json)
    assert.truthy(math.abs(eval - plain) < 0.01, eval .. " vs " .. plain)  -- bf16 autocast: close to fp32
  end)
end)
