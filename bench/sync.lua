-- One configuration of the synchronisation benchmark (run by bench/sync.sh
-- under `wick launch`): trains the decoder language model (2 blocks, hidden
-- 256, sequences of 64 tokens) on 2 gloo ranks and prints, from rank 0, bytes
-- sent into collectives and wall time per optimizer step.
local wick = require "wick"
local a = wick.args
local steps = a.steps or 8
local acc, micro, seq = a.acc or 1, a.micro or 4, a.seq or 64
local here = (arg and arg[0] or ""):match("^(.*)/[^/]*$") or "."
local file = dofile(here .. "/random_tokens.lua")(steps * micro * acc * wick.world_size, seq)
local data = wick.data("text", { file = file, max_length = seq })
wick.seed(0)
local model = wick.model("decoder_lm", { vocab_size = 257, hidden_size = 256, intermediate_size = 688, layers = 2,
  heads = 4 })
local run = wick.train {
  model = model, data = data, optim = wick.optim("adamw", {}),
  micro_batch = micro, accumulate = acc, max_steps = steps, quiet = true, shuffle = false,
  sync = a.sync or "window", bucket_mb = a.bucket_mb or 25,
}
os.remove(file)
if wick.rank == 0 then
  print(string.format("RESULT %.0f %.3f", run.comm.bytes / run.steps, run.seconds / run.steps * 1e3))
end
