-- The PROFILE lines of a run under wick.train's profile, as bench/gpu.sh
-- reads them beside the Python peer's (bench/profile_lines.py):
--   PROFILE seed=NAME side=wick DEPTH steps=N ms_per_step=.. data=.. forward=.. backward=.. optimizer=.. device_busy=.. trace=..
--   PROFILE_OP seed=NAME side=wick rank=I ms=.. calls=.. name="..."   (kernels and copies by device time on a
--                                                                      GPU; host operators by self time on a CPU)
--   PROFILE_RT seed=NAME side=wick rank=I ms=.. calls=.. name="..."   (CUDA runtime calls: launches, copies, waits)
-- (ms and calls per step, as the summary gives them)
--   dofile("bench/profile_lines.lua")(name, "depth=layers=2", run.profile)
return function(name, depth, p)
  if not p then error("seed " .. name .. ": the run returned no profile", 0) end
  local ph = p.phases_ms
  print(string.format("PROFILE seed=%s side=wick %s steps=%d ms_per_step=%.3f data=%.3f forward=%.3f backward=%.3f " ..
    "optimizer=%.3f device_busy=%.3f trace=%s", name, depth, p.steps, p.seconds_per_step * 1e3, ph.data, ph.forward,
    ph.backward, ph.optimizer, p.device_ms_per_step or 0, p.trace))
  for i, o in ipairs(p.device_ops or p.host_ops) do
    if i > 15 then break end
    print(string.format("PROFILE_OP seed=%s side=wick rank=%d ms=%.3f calls=%.1f name=%q", name, i,
      o.self_ms or o.ms, o.calls, o.name))
  end
  for i, o in ipairs(p.cuda_runtime or {}) do
    print(string.format("PROFILE_RT seed=%s side=wick rank=%d ms=%.3f calls=%.1f name=%q", name, i, o.ms, o.calls,
      o.name))
  end
end
