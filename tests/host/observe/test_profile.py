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
    names = [e.get("name") for e in trace["traceEvents"] if e.get("ph") == "X"]
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
        assert calls[o["name"]] == o["calls"], o["name"]
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
        names = [e.get("name") for e in json.loads((out / f).read_text())["traceEvents"]]
        assert names.count("wick::step") == 2, f
    assert json.loads((out / "run.json").read_text())["profile"]["steps"] == 2
