"""wick.train's `profile`: the chosen steps under PyTorch's profiler, a trace
that Perfetto reads, and where their time went in run.json. The summary's
self times are checked against the trace itself (an independent walk of its
events in Python), and a profiled run trains as an unprofiled one does."""
import json
from collections import defaultdict

import pytest

RECIPE = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 256, inputs = 16, classes = 3, seed = 2 })
local model = wick.model("mlp", { inputs = 16, hidden = { 64, 64 }, outputs = 3 })
wick.train {
  model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }), seed = 3,
  micro_batch = 16, accumulate = 2, epochs = 1, out = a.out, quiet = true, log_every = 1,
  profile = %(profile)s,
}
"""


def train(run_wick, tmp_path, name, profile, *extra):
    recipe = tmp_path / f"{name}.lua"
    recipe.write_text(RECIPE % dict(profile=profile))
    out = tmp_path / name
    p = run_wick("run", recipe, f"out={out}", *extra)
    return out, json.loads((out / "run.json").read_text()), p


def losses(out):
    return [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' not in l]


def scopes(trace):
    """The names of the trace's host scopes and operators (not the GPU's copies of the scopes)."""
    return [e.get("name") for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]


def trace_self_times(trace):
    """Self time (ms) and calls of each host operator, from the trace's complete
    events: nested by time on each thread, an event's self time its own less
    its direct children's."""
    by_tid = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            by_tid[(e["pid"], e["tid"])].append(e)
    self_ms, calls = defaultdict(float), defaultdict(int)
    for events in by_tid.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, children = [], defaultdict(float)
        for e in events:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                children[id(stack[-1])] += e["dur"]
            stack.append(e)
        for e in events:
            self_ms[e["name"]] += (e["dur"] - min(children[id(e)], e["dur"])) / 1000.0
            calls[e["name"]] += 1
    return self_ms, calls


def test_profile_writes_a_trace_and_where_the_time_went(run_wick, tmp_path):
    out, run, p = train(run_wick, tmp_path, "profiled", "true")
    prof = run["profile"]
    # true: steps 2 to 4, after a warm-up step
    assert (prof["first"], prof["last"], prof["steps"]) == (2, 4, 3)
    assert prof["trace"] == str(out / "profile.json")
    trace = json.loads((out / "profile.json").read_text())
    assert not list(out.glob("profile.json.partial*"))
    names = scopes(trace)
    # the engine's scopes: one step, one data wait and one optimizer step per
    # step, a forward and a backward per micro-batch
    assert names.count("wick::step") == 3 and names.count("wick::data") == 3
    assert names.count("wick::optimizer") == 3
    assert names.count("wick::forward") == 6 and names.count("wick::backward") == 6
    phases = prof["phases_ms"]
    assert set(phases) == {"data", "forward", "backward", "optimizer", "step"}
    assert all(v > 0 for v in phases.values())
    # a step holds its forward, backward and optimizer; the whole span holds the steps
    assert phases["forward"] + phases["backward"] + phases["optimizer"] <= phases["step"]
    assert phases["step"] + phases["data"] <= prof["seconds_per_step"] * 1000
    ops = prof["host_ops"]
    assert ops and "device_ops" not in prof  # a CPU run: no device rows
    assert [o["self_ms"] for o in ops] == sorted((o["self_ms"] for o in ops), reverse=True)
    assert all(0 <= o["self_ms"] <= o["ms"] + 1e-9 for o in ops)
    assert {"aten::addmm", "aten::mm"} & {o["name"] for o in ops}
    # the same self times as the trace's own events give (per step; the
    # trace's microseconds are rounded to 3 places)
    self_ms, calls = trace_self_times(trace)
    for o in ops:
        assert calls[o["name"]] == pytest.approx(o["calls"] * 3), o["name"]  # calls per step in the summary
        assert o["self_ms"] == pytest.approx(self_ms[o["name"]] / 3, rel=1e-3, abs=2e-3), o["name"]
    # what the terminal would show is in the run's table; a quiet run prints nothing
    assert "profile" not in p.stderr


