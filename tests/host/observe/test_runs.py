"""`wick runs`: one row per run folder with numbers taken from metrics.jsonl
and the status from run.json: finished, interrupted (SIGTERM), failed (an
error in the run, or a process that died without ending it), running."""
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import WICK

RECIPE = """
local wick = require "wick"
local data = wick.data("synthetic", { size = %(size)d, inputs = 8, classes = 3, seed = 2 })
local model = wick.model("mlp", { inputs = 8, hidden = { %(hidden)d }, outputs = 3 })
%(before)s
wick.train {
  model = model, data = data, optim = wick.optim("sgd", { lr = 0.1 }),
  micro_batch = %(micro)d, epochs = %(epochs)d, out = "%(out)s", quiet = true, on_oom = "fail",
}
"""


def write(tmp_path, name, size=64, hidden=16, micro=8, epochs=1, before=""):
    out = tmp_path / "runs" / name
    recipe = tmp_path / f"{name}.lua"
    recipe.write_text(RECIPE % dict(size=size, hidden=hidden, micro=micro, epochs=epochs, out=out, before=before))
    return recipe, out


def wait_for_steps(out, n, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = out / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, "the run ended early"
        time.sleep(0.05)
    raise AssertionError("no progress")


def metrics(out):
    """metrics.jsonl's records. A process killed while its buffered lines
    reach the file may leave the last one torn; the readers (wick runs, the
    report, a resume) skip a line that is not JSON, and so does this, for
    the last line only."""
    lines = [l for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    recs = []
    for i, l in enumerate(lines):
        try:
            recs.append(json.loads(l))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return recs


def runs_json(run_wick, d):
    return {os.path.basename(r["run"]): r for r in json.loads(run_wick("runs", d, "--json").stdout)}


def test_runs_table(run_wick, tmp_path):
    # finished
    recipe, fin = write(tmp_path, "finished")
    run_wick("run", recipe)
    # failed inside the run: tensors may hold barely more than they do now
    recipe, err = write(tmp_path, "error", micro=64, hidden=512,
                        before="wick.core.set_memory_limit(wick.core.memory(false).cpu_tensors + 4096)")
    p = run_wick("run", recipe, check=False)
    assert p.returncode == 1 and "out of memory" in p.stderr
    # long runs, stopped from outside
    long = dict(size=4000, hidden=256, micro=1, epochs=50)
    recipe, intr = write(tmp_path, "interrupted", **long)
    proc = subprocess.Popen([WICK, "run", recipe], stderr=subprocess.PIPE, text=True)
    wait_for_steps(intr, 5, proc)
    mid = runs_json(run_wick, tmp_path / "runs")
    assert mid["interrupted"]["status"] == "running" and mid["interrupted"]["steps"] >= 5
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    recipe, killed = write(tmp_path, "killed", **long)
    proc = subprocess.Popen([WICK, "run", recipe], stderr=subprocess.DEVNULL)
    wait_for_steps(killed, 5, proc)
    proc.kill()
    proc.wait()

    rows = runs_json(run_wick, tmp_path / "runs")
    assert set(rows) == {"finished", "error", "interrupted", "killed"}
    assert rows["finished"]["status"] == "finished"
    assert rows["error"]["status"] == "failed" and "out of memory" in rows["error"]["error"]
    assert rows["interrupted"]["status"] == "interrupted"
    assert rows["killed"]["status"] == "failed" and "killed" in rows["killed"]["error"]
    for name, out in [("finished", fin), ("interrupted", intr), ("killed", killed)]:
        recs = [r for r in metrics(out) if not r.get("eval")]
        row = rows[name]
        assert row["steps"] == recs[-1]["step"] > 0
        assert row["final_loss"] == recs[-1]["loss"]
        assert row["best_loss"] == min(r["loss"] for r in recs)
        assert row["peak_memory"] == max(r["mem_peak_resident"] for r in recs)
        assert row["recipe"].endswith(name + ".lua")
    assert rows["finished"]["total_steps"] == 8 and rows["finished"]["steps"] == 8
    assert rows["error"]["steps"] == 0

    table = run_wick("runs", tmp_path / "runs").stdout.splitlines()
    assert table[0].split() == ["run", "recipe", "steps", "final", "loss", "best", "loss", "peak", "memory", "duration",
                                "status"]
    by_name = {l.split()[0].rsplit("/", 1)[-1]: l for l in table[1:]}
    assert by_name["finished"].split()[-1] == "finished" and " 8/8 " in by_name["finished"]
    assert by_name["interrupted"].split()[-1] == "interrupted"
    assert by_name["killed"].split()[-1] == "failed"
    assert by_name["error"].split()[-1] == "failed"


def test_runs_errors(run_wick, tmp_path):
    p = run_wick("runs", tmp_path / "nothing", check=False)
    assert p.returncode == 1 and "cannot read" in p.stderr and "nothing" in p.stderr
    (tmp_path / "empty").mkdir()
    assert run_wick("runs", tmp_path / "empty").stdout.strip() == f"no runs under {tmp_path / 'empty'}"
    p = run_wick("runs", "a", "b", check=False)
    assert p.returncode == 2 and "unexpected argument 'b'" in p.stderr
