-- One configuration of the sharding benchmark (run by bench/shard.sh under
-- `wick launch`): the decoder of bench/memory.lua (6 blocks, hidden 512,
-- sequences of 256 tokens) trained with AdamW on gloo ranks (precision=
-- bf16-true masters=true: bf16 weights with fp32 master copies); every rank
-- prints its peak bytes held by tensors with the breakdown (weights include
-- the masters, also given alone), the bytes it sent per optimizer step (as
-- ring algorithms send them) and the time per step.
local wick = require "wick"
local a = wick.args
local steps = a.steps or 4
local acc, micro, seq = a.acc or 2, a.micro or 2, a.seq or 256
local layers, hidden = a.layers or 6, a.hidden or 512
local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
local file = dofile(here .. "/random_tokens.lua")(steps * micro * acc * wick.world_size, seq)
local data = wick.data("text", { file = file, max_length = seq })
wick.seed(0)
local model = wick.model("decoder_lm", { vocab_size = 257, hidden_size = hidden,
  intermediate_size = math.floor(hidden * 11 / 4), layers = layers, heads = 8 })
local run = wick.train {
  model = model, data = data, optim = wick.optim(a.optim or "adamw", {}),
  micro_batch = micro, accumulate = acc, max_steps = steps, quiet = true, shuffle = false,
  shard = a.shard or "none", clip_grad_norm = 1.0, precision = a.precision or "fp32",
  master_weights = a.masters == true or a.masters == "true",
}
os.remove(file)
local m = run.memory
print(string.format("RESULT %d %d %d %d %d %d %.0f %.1f %.6f %d %d", wick.rank, m.peak, m.weights, m.gradients,
  m.optimizer, m.activations, run.comm.sent / run.steps, run.seconds / run.steps * 1e3, run.final_loss, m.master_weights,
  m.run_peak))