def test_profiling_changes_nothing_the_run_computes(run_wick, tmp_path):
    plain, _, _ = train(run_wick, tmp_path, "plain", "false")
    prof, run, _ = train(run_wick, tmp_path, "prof", "{ 1, 16 }")
    assert losses(prof) == losses(plain)
    assert (run["profile"]["first"], run["profile"]["last"], run["profile"]["steps"]) == (1, 8, 8)  # the run's 8 steps
    assert not (plain / "profile.json").exists()


def test_profile_steps_given_and_said(run_wick, tmp_path):
    recipe = tmp_path / "said.lua"
    recipe.write_text((RECIPE % dict(profile="{ 3, 3 }")).replace("quiet = true", "quiet = false"))
    out = tmp_path / "said"
    p = run_wick("run", recipe, f"out={out}")
    run = json.loads((out / "run.json").read_text())
    assert (run["profile"]["first"], run["profile"]["last"]) == (3, 3)
    assert f"profile of step 3: {out / 'profile.json'}" in p.stderr
    assert "per step:" in p.stderr and "host operators (per step)" in p.stderr


def test_profile_on_two_ranks_writes_a_trace_each(run_wick, tmp_path):
    recipe = tmp_path / "ranks.lua"
    recipe.write_text(RECIPE % dict(profile="{ 2, 3 }"))
    out = tmp_path / "ranks"
    run_wick("launch", "--nproc-per-node", 2, recipe, f"out={out}")
    for f in ("profile.json", "profile-rank1.json"):
        assert scopes(json.loads((out / f).read_text())).count("wick::step") == 2, f
    assert json.loads((out / "run.json").read_text())["profile"]["steps"] == 2


def test_a_bad_profile_leaves_the_run_overwrite_would_replace(run_wick, tmp_path):
    out, run, _ = train(run_wick, tmp_path, "kept", "false")
    before = (out / "run.json").read_text()
    recipe = tmp_path / "late.lua"
    recipe.write_text(RECIPE % dict(profile="{ 20, 30 }"))
    p = run_wick("run", recipe, f"out={out}", "overwrite=true", check=False)
    assert p.returncode == 1 and "option 'profile': step 20 is past the run's last step (8)" in p.stderr
    assert (out / "run.json").read_text() == before and (out / "metrics.jsonl").exists()


def test_overwrite_removes_an_earlier_runs_traces(run_wick, tmp_path):
    out, _, _ = train(run_wick, tmp_path, "again", "true")
    (out / "profile-rank1.json").write_text("{}")  # as another rank of that run left it
    recipe = tmp_path / "plain.lua"
    recipe.write_text(RECIPE % dict(profile="false"))
    run_wick("run", recipe, f"out={out}", "overwrite=true")
    assert not (out / "profile.json").exists() and not (out / "profile-rank1.json").exists()


def test_a_resumed_run_profiles_from_where_it_starts(run_wick, tmp_path):
    recipe = tmp_path / "resumed.lua"
    recipe.write_text((RECIPE % dict(profile="true")).replace("epochs = 1,", "epochs = 2, save_every = 5,"))
    out = tmp_path / "resumed"
    run_wick("run", recipe, f"out={out}", "max_steps=6")
    first = json.loads((out / "run.json").read_text())["profile"]
    assert (first["first"], first["last"]) == (2, 4)
    run_wick("run", recipe, f"out={out}", "resume=true")
    again = json.loads((out / "run.json").read_text())["profile"]
    assert (again["first"], again["last"]) == (8, 10)  # from the end's checkpoint (step 6): its 2nd to 4th steps
    # steps given that ran before the resume: said, nothing recorded
    recipe.write_text((RECIPE % dict(profile="{ 2, 3 }")).replace("epochs = 1,", "epochs = 3, save_every = 5,"))
    p = run_wick("run", recipe, f"out={out}", "resume=true")
    assert "option 'profile': steps 2 to 3 ran before the resume (from step 16): nothing profiled" in p.stderr
    assert "profile" not in json.loads((out / "run.json").read_text())


