-- wick.train: the recipe's face of the engine's run (host/train/run.hpp),
-- which validates the options against one schema (`wick describe train`),
-- applies command-line overrides, runs the loop, reports progress, writes
-- the run folder and returns the summary:
--   steps, skipped_steps, final_loss, best_loss, history = {{step, loss, lr,
--   grad_norm, items, ...}}, eval, checkpoint, micro_batch, accumulate,
--   memory, peak_memory, seconds, status
local core = require "wick.core"

local M = {}

function M.describe()
  io.write(core.describe_train())
end

function M.train(cfg)
  if type(cfg) ~= "table" then
    error(core.where() .. "wick.train: expected a table of options, got " .. type(cfg), 0)
  end
  return core.train(cfg)
end

return M
