-- One configuration of the synchronisation benchmark (run by bench/sync.sh
-- under `wick launch`): trains an mlp on 2 gloo ranks and prints, from rank 0,
-- bytes sent into collectives and wall time per optimizer step.
local wick = require "wick"
local a = wick.args
local steps = a.steps or 12
local acc, micro = a.acc or 1, a.micro or 4
local data = wick.data("synthetic", { size = steps * micro * acc * wick.world_size, inputs = 256, classes = 10 })
local model = wick.model("mlp", { inputs = 256, hidden = { 1024, 1024 }, outputs = 10 })
local run = wick.train {
  model = model, data = data, optim = wick.optim("adamw", {}),
  micro_batch = micro, accumulate = acc, max_steps = steps, quiet = true,
  sync = a.sync or "window", bucket_mb = a.bucket_mb or 25,
}
if wick.rank == 0 then
  print(string.format("RESULT %.0f %.3f", run.comm.bytes / run.steps, run.seconds / run.steps * 1e3))
end
