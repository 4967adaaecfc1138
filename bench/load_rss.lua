-- One row of bench/load_rss.sh: makes a bf16 Hugging Face folder of decoder
-- shapes (mode=make), or loads one in this process and prints the resident
-- memory the load added at its peak (VmHWM less the resident memory before
-- it), against the folder's size:
--   full         decoder_lm { path, dtype = "bf16" }
--   qlora        decoder_lm { path, quantize = "nf4" }, then optim qlora
--   qlora_after  decoder_lm { path, dtype = "bf16" }, then optim qlora (quantizing the loaded model)
--   deferred     (under wick launch) decoder_lm { path, quantize = "nf4", deferred = true }, optim qlora, and
--                one step of shard = "parameters" ending in a file: each rank makes its chunks of each tensor
--                from the mapped folder; prints the rank, the resident memory added at its peak and the CPU
--                seconds of the build and the run (the start's reads and quantization, one step, the end)
--   wick run bench/load_rss.lua mode=make dir=D [shape=qwen0.5b|small]
--   wick run bench/load_rss.lua mode=full|qlora|qlora_after dir=D
local wick = require "wick"
local a = wick.args
local mode, dir = a.mode, a.dir
local shapes = {
  -- Qwen2.5-0.5B: 494 M parameters, 0.99 GB in bf16
  ["qwen0.5b"] = { family = "qwen2", vocab_size = 151936, hidden_size = 896, intermediate_size = 4864, layers = 24,
                   heads = 14, kv_heads = 2, tie_embeddings = true },
  small = { family = "qwen2", vocab_size = 32000, hidden_size = 512, intermediate_size = 1536, layers = 8, heads = 8,
            kv_heads = 2, tie_embeddings = true },
}

local function file_size(path)
  local f = assert(io.open(path, "rb"))
  local n = f:seek("end")
  f:close()
  return n
end

if mode == "make" then
  local o = assert(shapes[a.shape or "qwen0.5b"], "shape: qwen0.5b or small")
  o.dtype = "bf16"
  wick.seed(0)
  wick.save_pretrained(wick.model("decoder_lm", o), dir)
  print(string.format("RESULT %d", file_size(dir .. "/model.safetensors")))
  return
end

-- the plugin library and LibTorch's own memory are in before the baseline
wick.model("decoder_lm", { vocab_size = 8, hidden_size = 8, intermediate_size = 8, layers = 1, heads = 2 })
collectgarbage()
local before = wick.memory(false).resident
local model, q
if mode == "full" then
  model = wick.model("decoder_lm", { path = dir, dtype = "bf16" })
elseif mode == "qlora" then
  model = wick.model("decoder_lm", { path = dir, quantize = "nf4" })
  q = wick.optim("qlora", { r = 8 })
  q:apply(model)
elseif mode == "deferred" then
  local t0 = os.clock()
  model = wick.model("decoder_lm", { path = dir, quantize = "nf4", deferred = true })
  wick.optim("qlora", { r = 8 }):apply(model)
  local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
  local file = dofile(here .. "/random_tokens.lua")(wick.world_size, 16)
  wick.train { model = model, data = wick.data("text", { file = file, max_length = 16 }), micro_batch = 1,
    optim = wick.optim("adamw", { lr = 1e-4 }), max_steps = 1, shuffle = false, quiet = true, seed = 1,
    shard = "parameters", out = a.out, return_weights = "file" }
  local cpu = os.clock() - t0
  os.remove(file)
  print(string.format("DEFERRED %d %d %.1f", wick.rank, wick.memory(false).peak_resident - before, cpu))
  return
elseif mode == "qlora_after" then
  model = wick.model("decoder_lm", { path = dir, dtype = "bf16" })
  q = wick.optim("qlora", { r = 8 })
  q:apply(model)
else
  error("mode: make, full, qlora, qlora_after or deferred")
end
local m = wick.memory(false)
-- what the loaded model holds: the file, less the linear weights' bf16 bytes, plus their NF4 bytes
local held = file_size(dir .. "/model.safetensors")
if q then held = held - q.base_bytes_before + q.base_bytes end
print(string.format("RESULT %d %d %d", m.peak_resident - before, m.resident - before, held))
