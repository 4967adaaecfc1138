-- The default recipe: a small MLP learns a synthetic 4-class problem labelled
-- by a random teacher network. Gradient accumulation (micro 16 x 4) gives the
-- exact gradients of a batch of 64. Runs in seconds on two CPU cores.
--   wick run configs/default.lua [epochs=N] [out=DIR] [resume=true]
local wick = require "wick"

local task = { inputs = 32, classes = 4, teacher_seed = 7 }
local train = wick.data("synthetic", { size = 4096, seed = 1, inputs = task.inputs, classes = task.classes, teacher_seed = task.teacher_seed })
-- the same teacher labels other points: a held-out set
local held_out = wick.data("synthetic", { size = 1024, seed = 2, inputs = task.inputs, classes = task.classes, teacher_seed = task.teacher_seed })

local model = wick.model("mlp", { inputs = train.inputs, hidden = { 128, 128 }, outputs = train.num_classes })
local optim = wick.optim("adamw", { lr = 3e-3, weight_decay = 0.01 })

local run = wick.train {
  model = model, data = train, optim = optim,
  schedule = wick.schedule("cosine", { warmup_steps = 20 }),
  micro_batch = 16, accumulate = 4, epochs = 8,
  clip_grad_norm = 1.0,
  eval_data = held_out, eval_every = 128,
  out = wick.args.out or "runs/default", save_every = 200,
  seed = 1,
}

model:save((wick.args.out or "runs/default") .. "/model.safetensors")
print(string.format("final loss %.4f, held-out accuracy %.3f, %d steps", run.final_loss, run.eval.accuracy, run.steps))
