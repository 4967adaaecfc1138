-- A run folder as wick.train writes it (rank 0, when `out` is given):
--   metrics.jsonl   one JSON record per optimizer step and per evaluation: the
--                   source of truth that the report and `wick runs` read
--   events.out.tfevents.*
--                   the same numbers for TensorBoard: every numeric field of a
--                   record is a scalar (see M.scalar_tags); the recipe and the
--                   resolved options as text
--   run.json        status (running, finished, interrupted, failed), the
--                   recipe, options, times, pid and host; rewritten at the end
--   recipe.lua      a copy of the recipe as it ran
local core = require "wick.core"

local M = {}

--- TensorBoard tags of a metrics record: `train/<field>` (or `eval/<field>`
-- for evaluation records), memory fields `mem_<x>` as `memory/<x>`; numbers
-- as they are, booleans as 0 or 1; `step`, `epoch` and `eval` are not scalars.
-- Non-finite numbers (the gradient norm of a skipped step) are left out, as
-- metrics.jsonl writes them as null.
function M.scalar_tags(rec)
  local out = {}
  local group = rec.eval and "eval/" or "train/"
  for k, v in pairs(rec) do
    if k ~= "step" and k ~= "epoch" and k ~= "eval" then
      if type(v) == "boolean" then v = v and 1 or 0 end
      if type(v) == "number" and v == v and v ~= math.huge and v ~= -math.huge then
        local tag = k:match("^mem_(.+)$")
        out[tag and ("memory/" .. tag) or (group .. k)] = v
      end
    end
  end
  return out
end

--- 1.5 GiB, 12.3 MiB, 800 KiB ("-" for no number).
function M.fmt_bytes(n)
  if type(n) ~= "number" then return "-" end
  if n >= 2 ^ 30 then return string.format("%.2f GiB", n / 2 ^ 30) end
  if n >= 2 ^ 20 then return string.format("%.1f MiB", n / 2 ^ 20) end
  return string.format("%.0f KiB", n / 2 ^ 10)
end

--- m:ss or h:mm:ss ("-" for no number).
function M.fmt_time(s)
  if type(s) ~= "number" then return "-" end
  s = math.max(0, math.floor(s + 0.5))
  if s >= 3600 then return string.format("%d:%02d:%02d", s / 3600, (s % 3600) / 60, s % 60) end
  return string.format("%d:%02d", s / 60, s % 60)
end

local function read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end
M.read_file = read_file

local function read_json(path)
  local s = read_file(path)
  if not s then return nil end
  local ok, v = pcall(core.json_decode, s)
  return ok and v or nil
end
M.read_json = read_json

-- Markdown table of the options, for TensorBoard's text tab.
local function options_markdown(opts)
  local keys = {}
  for k in pairs(opts) do keys[#keys + 1] = k end
  table.sort(keys)
  local lines = { "| option | value |", "|---|---|" }
  for _, k in ipairs(keys) do lines[#lines + 1] = string.format("| %s | %s |", k, tostring(opts[k])) end
  return table.concat(lines, "\n")
end

--- Opens the run folder. info: recipe (path), options (plain values),
-- total_steps, start_step (the trainer's step: > 0 when resumed), extra
-- fields for run.json.
function M.open(dir, info)
  core.mkdirs(dir)
  local log = { dir = dir }
  local prev = info.start_step > 0 and read_json(dir .. "/run.json") or nil
  local recipe_text = info.recipe and read_file(info.recipe) or nil
  if recipe_text then
    local copy = dir .. "/recipe.lua"
    if read_file(copy) ~= recipe_text then core.write_file(copy, recipe_text) end
  end
  local p = core.process()
  local meta = {
    status = "running", recipe = info.recipe, options = info.options, total_steps = info.total_steps,
    started = prev and prev.started or os.time(), resumed = prev and ((prev.resumed or 0) + 1) or nil,
    start_step = info.start_step, pid = p.pid, host = p.host,
  }
  for k, v in pairs(info.extra or {}) do meta[k] = v end
  log.meta = meta
  log.prev_best = prev and prev.best_loss
  core.write_file(dir .. "/run.json", core.json(meta) .. "\n")
  log.metrics = assert(io.open(dir .. "/metrics.jsonl", info.start_step > 0 and "a" or "w"))
  log.events = core.event_writer(dir)
  local step = info.start_step
  if recipe_text then log.events:text(step, "recipe", "```lua\n" .. recipe_text .. "\n```") end
  log.events:text(step, "options", options_markdown(info.options))
  return setmetatable(log, { __index = M })
end

--- One record: a line of metrics.jsonl and its scalars in the event file.
function M:record(rec)
  self.metrics:write(core.json(rec), "\n")
  self.metrics:flush()
  self.events:scalars(rec.step, M.scalar_tags(rec))
end

--- Ends the run: fields (status, final_loss, ...) merged into run.json.
function M:finish(fields)
  for k, v in pairs(fields) do self.meta[k] = v end
  if self.prev_best and (not self.meta.best_loss or self.prev_best < self.meta.best_loss) then
    self.meta.best_loss = self.prev_best
  end
  self.meta.ended = os.time()
  self.meta.pid = nil
  if self.metrics then self.metrics:close(); self.metrics = nil end
  if self.events then self.events:close(); self.events = nil end
  core.write_file(self.dir .. "/run.json", core.json(self.meta) .. "\n")
end

return M