def test_one_profiled_run_at_a_time(run_wick, tmp_path):
    # a callback's wick.train inside a profiled run is refused its own profile;
    # the outer run's is whole
    recipe = tmp_path / "nested.lua"
    inner = """
  on_step = function(r)
    if r.step == 3 then
      local ok, err = pcall(wick.train, { model = wick.model("mlp", { inputs = 16, hidden = { 8 }, outputs = 3 }),
        data = data, optim = wick.optim("sgd", { lr = 0.1 }), micro_batch = 16, max_steps = 2, quiet = true,
        out = a.out .. "-inner", profile = true })
      io.stderr:write("INNER " .. tostring(ok) .. " " .. tostring(err) .. "\\n")
    end
  end,"""
    recipe.write_text((RECIPE % dict(profile="{ 2, 4 }")).replace("  profile =", inner + "\n  profile ="))
    out = tmp_path / "nested"
    p = run_wick("run", recipe, f"out={out}")
    assert "INNER false" in p.stderr and "another run in this process is being profiled" in p.stderr
    prof = json.loads((out / "run.json").read_text())["profile"]
    assert (prof["first"], prof["last"], prof["steps"]) == (2, 4, 3)
    assert scopes(json.loads((out / "profile.json").read_text())).count("wick::step") == 3
    assert not (tmp_path / "nested-inner").exists()  # refused before its folder was made


def test_an_unwritable_trace_is_said_and_the_run_goes_on(run_wick, tmp_path):
    recipe = tmp_path / "blocked.lua"
    # a folder where the trace would go, made once the run has its folder
    block = """
  on_step = function(r) if r.step == 1 then os.execute("mkdir '" .. a.out .. "/profile.json'") end end,"""
    recipe.write_text((RECIPE % dict(profile="true")).replace("  profile =", block + "\n  profile ="))
    out = tmp_path / "blocked"
    p = run_wick("run", recipe, f"out={out}")
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "finished" and run["steps"] == 8
    assert run["profile"]["trace"] is None and "cannot write" in run["profile"]["trace_error"]
    assert f"option 'profile': cannot write {out / 'profile.json'}" in p.stderr
    assert sorted(f.name for f in out.iterdir() if f.name.startswith("profile")) == ["profile.json"]


def test_an_evaluation_among_the_steps_is_its_own_phase(run_wick, tmp_path):
    plain, run, _ = train(run_wick, tmp_path, "noeval", "true")
    recipe = tmp_path / "eval.lua"
    recipe.write_text((RECIPE % dict(profile="true")).replace("quiet = true,", "quiet = true, eval_data = data, eval_every = 3,"))
    out = tmp_path / "eval"
    run_wick("run", recipe, f"out={out}")
    prof = json.loads((out / "run.json").read_text())["profile"]
    assert prof["phases_ms"]["eval"] > 0 and "eval" not in run["profile"]["phases_ms"]
    # the steps' operators alone: as many products a step as without the evaluation
    calls = lambda p: {o["name"]: o["calls"] for o in p["host_ops"]}
    for name in ("aten::addmm", "aten::mm"):
        if name in calls(run["profile"]):
            assert calls(prof).get(name) == calls(run["profile"])[name], name


# wick.profile: a custom loop (wick.trainer, wick.loader) under the profiler
LOOP = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 96, inputs = 16, classes = 3, seed = 2 })
wick.seed(1)
local model = wick.model("mlp", { inputs = 16, hidden = { 32 }, outputs = 3 })
local t = wick.trainer { model = model, optim = wick.optim("adamw", { lr = 0.01 }) }
local loader = wick.loader(data, { micro_batch = 16, accumulate = 2, shuffle = false })
loader:start_epoch(0)
local losses = {}
local function loop()
  for i = 1, 3 do losses[i] = t:step(loader:next()).loss end
  return "done", 3
end
local out = { }
if a.profile then
  local summary, said, n = wick.profile(loop, { trace = a.trace, steps = 3 })
  out.summary, out.said, out.n = summary, said, n
else
  loop()
