"""A run folder has one writer: a live run holds out/.lock, and a second run
into the same folder (overwrite, resume, or one started from the first run's
callback) is refused naming the holder, leaving every file of the live run as
it was; the lock goes with the process however it ends. `wick report` refuses
to write over a run's own files."""
import os
import signal
import subprocess
import time

from conftest import WICK

LONG = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 64, inputs = 8, classes = 3, seed = 1 })
local model = wick.model("mlp", { inputs = 8, hidden = { 8 }, outputs = 3 })
local run = wick.train { model = model, data = data, optim = wick.optim("sgd", { lr = 0.01 }), micro_batch = 8,
  epochs = 100000, max_steps = tonumber(a.steps or 1000000), log_every = 1, quiet = true, out = a.out,
  overwrite = a.overwrite == true, resume = a.resume == true, save_every = tonumber(a.save_every or 0) }
print("status " .. run.status .. " steps " .. run.steps)
"""


def start_live(tmp_path, out):
    (tmp_path / "long.lua").write_text(LONG)
    p = subprocess.Popen([WICK, "run", tmp_path / "long.lua", f"out={out}", "save_every=50"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for _ in range(600):
        if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0:
            return p
        time.sleep(0.1)
    p.kill()
    raise AssertionError("the live run never logged a step")


def files_of(out):
    return sorted(str(f.relative_to(out)) for f in out.rglob("*") if ".trash" not in str(f))


def test_a_second_run_into_a_live_runs_folder_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    live = start_live(tmp_path, out)
    try:
        for extra in ("overwrite=true", "resume=true", ""):
            args = [WICK, "run", tmp_path / "long.lua", f"out={out}", "steps=3"] + ([extra] if extra else [])
            p = subprocess.run(args, capture_output=True, text=True, timeout=120)
            assert p.returncode == 1, (extra, p.stderr)
            assert f"is in use by a live run (pid {live.pid} on host " in p.stderr, (extra, p.stderr)
            assert "Traceback" not in p.stderr and "terminate called" not in p.stderr
            # nothing of the live run went: run.json still says running, its metrics grow
            assert '"status":"running"' in (out / "run.json").read_text().replace(" ", "")
        before = (out / "metrics.jsonl").stat().st_size
        time.sleep(0.5)
        assert (out / "metrics.jsonl").stat().st_size > before
        assert live.poll() is None
    finally:
        live.send_signal(signal.SIGTERM)
        stdout, stderr = live.communicate(timeout=120)
    assert live.returncode == 0, stderr
    assert "status interrupted" in stdout
    # every metrics line the live run wrote is whole, and its steps count up by one
    steps = [int(line.split('"step":')[1].split(",")[0].split("}")[0]) for line in
             (out / "metrics.jsonl").read_text().splitlines() if '"eval"' not in line]
    assert steps == list(range(1, len(steps) + 1))
    # the lock went with the process: the folder resumes
    p = subprocess.run([WICK, "run", tmp_path / "long.lua", f"out={out}", "resume=true", f"steps={steps[-1] + 2}"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "status finished" in p.stdout


def test_the_lock_goes_with_a_killed_run(tmp_path):
    out = tmp_path / "run"
    live = start_live(tmp_path, out)
    time.sleep(1)  # (save_every=50: a checkpoint is there by now)
    live.kill()
    live.wait()
    # what the refusal says of it: not "0 of N steps" from the run.json written at its start
    p = subprocess.run([WICK, "run", tmp_path / "long.lua", f"out={out}", "steps=2"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1
    assert "holds a run (status running, but no process holds it: killed or crashed, last checkpoint step-" in p.stderr, \
        p.stderr
    p = subprocess.run([WICK, "run", tmp_path / "long.lua", f"out={out}", "overwrite=true", "steps=2"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "status finished steps 2" in p.stdout


NESTED = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 64, inputs = 8, classes = 3, seed = 1 })
local function run(on_step)
  local model = wick.model("mlp", { inputs = 8, hidden = { 8 }, outputs = 3 })
  return wick.train { model = model, data = data, optim = wick.optim("sgd", { lr = 0.01 }), micro_batch = 8,
    max_steps = 4, quiet = true, out = a.out, overwrite = true, on_step = on_step }
end
run(function(rec) if rec.step == 2 then run() end end)
"""


def test_a_run_started_from_a_callback_into_the_same_folder_is_refused(tmp_path):
    out = tmp_path / "run"
    (tmp_path / "nested.lua").write_text(NESTED)
    p = subprocess.run([WICK, "run", tmp_path / "nested.lua", f"out={out}"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "is in use by a live run" in p.stderr and "(this process:" in p.stderr, p.stderr
    # the outer run's records were not replaced by the inner one's
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [line.count('"step":1,') for line in lines[:1]] == [1], lines


def test_wick_report_refuses_to_write_over_a_runs_own_files(tmp_path):
    out = tmp_path / "run"
    (tmp_path / "long.lua").write_text(LONG)
    p = subprocess.run([WICK, "run", tmp_path / "long.lua", f"out={out}", "steps=3", "save_every=2"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    before = {f: (out / f).read_bytes() for f in ("metrics.jsonl", "run.json")}
    for target in ("metrics.jsonl", "run.json", "recipe.lua", "checkpoints/step-00000002/state.json",
                   "checkpoints"):
        r = subprocess.run([WICK, "report", out, "-o", out / target], capture_output=True, text=True, timeout=120)
        assert r.returncode != 0, (target, r.stdout)
        assert "which would be lost" in r.stderr and "wick report -o" in r.stderr, (target, r.stderr)
    assert {f: (out / f).read_bytes() for f in before} == before
    # its own report, and one beside the run, are written as before
    for target in (out / "report.html", tmp_path / "r.html", out / "other.html"):
        r = subprocess.run([WICK, "report", out, "-o", target], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert target.read_text().startswith("<!")
