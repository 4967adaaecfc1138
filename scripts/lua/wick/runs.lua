-- `wick runs [DIR] [--json]`: the runs under DIR (folders holding a
-- metrics.jsonl or run.json, up to three levels down), one line each: recipe,
-- steps, final and best loss, peak memory, duration, status. Numbers come from
-- metrics.jsonl (the source of truth); the status from run.json: finished,
-- stopped (patience or a callback), interrupted, failed, or running; a run whose process is gone without
-- ending (killed, crashed) shows as failed.
local core = require "wick.core"
local runlog = require "wick.runlog"
local fmt_bytes, fmt_time = runlog.fmt_bytes, runlog.fmt_time
local report = require "wick.report"

local M = {}

local function find_runs(dir, depth, out)
  local entries = core.list_dir(dir)
  if not entries then return out end
  local is_run = false
  for _, e in ipairs(entries) do
    if not e.dir and (e.name == "metrics.jsonl" or e.name == "run.json") then is_run = true end
  end
  if is_run then
    out[#out + 1] = dir
  elseif depth > 0 then
    for _, e in ipairs(entries) do
      if e.dir and e.name ~= "checkpoints" then find_runs(dir .. "/" .. e.name, depth - 1, out) end
    end
  end
  return out
end

--- One run's summary row.
function M.summary(dir)
  local meta, meta_problems = report.read_meta(dir)
  -- run.json's fields as wick.train writes them; anything else counts as absent
  local function typed(v, t) return type(v) == t and v or nil end
  local ok, run = pcall(report.read_run, dir)
  local steps = ok and run.steps or {}
  local last = steps[#steps]
  local best, peak = nil, 0
  for _, r in ipairs(steps) do
    if not r.skipped and type(r.loss) == "number" and (not best or r.loss < best) then best = r.loss end
    local p = r.mem_peak or r.mem_peak_resident
    if type(p) == "number" and p > peak then peak = p end
  end
  local status = typed(meta.status, "string") or (last and "unknown" or "empty")
  local proc = core.process()
  if status == "running" and type(meta.pid) == "number" and meta.host == proc.host and not core.pid_alive(meta.pid) then
    status = "failed"  -- the process ended without writing an end: killed or crashed
    meta.error = meta.error or "the process ended without finishing the run (killed?)"
  end
  local ev = ok and run.evals[#run.evals] or nil
  return {
    run = dir, recipe = typed(meta.recipe, "string"), status = status, steps = last and last.step or 0,
    total_steps = typed(meta.total_steps, "number"),
    final_loss = last and last.loss, best_loss = best, eval_loss = ev and ev.loss, eval_accuracy = ev and ev.accuracy,
    peak_memory = peak > 0 and peak or nil, memory_kind = last and (last.mem_peak and "device" or "resident") or nil,
    seconds = typed(meta.seconds, "number") or (last and last.time), started = typed(meta.started, "number"),
    error = meta.error ~= nil and tostring(meta.error) or nil,
    bad_records = ok and #run.bad > 0 and #run.bad or nil,
    bad_note = ok and #run.bad > 0 and report.bad_note(run) or nil,
    meta_problems = #meta_problems > 0 and meta_problems or nil,
  }
end

function M.main(dir, json)
  local entries, err = core.list_dir(dir)
  if not entries then error("wick runs: cannot read " .. tostring(err) .. " (give the folder that holds the runs)", 0) end
  local rows = {}
  for _, d in ipairs(find_runs(dir:gsub("/+$", ""), 3, {})) do rows[#rows + 1] = M.summary(d) end
  table.sort(rows, function(a, b)
    if (a.started or 0) ~= (b.started or 0) then return (a.started or 0) < (b.started or 0) end
    return a.run < b.run
  end)
  if json == "json" then
    print(core.json(rows))
    return
  end
  if #rows == 0 then
    print("no runs under " .. dir)
    return
  end
  local head = { "run", "recipe", "steps", "final loss", "best loss", "peak memory", "duration", "status" }
  local lines = { head }
  for _, r in ipairs(rows) do
    local recipe = r.recipe and (r.recipe:match("[^/]+$") or r.recipe) or "-"
    lines[#lines + 1] = {
      r.run, recipe, tostring(r.steps) .. (r.total_steps and ("/" .. r.total_steps) or ""),
      r.final_loss and string.format("%.4f", r.final_loss) or "-", r.best_loss and string.format("%.4f", r.best_loss) or "-",
      fmt_bytes(r.peak_memory), fmt_time(r.seconds), r.status,
    }
  end
  local width = {}
  for _, l in ipairs(lines) do
    for i, v in ipairs(l) do width[i] = math.max(width[i] or 0, #v) end
  end
  for _, l in ipairs(lines) do
    local cells = {}
    for i, v in ipairs(l) do
      -- numbers right-aligned, words left
      local right = i >= 3 and i <= 7
      cells[i] = right and string.rep(" ", width[i] - #v) .. v or v .. string.rep(" ", width[i] - #v)
    end
    print((table.concat(cells, "  "):gsub("%s+$", "")))
  end
  -- the numbers above leave out records that could not be read: say which
  io.stdout:flush()
  for _, r in ipairs(rows) do
    if r.bad_note then io.stderr:write("wick: warning: ", r.run, ": ", r.bad_note, "\n") end
    for _, p in ipairs(r.meta_problems or {}) do io.stderr:write("wick: warning: ", p, "; shown without it\n") end
  end
end

return M
