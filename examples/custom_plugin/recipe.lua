-- Trains the out-of-tree `linear` plugin; put its build folder on WICK_PLUGIN_PATH.
local wick = require "wick"
local data = wick.data("synthetic", { size = 512, inputs = 8, classes = 3, seed = 1 })
local model = wick.model("linear", { inputs = data.inputs, classes = data.num_classes })
local run = wick.train {
  model = model, data = data, optim = wick.optim("sgd", { lr = 0.5, momentum = 0.9 }),
  micro_batch = 16, accumulate = 2, epochs = 5, eval_data = data, quiet = true,
}
print(string.format("linear: %d steps, loss %.4f, accuracy %.3f", run.steps, run.final_loss, run.eval.accuracy))