end
out.losses = losses
local f = assert(io.open(a.result, "w"))
f:write(wick.json(out))
f:close()
"""


def loop(run_wick, tmp_path, name, *args, check=True):
    recipe = tmp_path / f"{name}.lua"
    recipe.write_text(LOOP)
    result = tmp_path / f"{name}.json"
    p = run_wick("run", recipe, f"result={result}", *args, check=check)
    return (json.loads(result.read_text()) if result.exists() else None), p


def test_wick_profile_records_a_custom_loop_and_changes_nothing_it_computes(run_wick, tmp_path):
    plain, _ = loop(run_wick, tmp_path, "plain")
    trace = tmp_path / "loop.json"
    prof, _ = loop(run_wick, tmp_path, "prof", "profile=1", f"trace={trace}")
    assert prof["losses"] == plain["losses"]
    assert (prof["said"], prof["n"]) == ("done", 3)  # the function's results follow the summary
    s = prof["summary"]
    assert s["steps"] == 3 and s["trace"] == str(trace) and "trace_error" not in s
    assert set(s["phases_ms"]) == {"data", "forward", "backward", "optimizer", "step"}
    assert all(s["phases_ms"][k] > 0 for k in ("data", "forward", "backward", "optimizer", "step"))
    assert "per step" in s["text"]
    names = scopes(json.loads(trace.read_text()))
    # the loop's own scopes: loader:next() and trainer:step() marked as wick.train marks its loop's
    assert names.count("wick::step") == 3 and names.count("wick::data") == 3
    assert names.count("wick::optimizer") == 3
    assert names.count("wick::forward") == 6 and names.count("wick::backward") == 6
    # the summary's self times are the trace's (per step)
    self_ms, calls = trace_self_times(json.loads(trace.read_text()))
    for op in s["host_ops"][:5]:
        assert op["calls"] == pytest.approx(calls[op["name"]] / 3)
        assert op["self_ms"] == pytest.approx(self_ms[op["name"]] / 3, rel=0.02, abs=2e-3)


def test_wick_profile_without_a_trace_and_with_one_it_cannot_write(run_wick, tmp_path):
    bare, _ = loop(run_wick, tmp_path, "bare", "profile=1")
    assert bare["summary"].get("trace") is None and "trace_error" not in bare["summary"]
    assert bare["summary"]["phases_ms"]["step"] > 0
    (tmp_path / "a-file").write_text("")
    bad, _ = loop(run_wick, tmp_path, "bad", "profile=1", f"trace={tmp_path / 'a-file' / 'loop.json'}")
    assert bad["summary"].get("trace") is None and bad["summary"]["trace_error"]
    assert bad["losses"] == bare["losses"]
    assert not [p for p in tmp_path.rglob("*partial*")]


def test_wick_profile_passes_an_error_on_and_stops_recording(run_wick, tmp_path):
    recipe = tmp_path / "err.lua"
    recipe.write_text("""
local wick = require "wick"
local ok, err = pcall(wick.profile, function() error("the loop broke", 0) end)
print("first: " .. tostring(ok) .. " " .. tostring(err))
local s = wick.profile(function() end)
print("second: " .. s.steps)
local ok2, err2 = pcall(wick.profile, function() wick.profile(function() end) end)
print("nested: " .. tostring(ok2) .. " " .. tostring(err2))
local ok3, err3 = pcall(wick.profile, function()
  wick.train { model = wick.model("mlp", { inputs = 4, hidden = { 4 }, outputs = 2 }),
    data = wick.data("synthetic", { size = 8, inputs = 4, classes = 2 }), optim = wick.optim("sgd", { lr = 0.1 }),
    micro_batch = 4, out = "%s", quiet = true, profile = true }
end)
print("train inside: " .. tostring(ok3) .. " " .. tostring(err3))
local s2 = wick.profile(function() end)
print("after: " .. s2.steps)
""" % (tmp_path / "run"))
    p = run_wick("run", recipe)
    lines = p.stdout.splitlines()
    assert "first: false the loop broke" in lines
    assert "second: 1" in lines
    nested = [l for l in lines if l.startswith("nested: ")][0]
    assert nested.startswith("nested: false") and "profiler is recording already" in nested
    inside = [l for l in lines if l.startswith("train inside: ")][0]
    assert inside.startswith("train inside: false") and "option 'profile'" in inside
    assert "after: 1" in lines
