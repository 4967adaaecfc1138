-- One configuration of bench/big_qlora.sh (run under `wick launch`, or alone
-- for one rank): a LLaMA-2 decoder at its real widths (13b or 70b) with
-- `layers` of its layers, NF4 weights made layer by layer as they are built,
-- QLoRA r8 on every linear layer (alpha 16, dropout 0.05), the 8-bit AdamW,
-- bf16-mixed, checkpointing, micro-batch 1 x `seq` tokens; two steps
-- (deferred=true: built with no weights, each rank making its chunks; with
-- out=DIR the run ends by writing the weights there a unit at a time). Every
-- rank prints its step peak with the breakdown, its peaks at the run's start
-- and end, and the bytes its tensors held once the model was built (all
-- bytes held by tensors).
local wick = require "wick"
local a = wick.args
local shapes = {
  -- meta-llama/Llama-2-13b-hf and Llama-2-70b-hf
  ["13b"] = { hidden_size = 5120, intermediate_size = 13824, heads = 40, kv_heads = 40 },
  ["70b"] = { hidden_size = 8192, intermediate_size = 28672, heads = 64, kv_heads = 8 },
}
local shape = assert(shapes[a.model or "13b"], "model=13b or model=70b")
local seq, steps = a.seq or 512, 2
local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
local file = dofile(here .. "/random_tokens.lua")(steps * wick.world_size, seq)
local data = wick.data("text", { file = file, max_length = seq })
wick.seed(0)
local o = { family = "llama", vocab_size = 32000, layers = a.layers or 1, dtype = "bf16", quantize = "nf4",
  tie_embeddings = false, deferred = a.deferred == true }
for k, v in pairs(shape) do o[k] = v end
local model = wick.model("decoder_lm", o)
wick.optim("qlora", { r = 8, alpha = 16, dropout = 0.05, target_modules = { "all-linear" } }):apply(model)
local built = wick.memory(false).cpu_tensors  -- the model as built (whole on this rank, or deferred: adapters only)
local run = wick.train {
  model = model, data = data, optim = wick.optim("adamw8bit", { lr = 2e-4, weight_decay = 0, min_8bit_size = 4096 }),
  micro_batch = 1, accumulate = 1, max_steps = steps, quiet = true, shuffle = false, shard = a.shard or "none",
  precision = "bf16-mixed", checkpointing = true, seed = 1,
  -- (a run folder: the trained weights written there a unit at a time, not gathered back)
  out = a.out, return_weights = a.out and "file" or "gathered",
}
os.remove(file)
local m = run.memory
print(string.format("RESULT %d %d %d %d %d %d %d %d %d %.1f %d", wick.rank, m.peak, m.weights, m.gradients, m.optimizer,
  m.activations, m.start_peak, m.end_peak, m.run_peak, run.seconds / run.steps, built))
