-- The output head's memory: peak bytes held by CPU tensors (the counting
-- allocator) over one forward + backward + SGD step of a decoder at Qwen2.5's
-- vocabulary (151,936) and width (896; 2 layers), with the head and the
-- cross-entropy computed whole (loss_chunk = 0: [tokens, vocab] fp32 logits
-- and their gradient) and in chunks (loss_chunk = N tokens; by default a 64 MiB budget for a chunk's fp32 logits).
--   wick run bench/logits.lua [micro=8] [seq=512] [layers=2] [chunks=0,1024,256]
-- Tensor bytes on the CPU, the stand-in for CUDA's allocated bytes: a CUDA run
-- adds its context (~0.5 GiB) and what the caching allocator keeps reserved.
local wick = require "wick"
local core = wick.core
local a = wick.args
local micro, seq, layers = a.micro or 8, a.seq or 512, a.layers or 2
local chunks = {}
for c in tostring(a.chunks or "0,1024,256"):gmatch("%d+") do chunks[#chunks + 1] = tonumber(c) end

local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
local file = dofile(here .. "/random_tokens.lua")(micro, seq)
local data = wick.data("text", { file = file, max_length = seq })

local function gib(b) return b / 2 ^ 30 end
print(string.format("decoder_lm: vocab 151936, hidden 896, %d layers (qwen2, tied head), batch %d x %d tokens, fp32, cpu",
  layers, micro, seq))
print(string.format("%-12s %10s %14s %16s %8s %10s", "loss_chunk", "peak GiB", "peak-weights", "peak-wts-grads", "s", "loss"))
for _, chunk in ipairs(chunks) do
  collectgarbage()
  wick.seed(0)
  local model = wick.model("decoder_lm", { family = "qwen2", vocab_size = 151936, hidden_size = 896,
    intermediate_size = 4864, layers = layers, heads = 14, kv_heads = 2, tie_embeddings = true, loss_chunk = chunk })
  local trainer = core.trainer { model = model, optim = wick.optim("sgd", { lr = 0 }), device = "cpu" }
  local loader = core.loader(data, { micro_batch = micro, accumulate = 1, shuffle = false })
  loader:start_epoch(0)
  local batch = loader:next()
  collectgarbage()
  core.reset_peak()
  local t0 = core.now()
  local rec = trainer:step(batch)
  local dt = core.now() - t0
  local peak = core.memory(false).cpu_tensors_peak
  local m = trainer:memory_breakdown()
  print(string.format("%-12s %10.2f %14.2f %16.2f %8.1f %10.4f", chunk == 0 and "0 (whole)" or tostring(chunk), gib(peak),
    gib(peak - m.weights), gib(peak - m.weights - m.gradients), dt, rec.loss))
  model, trainer, loader, batch = nil, nil, nil, nil
end
os.remove(file)
print("peak: most bytes held by CPU tensors during the step (weights, data, gradients, activations, logits);")
print("peak-weights: what the step adds to the weights; peak-wts-grads: less the gradients too (activations and logits).")
