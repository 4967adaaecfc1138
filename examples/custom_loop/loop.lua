-- A training loop of your own, on the step-level primitives wick.train uses:
-- a loader hands out windows of `accumulate` micro-batches; one trainer:step
-- per window is one optimizer step with the full batch's gradients.
--   wick run examples/custom_loop/loop.lua [epochs=N] [out=DIR]
local wick = require "wick"

local epochs = wick.args.epochs or 3
local data = wick.data("synthetic", { size = 1024, inputs = 16, classes = 4, seed = 1, teacher_seed = 3 })
local held_out = wick.data("synthetic", { size = 256, inputs = 16, classes = 4, seed = 2, teacher_seed = 3 })
local model = wick.model("mlp", { inputs = 16, hidden = { 64 }, outputs = 4 })

local loader = wick.loader(data, { micro_batch = 8, accumulate = 4, seed = 1 })
local trainer = wick.trainer {
  model = model,
  optim = wick.optim("adamw", { lr = 3e-3 }),
  schedule = wick.schedule("linear", { warmup_steps = 10 }),
  total_steps = epochs * loader:windows_per_epoch(),
  clip_grad_norm = 1.0,
}

for epoch = 0, epochs - 1 do
  loader:start_epoch(epoch)
  local loss_sum, items = 0, 0
  for window in loader.next, loader do
    local s = trainer:step(window)
    loss_sum, items = loss_sum + s.loss * s.items, items + s.items
  end
  local eval = wick.evaluate(model, held_out)
  print(string.format("epoch %d: %d steps, train loss %.4f, held-out loss %.4f, accuracy %.3f",
    epoch + 1, trainer:steps(), loss_sum / items, eval.loss, eval.accuracy))
end

if wick.args.out then
  print("checkpoint: " .. trainer:save(wick.args.out .. "/checkpoints", { epoch = epochs, window = 0 }))
end
