-- `wick report RUN_DIR [-o FILE]`: one self-contained HTML file (no network,
-- no downloads: the data, the styles and the plotting script are inline) from
-- the run folder's metrics.jsonl (the source of truth), run.json and
-- recipe.lua. Plots: loss (and evaluation loss), learning rate, gradient norm,
-- loss scale with skipped steps, throughput, memory over steps; the memory
-- breakdown; the options and the recipe.
local core = require "wick.core"
local runlog = require "wick.runlog"
local fmt_bytes, fmt_time = runlog.fmt_bytes, runlog.fmt_time

local M = {}
local NULL = 0 / 0  -- core.json writes NaN as null: a step without the field

local function fail(msg) error("wick report: " .. msg, 0) end

local function esc(s)
  return (tostring(s):gsub("[&<>\"]", { ["&"] = "&amp;", ["<"] = "&lt;", [">"] = "&gt;", ['"'] = "&quot;" }))
end

-- What is wrong with a decoded metrics.jsonl record, or nil when it is one
-- wick.train writes: an object whose step is a whole number >= 0, eval and
-- skipped booleans, every other field a number or a boolean (null: absent).
function M.record_problem(rec)
  if type(rec) ~= "table" or rec[1] ~= nil then return "not a JSON object" end
  if type(rec.step) ~= "number" then
    return "'step' is " .. (rec.step == nil and "missing" or ("a " .. type(rec.step))) .. ", expected a whole number"
  end
  if rec.step < 0 or rec.step ~= math.floor(rec.step) or rec.step == math.huge then
    return "'step' is " .. tostring(rec.step) .. ", expected a whole number >= 0"
  end
  local keys = {}
  for k in pairs(rec) do keys[#keys + 1] = tostring(k) end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local t = type(rec[k])
    if k == "eval" or k == "skipped" then
      if t ~= "boolean" then return "'" .. k .. "' is a " .. t .. ", expected true or false" end
    elseif t ~= "number" and t ~= "boolean" then
      return "'" .. k .. "' is a " .. t .. ", expected a number"
    end
  end
  if rec.eval and type(rec.loss) ~= "number" then return "an evaluation record without a number 'loss'" end
  return nil
end

-- run.json's fields as wick.train writes them (a string, a number, an object)
local META_TYPES = {
  accumulate = "number", best_loss = "number", checkpoint = "string", device = "string", ended = "number",
  error = "string", final_loss = "number", host = "string", item_name = "string", memory = "table",
  micro_batch = "number", options = "table", peak_memory = "number", precision = "string", recipe = "string",
  seconds = "number", start_step = "number", started = "number", status = "string", steps = "number",
  total_steps = "number", world_size = "number",
}

--- A run folder's run.json: (meta, problems). A field of another type than
-- wick.train writes is left out of meta and named in problems
-- ("<dir>/run.json: 'status' is a number, expected a string"); a file that
-- is not a JSON object gives an empty meta and one problem. No run.json:
-- ({}, {}).
function M.read_meta(dir)
  local file = dir:gsub("/+$", "") .. "/run.json"
  local text = runlog.read_file(file)
  if not text then return {}, {} end
  local ok, meta = pcall(core.json_decode, text, file)
  if not ok then return {}, { tostring(meta) } end
  if type(meta) ~= "table" or meta[1] ~= nil then return {}, { file .. " is not a JSON object" } end
  local problems, keys = {}, {}
  for k in pairs(META_TYPES) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v, want = meta[k], META_TYPES[k]
    local bad = v ~= nil and type(v) ~= want
    if want == "table" and type(v) == "table" and v[1] ~= nil then bad = true end
    if bad then
      problems[#problems + 1] = string.format("%s: '%s' is %s, expected %s", file, k,
        type(v) == "table" and "a list" or ("a " .. type(v)), want == "table" and "an object" or ("a " .. want))
      meta[k] = nil
    end
  end
  return meta, problems
end

--- Reads a run folder: { meta = run.json or {}, steps = {records}, evals = {records}, recipe = text,
-- bad = {{line = N, why = text}, ...} }.
-- A record that is not JSON or not of the types wick.train writes is skipped
-- and listed in `bad` (its line and what is wrong); the last line of a
-- running run may be half written and is left out without a word.
function M.read_run(dir)
  local text = runlog.read_file(dir .. "/metrics.jsonl")
  if not text then
    local f = io.open(dir, "r")
    if not f then fail(dir .. ": no such folder") end
    f:close()
    fail(dir .. " has no metrics.jsonl: not a run folder (wick.train writes one when given out = ...)")
  end
  local meta, meta_problems = M.read_meta(dir)
  local run = { meta = meta, meta_problems = meta_problems, steps = {}, evals = {}, dir = dir, bad = {} }
  local n = 0
  for line, nl in text:gmatch("([^\n]*)(\n?)") do
    if line == "" and nl == "" then break end
    n = n + 1
    if line:find("%S") then
      local ok, rec = pcall(core.json_decode, line)
      local why = not ok and "not JSON" or M.record_problem(rec)
      if why then
        if nl == "" then
          -- the last line, without its newline: being written, or cut off by a kill
          if meta.status ~= "running" then run.bad[#run.bad + 1] = { line = n, why = "cut short (the run stopped while writing it)" } end
        else
          run.bad[#run.bad + 1] = { line = n, why = why }
        end
      elseif rec.eval then
        run.evals[#run.evals + 1] = rec
      else
        run.steps[#run.steps + 1] = rec
      end
    end
  end
  -- a resumed run repeats the steps after its checkpoint: the later record wins
  local by_step, order = {}, {}
  for _, r in ipairs(run.steps) do
    if not by_step[r.step] then order[#order + 1] = r.step end
    by_step[r.step] = r
  end
  table.sort(order)
  run.steps = {}
  for _, s in ipairs(order) do run.steps[#run.steps + 1] = by_step[s] end
  run.recipe = runlog.read_file(dir .. "/recipe.lua")
  return run
end

-- Columns for the plots; at most `limit` steps (evenly spaced, keeping every
-- skipped step and every out-of-memory split).
local function columns(run, limit)
  local steps = run.steps
  local stride = math.max(1, math.ceil(#steps / limit))
  local cols = {}
  local fields = { "step", "loss", "lr", "grad_norm", "loss_scale", "items_per_s", "time", "mem_allocated",
    "mem_reserved", "mem_peak", "mem_resident", "mem_peak_resident", "mem_tensors", "mem_tensors_peak" }
  for _, f in ipairs(fields) do cols[f] = {} end
  cols.skipped, cols.split = {}, {}
  local kept = 0
  for i, r in ipairs(steps) do
    if (i - 1) % stride == 0 or i == #steps or r.skipped or r.split then
      kept = kept + 1
      for _, f in ipairs(fields) do
        local v = r[f]
        cols[f][kept] = type(v) == "number" and v or NULL
      end
    end
    if r.skipped then cols.skipped[#cols.skipped + 1] = r.step end
    if r.split then cols.split[#cols.split + 1] = { r.step, r.split } end
  end
  for _, f in ipairs(fields) do
    local any = false
    for i = 1, kept do if cols[f][i] == cols[f][i] then any = true break end end
    if not any then cols[f] = nil end
  end
  local ev = { step = {}, loss = {}, accuracy = {} }
  for i, r in ipairs(run.evals) do
    ev.step[i], ev.loss[i] = r.step, r.loss
    ev.accuracy[i] = type(r.accuracy) == "number" and r.accuracy or NULL
  end
  cols.eval = ev
  return cols, stride
end

local STYLE = [[
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
header{background:#1d2330;color:#fff;padding:18px 28px}
header h1{margin:0 0 4px;font-size:20px;font-weight:600}
header .sub{color:#b8c0d0}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;margin-left:8px;vertical-align:2px}
.finished{background:#2e9d5b}.stopped{background:#2e7d9d}.interrupted{background:#c98a16}.failed{background:#c9372c}.running{background:#3b6fd8}
main{padding:20px 28px;max-width:1400px}
.facts{display:grid;grid-template-columns:repeat(auto-fill,minmax(170px,1fr));gap:10px;margin-bottom:18px}
.fact{background:#fff;border-radius:8px;padding:10px 12px;box-shadow:0 1px 2px #0001}
.fact b{display:block;font-size:17px}.fact span{color:#667085;font-size:12px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(600px,1fr));gap:16px}
figure{background:#fff;border-radius:8px;margin:0;padding:12px 14px 8px;box-shadow:0 1px 2px #0001;position:relative}
figcaption{font-weight:600;margin-bottom:4px}
figure .note{color:#667085;font-size:12px}
svg{display:block;width:100%;height:auto;overflow:visible}
svg text{font-size:11px;fill:#667085}
.axis{stroke:#c8ced8}.gridline{stroke:#eef0f3}
.tip{position:absolute;pointer-events:none;background:#1d2330;color:#fff;font-size:12px;padding:4px 7px;border-radius:4px;display:none;white-space:nowrap}
.legend span{display:inline-block;margin-right:12px;font-size:12px}.legend i{display:inline-block;width:12px;height:3px;margin-right:4px;vertical-align:3px}
.bar{display:flex;height:28px;border-radius:4px;overflow:hidden;margin:8px 0}
.bar div{height:100%}
table{border-collapse:collapse;background:#fff;font-size:13px}
td,th{padding:3px 10px;border-bottom:1px solid #eef0f3;text-align:left}
pre{background:#fff;padding:12px;border-radius:8px;overflow:auto;font-size:12px;box-shadow:0 1px 2px #0001}
h2{font-size:16px;margin:26px 0 10px}
.error{background:#fde8e6;color:#8a1c13;padding:10px 12px;border-radius:8px;white-space:pre-wrap}
]]

-- The plotting script: SVG line charts from the embedded columns. Each drawn
-- series is a <path class="series" data-name=... data-points=N>; the page
-- sets <body data-rendered="ok"> when every plot is drawn (or "error: ...").
local SCRIPT = [==[
(function(){
const D = JSON.parse(document.getElementById('wick-data').textContent);
const NS = 'http://www.w3.org/2000/svg';
const W = 600, H = 220, L = 62, R = 12, T = 10, B = 28;
function el(tag, attrs, parent){ const e = document.createElementNS(NS, tag); for (const k in attrs) e.setAttribute(k, attrs[k]); if (parent) parent.appendChild(e); return e; }
function fmt(v){ if (v === null || v === undefined || !isFinite(v)) return '-'; const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2); return (+v.toPrecision(4)).toString(); }
function bytes(v){ if (v === null || !isFinite(v)) return '-'; const u = ['B','KiB','MiB','GiB','TiB']; let i = 0; while (Math.abs(v) >= 1024 && i < 4) { v /= 1024; i++; } return (+v.toFixed(i ? 1 : 0)) + ' ' + u[i]; }
function ticks(lo, hi, n){ if (hi <= lo) { const d = Math.abs(lo) || 1; lo -= d / 2; hi += d / 2; }
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / mag;
  const step = (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag; const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12)); return out; }
// at most ~4 points per pixel column: first, min, max, last of each column
function decimate(xs, ys, sx){ const pts = []; let col = null, b = null;
  const flush = () => { if (!b) return; const s = [b.first]; if (b.min[0] !== b.first[0]) s.push(b.min); if (b.max[0] !== b.first[0] && b.max[0] !== b.min[0]) s.push(b.max);
    if (b.last[0] !== b.first[0] && b.last !== b.min && b.last !== b.max) s.push(b.last); s.sort((p, q) => p[0] - q[0]); pts.push(...s); };
  for (let i = 0; i < xs.length; i++) { const y = ys[i]; if (y === null || !isFinite(y)) continue; const c = Math.round(sx(xs[i])); const p = [xs[i], y];
    if (c !== col) { flush(); col = c; b = {first: p, min: p, max: p, last: p}; } else { if (y < b.min[1]) b.min = p; if (y > b.max[1]) b.max = p; b.last = p; } }
  flush(); return pts; }
function plot(id, title, series, opt){
  opt = opt || {}; const fig = document.createElement('figure'); fig.dataset.plot = id;
  const cap = document.createElement('figcaption'); cap.textContent = title; fig.appendChild(cap);
  document.getElementById('plots').appendChild(fig);
  series = series.filter(s => s.ys && s.ys.some(v => v !== null && isFinite(v) && (!opt.log || v > 0)));
  if (!series.length) { const n = document.createElement('div'); n.className = 'note'; n.textContent = opt.empty || 'nothing recorded'; fig.appendChild(n); fig.dataset.empty = '1'; return; }
  let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
  for (const s of series) s.xs.forEach((x, i) => { const y = s.ys[i]; if (y === null || !isFinite(y) || (opt.log && y <= 0)) return;
    const v = opt.log ? Math.log10(y) : y; x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, v); y1 = Math.max(y1, v); });
  if (opt.zero && !opt.log) y0 = Math.min(y0, 0);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  // byte axes tick at round KiB / MiB / GiB
  const unit = opt.fmt === bytes ? Math.pow(1024, Math.max(0, Math.floor(Math.log(Math.max(Math.abs(y0), Math.abs(y1), 1)) / Math.log(1024)))) : 1;
  const yt = opt.log ? (() => { const a = Math.floor(y0), b = Math.max(Math.ceil(y1), a + 1), k = Math.ceil((b - a) / 6); const o = []; for (let e = a; e <= b + k - 1; e += k) o.push(e); return o; })()
    : ticks(y0 / unit, y1 / unit, 5).map(v => v * unit);
  y0 = Math.min(y0, yt[0]); y1 = Math.max(y1, yt[yt.length - 1]);
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = v => T + (1 - (v - y0) / ((y1 - y0) || 1)) * (H - T - B);
  const svg = el('svg', {viewBox: `0 0 ${W} ${H}`, role: 'img'}, fig);
  for (const v of yt) { el('line', {x1: L, x2: W - R, y1: sy(v), y2: sy(v), class: 'gridline'}, svg);
    const t = el('text', {x: L - 6, y: sy(v) + 4, 'text-anchor': 'end'}, svg); t.textContent = opt.log ? (Math.abs(v) >= 4 ? '1e' + v : fmt(Math.pow(10, v))) : (opt.fmt || fmt)(v); }
  for (const v of ticks(x0, x1, 6)) { if (v < x0 || v > x1) continue; const t = el('text', {x: sx(v), y: H - 8, 'text-anchor': 'middle'}, svg); t.textContent = fmt(v); }
  el('line', {x1: L, x2: W - R, y1: H - B, y2: H - B, class: 'axis'}, svg); el('line', {x1: L, x2: L, y1: T, y2: H - B, class: 'axis'}, svg);
  const legend = document.createElement('div'); legend.className = 'legend';
  for (const s of series) {
    const ys = opt.log ? s.ys.map(v => v > 0 ? Math.log10(v) : null) : s.ys;
    if (s.kind === 'ticks') { for (const x of s.xs) el('line', {x1: sx(x), x2: sx(x), y1: T, y2: H - B, stroke: s.color, 'stroke-width': 1.5, 'stroke-dasharray': '3 3', class: 'marker', 'data-name': s.name, 'data-step': x}, svg); }
    else if (s.kind === 'points') { const g = el('g', {class: 'series', 'data-name': s.name, 'data-points': s.xs.length}, svg);
      s.xs.forEach((x, i) => { if (ys[i] !== null) el('circle', {cx: sx(x).toFixed(2), cy: sy(ys[i]).toFixed(2), r: 3.5, fill: s.color}, g); }); }
    else { const pts = decimate(s.xs, ys, sx); const d = pts.map((p, i) => (i ? 'L' : 'M') + sx(p[0]).toFixed(2) + ',' + sy(p[1]).toFixed(2)).join('');
      el('path', {d: d, fill: 'none', stroke: s.color, 'stroke-width': 1.6, 'stroke-linejoin': 'round', class: 'series', 'data-name': s.name, 'data-points': pts.length}, svg); }
    legend.insertAdjacentHTML('beforeend', `<span><i style="background:${s.color}"></i>${s.name}</span>`);
  }
  fig.appendChild(legend);
  if (opt.note) { const n = document.createElement('div'); n.className = 'note'; n.textContent = opt.note; fig.appendChild(n); }
  // hover: the values of every series at the nearest recorded step
  const tip = document.createElement('div'); tip.className = 'tip'; fig.appendChild(tip);
  const rule = el('line', {y1: T, y2: H - B, stroke: '#99a', 'stroke-width': 1, visibility: 'hidden'}, svg);
  svg.addEventListener('mousemove', ev => { const r = svg.getBoundingClientRect(); const x = x0 + ((ev.clientX - r.left) * W / r.width - L) / (W - L - R) * (x1 - x0);
    const lines = []; let at = null;
    for (const s of series) { if (s.kind === 'ticks') continue; let best = -1, bd = Infinity; s.xs.forEach((sx_, i) => { const dd = Math.abs(sx_ - x); if (dd < bd && s.ys[i] !== null) { bd = dd; best = i; } });
      if (best >= 0) { at = at === null ? s.xs[best] : at; lines.push(`${s.name}: ${(opt.fmt || fmt)(s.ys[best])}`); } }
    if (at === null) return; rule.setAttribute('x1', sx(at)); rule.setAttribute('x2', sx(at)); rule.setAttribute('visibility', 'visible');
    tip.innerHTML = `step ${at}<br>` + lines.join('<br>'); tip.style.display = 'block'; tip.style.left = Math.min(ev.clientX - fig.getBoundingClientRect().left + 12, fig.clientWidth - 160) + 'px'; tip.style.top = '34px'; });
  svg.addEventListener('mouseleave', () => { tip.style.display = 'none'; rule.setAttribute('visibility', 'hidden'); });
}
try {
  const S = D.steps, E = D.steps.eval, x = S.step;
  // an empty Lua table arrives as {}
  for (const k of ['skipped', 'split']) if (!Array.isArray(S[k])) S[k] = [];
  for (const k of ['step', 'loss', 'accuracy']) if (!Array.isArray(E[k])) E[k] = [];
  plot('loss', 'Loss', [{name: 'train loss', xs: x, ys: S.loss, color: '#3b6fd8'}, {name: 'eval loss', xs: E.step, ys: E.loss, color: '#e2662b', kind: 'points'}]);
  plot('lr', 'Learning rate', [{name: 'lr', xs: x, ys: S.lr, color: '#2e9d5b'}], {zero: true});
  plot('grad_norm', 'Gradient norm (global, unscaled)', [{name: 'grad norm', xs: x, ys: S.grad_norm, color: '#8a4fd0'}]);
  plot('loss_scale', 'Loss scale and skipped steps', [{name: 'loss scale', xs: x, ys: S.loss_scale, color: '#c98a16'},
      {name: 'skipped step', xs: S.skipped, ys: S.skipped.map(() => 1), color: '#c9372c', kind: 'ticks'}],
    {log: true, empty: `no loss scaling (precision ${D.precision || 'fp32'}); ${S.skipped.length} steps skipped`, note: `${S.skipped.length} steps skipped for inf/nan gradients`});
  plot('throughput', `Throughput (${D.item_name || 'items'}/s)`, [{name: `${D.item_name || 'items'}/s`, xs: x, ys: S.items_per_s, color: '#0f8b8d'}], {zero: true});
  const splits = S.split.map(p => p[0]);
  const oom = [{name: 'out-of-memory split', xs: splits, ys: splits.map(() => 1), color: '#c98a16', kind: 'ticks'}];
  const mem = (id, title, m) => plot(id, title, m.map(m => ({name: m[0], xs: x, ys: m[1], color: m[2]})).concat(oom), {zero: true, fmt: bytes});
  if (S.mem_allocated) mem('memory', 'Device memory (CUDA)', [['allocated', S.mem_allocated, '#3b6fd8'], ['reserved', S.mem_reserved, '#9db6ec'], ['peak', S.mem_peak, '#c9372c']]);
  else {
    mem('memory', 'Process memory (CPU, resident)', [['resident', S.mem_resident, '#3b6fd8'], ['peak resident', S.mem_peak_resident, '#c9372c']]);
    mem('memory_tensors', 'Memory held by tensors (CPU)', [['after the step', S.mem_tensors, '#2e9d5b'], ['peak during the step', S.mem_tensors_peak, '#c9372c']]);
  }
  if (E.step.length && E.accuracy.some(v => v !== null)) plot('eval_accuracy', 'Evaluation accuracy', [{name: 'accuracy', xs: E.step, ys: E.accuracy, color: '#e2662b'}]);
  document.body.dataset.rendered = 'ok';
} catch (e) { document.body.dataset.rendered = 'error: ' + e; const p = document.createElement('p'); p.className = 'error'; p.textContent = 'The plots could not be drawn: ' + e; document.getElementById('plots').appendChild(p); }
})();
]==]

local function fact(label, value)
  return string.format('<div class="fact"><b>%s</b><span>%s</span></div>', esc(value), esc(label))
end

--- The report as a string.
function M.html(run, limit)
  local meta, steps = run.meta, run.steps
  local cols, stride = columns(run, limit or 20000)
  local first, last = steps[1], steps[#steps]
  local best
  for _, r in ipairs(steps) do
    if not r.skipped and type(r.loss) == "number" and (not best or r.loss < best) then best = r.loss end
  end
  local name = run.dir:gsub("/+$", ""):match("[^/]+$") or run.dir
  local status = meta.status or "unknown"
  local o = {}
  local function w(...) for i = 1, select("#", ...) do o[#o + 1] = select(i, ...) end end
  w('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
    '<meta name="viewport" content="width=device-width,initial-scale=1">',
    '<title>wick run ', esc(name), '</title><style>', STYLE, '</style></head><body>')
  w('<header><h1>', esc(name), '<span class="badge ', esc(status), '">', esc(status), '</span></h1><div class="sub">',
    esc(meta.recipe or "recipe unknown"),
    type(meta.started) == "number" and (" &middot; started " .. os.date("%Y-%m-%d %H:%M:%S", meta.started)) or "",
    meta.host and (" &middot; " .. esc(meta.host)) or "", '</div></header><main>')
  if meta.error then w('<p class="error">', esc(meta.error), '</p>') end
  if #run.bad > 0 then
    w('<p class="error">', esc(M.bad_note(run)), ': the report shows the others.</p>')
  end
  local total = meta.total_steps
  w('<div class="facts">')
  w(fact("steps", (last and last.step or 0) .. (total and (" / " .. total) or "")))
  w(fact("final loss", last and type(last.loss) == "number" and string.format("%.4f", last.loss) or "-"))
  w(fact("best loss", best and string.format("%.4f", best) or "-"))
  local ev = run.evals[#run.evals]
  if ev then
    w(fact("eval loss @ " .. ev.step, string.format("%.4f", ev.loss)))
    if ev.accuracy then w(fact("eval accuracy", string.format("%.4f", ev.accuracy))) end
  end
  w(fact("duration", fmt_time(meta.seconds or (last and last.time))))
  local peak = 0
  for _, r in ipairs(steps) do
    local p = r.mem_peak or r.mem_peak_resident
    if p and p > peak then peak = p end
  end
  w(fact(steps[1] and steps[1].mem_peak and "peak device memory" or "peak resident memory", fmt_bytes(peak)))
  local opts = meta.options or {}
  if opts.micro_batch then
    w(fact("batch", string.format("%s x %s x %s ranks", tostring(meta.micro_batch or opts.micro_batch),
      tostring(meta.accumulate or opts.accumulate), tostring(meta.world_size or 1))))
  end
  w(fact("precision", meta.precision or opts.precision or "-"), fact("device", meta.device or "-"))
  w(fact("skipped steps", tostring(#cols.skipped)))
  w('</div>')
  if stride > 1 then
    w('<p class="note">', #steps, ' steps: every ', stride, 'th is plotted (and every skipped or split step).</p>')
  end
  w('<div class="grid" id="plots"></div>')

  -- memory breakdown (run.json, written at the end of a run)
  local mm = meta.memory
  if type(mm) == "table" and mm.peak then
    w('<h2>Memory at the peak (', esc(mm.device or ""), '): ', fmt_bytes(mm.peak), ' held by tensors</h2>')
    local parts = { { "weights", "#3b6fd8" }, { "gradients", "#8a4fd0" }, { "optimizer", "#2e9d5b" },
      { "data", "#0f8b8d" }, { "activations", "#e2662b" }, { "other", "#98a2b3" } }
    local sum = 0
    for _, p in ipairs(parts) do sum = sum + (tonumber(mm[p[1]]) or 0) end
    w('<div class="bar" id="breakdown">')
    for _, p in ipairs(parts) do
      local v = tonumber(mm[p[1]]) or 0
      if v > 0 and sum > 0 then
        w(string.format('<div data-part="%s" data-bytes="%d" style="width:%.3f%%;background:%s" title="%s %s"></div>',
          p[1], v, 100 * v / sum, p[2], p[1], fmt_bytes(v)))
      end
    end
    w('</div><div class="legend">')
    for _, p in ipairs(parts) do
      w(string.format('<span><i style="background:%s"></i>%s %s</span>', p[2], p[1], fmt_bytes(tonumber(mm[p[1]]) or 0)))
    end
    w('</div>')
  end

  if #run.evals > 0 then
    w('<h2>Evaluations</h2><table><tr><th>step</th><th>loss</th><th>accuracy</th></tr>')
    for _, r in ipairs(run.evals) do
      w(string.format('<tr><td>%d</td><td>%.4f</td><td>%s</td></tr>', r.step, r.loss,
        type(r.accuracy) == "number" and string.format("%.4f", r.accuracy) or "-"))
    end
    w('</table>')
  end
  if next(opts) then
    w('<h2>Options</h2><table>')
    local keys = {}
    for k in pairs(opts) do keys[#keys + 1] = k end
    table.sort(keys)
    for _, k in ipairs(keys) do w('<tr><td>', esc(k), '</td><td>', esc(tostring(opts[k])), '</td></tr>') end
    w('</table>')
  end
  if run.recipe then w('<h2>Recipe</h2><pre>', esc(run.recipe), '</pre>') end
  w('</main>')
  local data = core.json { steps = cols, precision = meta.precision, item_name = meta.item_name }
  -- "</" cannot appear inside a script element
  w('<script type="application/json" id="wick-data">', (data:gsub("</", "<\\/")), '</script>')
  w('<script>', SCRIPT, '</script></body></html>\n')
  return table.concat(o)
end

--- "2 unreadable records in metrics.jsonl skipped (line 3: not JSON; line 7: 'loss' is a string, expected a number)"
function M.bad_note(run)
  local n = #run.bad
  local parts = {}
  for i = 1, math.min(n, 3) do parts[i] = "line " .. run.bad[i].line .. ": " .. run.bad[i].why end
  if n > 3 then parts[#parts + 1] = (n - 3) .. " more" end
  return string.format("%d unreadable record%s in metrics.jsonl skipped (%s)", n, n == 1 and "" or "s",
    table.concat(parts, "; "))
end

--- wick report RUN_DIR [-o FILE]
function M.main(dir, out)
  if not dir or dir == "" then fail("needs a run folder (the `out` of a wick.train call)") end
  local run = M.read_run(dir)
  for _, p in ipairs(run.meta_problems) do io.stderr:write("wick: warning: ", p, "; the report leaves it out\n") end
  local file = dir:gsub("/+$", "") .. "/metrics.jsonl"
  for i, b in ipairs(run.bad) do
    if i > 10 then
      io.stderr:write(string.format("wick: warning: %s: %d more unreadable records skipped\n", file, #run.bad - 10))
      break
    end
    io.stderr:write(string.format("wick: warning: %s:%d: record skipped: %s\n", file, b.line, b.why))
  end
  if #run.steps == 0 then fail(dir .. "/metrics.jsonl holds no step yet") end
  out = (out and out ~= "") and out or (dir:gsub("/+$", "") .. "/report.html")
  core.write_file(out, M.html(run))
  print(out)
end

return M
