"""Signals and process lifetime. Inside wick.train the first SIGINT or SIGTERM
finishes the step and saves (recipe_spec.lua); with no step to finish it ends
the recipe: Lua code at once, a callback that does not return after its grace,
code that never looks (a JIT-compiled loop, a plugin's C++) within seconds,
each saying so, run.json saying so. A write over `ulimit -f` is an error that
names the file, not a silent death by SIGXFSZ. The ranks of a `wick launch`
killed outright die with it; a rank that returns before wick.train, or after
one while another rank goes on, ends the run at once, named."""
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import WICK, free_port

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def start(tmp_path, name, code, *args):
    (tmp_path / name).write_text(code)
    return subprocess.Popen([WICK, "run", tmp_path / name, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)


def wait_for(path, what):
    for _ in range(600):
        if path.exists() and path.stat().st_size > 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"never saw {what}")


@pytest.mark.parametrize("loop,expect", [
    # interpreted Lua (a C function each turn): its hook raises at once
    ("local n = 0 while true do n = n + #tostring(n) end", "interrupted by SIGTERM"),
    # a JIT-compiled loop never meets the hook: the process ends by itself, saying why
    ("while true do end", "code that does not stop by itself"),
])
def test_one_signal_ends_a_recipe_with_no_step_to_finish(tmp_path, loop, expect):
    ready = tmp_path / "ready"
    p = start(tmp_path, "busy.lua", f"local f = io.open({str(ready)!r}, 'w') f:write('1') f:close()\n{loop}\n")
    wait_for(ready, "the recipe start")
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _, stderr = p.communicate(timeout=60)
    assert time.monotonic() - t0 < 15, stderr
    assert p.returncode != 0
    assert expect in stderr, stderr
    assert "terminate called" not in stderr


CALLBACK = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 64, inputs = 8, classes = 3, seed = 1 })
local model = wick.model("mlp", { inputs = 8, hidden = { 8 }, outputs = 3 })
wick.train { model = model, data = data, optim = wick.optim("sgd", { lr = 0.01 }), micro_batch = 8,
  max_steps = 100, quiet = true, out = a.out,
  on_step = function(rec)
    if rec.step == 3 then
      local f = io.open(a.ready, "w") f:write("1") f:close()
      local n = 0
      while true do n = n + #tostring(n) end
    end
  end }
"""


@pytest.mark.parametrize("loop,expect", [
    ("local n = 0 while true do n = n + #tostring(n) end", "interrupted by SIGINT"),
    # compiled: the hook never fires, the watcher ends it after the grace
    ("while true do end", "a callback that did not return within its grace"),
])
def test_a_callback_that_never_returns_is_interrupted_after_its_grace_and_run_json_says_so(tmp_path, loop, expect):
    out, ready = tmp_path / "run", tmp_path / "ready"
    p = start(tmp_path, "cb.lua", CALLBACK.replace("local n = 0\n      while true do n = n + #tostring(n) end", loop),
              f"out={out}", f"ready={ready}")
    wait_for(ready, "the callback")
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=90)
    took = time.monotonic() - t0
    assert 5 < took < 40, (took, stderr)  # the grace is 10 s: a callback that returns in time finishes its step
    assert p.returncode != 0
    assert expect in stderr, stderr
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "interrupted" and expect in meta["error"], meta


WRITES = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 64, inputs = 64, classes = 3, seed = 1 })
local model = wick.model("mlp", { inputs = 64, hidden = { 512 }, outputs = 3 })
wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }), micro_batch = 8,
  max_steps = 4, save_every = 2, quiet = true, out = a.out }
"""


def test_a_write_over_ulimit_f_is_an_error_naming_the_file(tmp_path):
    out = tmp_path / "run"
    (tmp_path / "w.lua").write_text(WRITES)
    # 200 KiB a file: run.json and the metrics fit, a checkpoint's 400 KiB of AdamW state does not
    p = subprocess.run(["bash", "-c", f"ulimit -f 200; exec {WICK} run {tmp_path / 'w.lua'} out={out}"],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert p.returncode == 1, (p.returncode, p.stderr)  # not 128 + SIGXFSZ
    assert "File too large" in p.stderr, p.stderr
    assert "wick: error:" in p.stderr
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "failed" and "File too large" in meta["error"], meta
    # no half-written checkpoint looks whole
    for d in (out / "checkpoints").glob("step-*"):
        assert not (d / "state.json").exists(), d


LAUNCHED = """
local wick = require "wick"
local a = wick.args
if a.early ~= nil and wick.rank == tonumber(a.early) then print("rank " .. wick.rank .. " returns early") return end
if a.fails ~= nil and wick.rank == tonumber(a.fails) then error("rank " .. wick.rank .. " fails early") end
local data = wick.data("synthetic", { size = 100000, inputs = 8, classes = 3, seed = 1 })
local model = wick.model("mlp", { inputs = 8, hidden = { 8 }, outputs = 3 })
local f = io.open(a.ready .. wick.rank, "w") f:write(tostring(wick.core.process().pid)) f:close()
wick.train { model = model, data = data, optim = wick.optim("sgd", { lr = 0.01 }), micro_batch = 4,
  epochs = 1000, quiet = true }
"""


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie waits for its (dead) parent's reaper: it no longer runs
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_ranks_die_with_a_launcher_killed_outright(tmp_path):
    (tmp_path / "l.lua").write_text(LAUNCHED)
    ready = tmp_path / "ready"
    p = subprocess.Popen([WICK, "launch", "--nproc-per-node", "2", tmp_path / "l.lua", f"ready={ready}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    for r in (0, 1):
        wait_for(tmp_path / f"ready{r}", f"rank {r}")
    time.sleep(1)
    pids = [int((tmp_path / f"ready{r}").read_text()) for r in (0, 1)]
    assert all(alive(q) for q in pids)
    p.kill()
    p.wait()
    for _ in range(100):
        if not any(alive(q) for q in pids):
            break
        time.sleep(0.1)
    left = [q for q in pids if alive(q)]
    for q in left:
        os.kill(q, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher"


def test_a_rank_that_returns_before_wick_train_ends_the_run_at_once_named(tmp_path):
    (tmp_path / "l.lua").write_text(LAUNCHED)
    t0 = time.monotonic()
    p = subprocess.run([WICK, "launch", "--nproc-per-node", "2", tmp_path / "l.lua", "early=1",
                        f"ready={tmp_path / 'ready'}"], capture_output=True, text=True, timeout=300,
                       env={**ENV, "WICK_DIST_TIMEOUT": "240"})
    took = time.monotonic() - t0
    assert p.returncode == 1, p.stderr
    assert took < 60, (took, p.stderr)  # not the 240 s of WICK_DIST_TIMEOUT
    assert "rank 1 ended (exit code 0) without reaching the rendezvous" in p.stderr, p.stderr
    assert "wick launch: rank 1 ended with code 0 while the others still ran" in p.stderr, p.stderr
    assert "rank 0 then exited with code 1" in p.stderr, p.stderr


# rank 1 returns after a wick.train while rank 0 goes on: into another
# wick.train (its options are compared through the store), or into more steps
# of a custom loop (a collective)
AFTER = {
    "another wick.train": """
local wick = require "wick"
local data = wick.data("synthetic", { size = 64, inputs = 8, classes = 3, seed = 1 })
local model = wick.model("mlp", { inputs = 8, hidden = { 8 }, outputs = 3 })
local function train() wick.train { model = model, data = data, optim = wick.optim("sgd", { lr = 0.01 }),
  micro_batch = 4, epochs = 1, quiet = true } end
train()
if wick.rank == tonumber(wick.args.quits or 1) then return end
train()
""",
    "more steps": """
local wick = require "wick"
local data = wick.data("synthetic", { size = 640, inputs = 8, classes = 3, seed = 1 })
local loader = wick.loader(data, { micro_batch = 4 })
local t = wick.trainer { model = wick.model("mlp", { inputs = 8, hidden = { 8 }, outputs = 3 }),
  optim = wick.optim("sgd", { lr = 0.01 }) }
loader:start_epoch(0, 0)
for _ = 1, (wick.rank == tonumber(wick.args.quits or 1) and 2 or 100) do t:step(loader:next()) end
""",
}


@pytest.mark.parametrize("where", sorted(AFTER))
def test_a_rank_that_returns_after_wick_train_while_another_goes_on_ends_the_run_at_once_named(tmp_path, where):
    (tmp_path / "l.lua").write_text(AFTER[where])
    t0 = time.monotonic()
    p = subprocess.run([WICK, "launch", "--nproc-per-node", "2", tmp_path / "l.lua"], capture_output=True, text=True,
                       timeout=300, env={**ENV, "WICK_DIST_TIMEOUT": "240"})
    took = time.monotonic() - t0
    assert p.returncode == 1, p.stderr
    assert took < 60, (took, p.stderr)  # not the 240 s of WICK_DIST_TIMEOUT
    # rank 0 says which rank it waited for, and the launcher blames that one
    assert "rank 0 of 2: " in p.stderr and ("rank 1 ended (exit code 0) while this rank waited for it" in p.stderr
                                            or "rank 1 had ended (exit code 0)" in p.stderr), p.stderr
    assert "wick launch: rank 1 ended with code 0 while the others still ran" in p.stderr, p.stderr
    assert "rank 0 then exited with code 1" in p.stderr, p.stderr
    assert "wick launch: rank 0 exited" not in p.stderr, p.stderr


# Without the launcher (torchrun-style variables, SLURM's, torchrun itself)
# each rank says its end in the ranks' store, and rank 0, which hosts it,
# keeps it open after a wick.train until every rank has said its end.

def rank_envs(how):
    port = free_port()
    if how == "torchrun-style variables":
        return [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for r in range(2)]
    return [{"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r), "SLURM_NTASKS_PER_NODE": "2",
             "SLURM_NODELIST": "localhost", "MASTER_PORT": port} for r in range(2)]


def run_ranks(recipe, args, how):
    """Both ranks of `how` run `recipe`; their exit codes and stderr, and the
    seconds until the last ended."""
    procs = []
    t0 = time.monotonic()
    for env in rank_envs(how):
        e = {k: v for k, v in ENV.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "SLURM_", "LOCAL_"))}
        e.update(env, WICK_DIST_TIMEOUT="240")
        procs.append(subprocess.Popen([WICK, "run", str(recipe), *args], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], [err for _, err in outs], time.monotonic() - t0


HOWS = ["torchrun-style variables", "SLURM"]


# (rank 1 returning early; rank 0 returning before any wick.train opens no
# store to say so: a process that only looks like rank 0 of several, an
# sbatch script's own step, would wait at exit for ranks that never come)
@pytest.mark.parametrize("early", [1])
@pytest.mark.parametrize("how", HOWS)
def test_without_the_launcher_a_rank_that_returns_before_wick_train_ends_the_run_at_once_named(tmp_path, how, early):
    (tmp_path / "l.lua").write_text(LAUNCHED)
    rcs, errs, took = run_ranks(tmp_path / "l.lua", [f"early={early}", f"ready={tmp_path / 'ready'}"], how)
    other = 1 - early
    assert rcs[early] == 0 and rcs[other] == 1, (rcs, errs)
    assert took < 60, (took, errs)  # not the 240 s of WICK_DIST_TIMEOUT
    assert f"rank {other} of 2: rank {early} ended (exit code 0) without reaching the rendezvous" in errs[other], errs
    assert "every rank must make the same wick.train calls" in errs[other], errs


@pytest.mark.parametrize("how", HOWS)
def test_without_the_launcher_a_rank_that_fails_before_wick_train_is_named_at_once(tmp_path, how):
    (tmp_path / "l.lua").write_text(LAUNCHED)
    rcs, errs, took = run_ranks(tmp_path / "l.lua", ["fails=1", f"ready={tmp_path / 'ready'}"], how)
    assert rcs == [1, 1], (rcs, errs)
    assert took < 60, (took, errs)
    assert "rank 1 fails early" in errs[1], errs
    assert "rank 0 of 2: rank 1 stopped with an error (its own output says why) without reaching the rendezvous" \
        in errs[0], errs


@pytest.mark.parametrize("quits", [0, 1])
@pytest.mark.parametrize("where", sorted(AFTER))
def test_without_the_launcher_a_rank_that_returns_after_wick_train_ends_the_run_at_once_named(tmp_path, where,
                                                                                             quits):
    (tmp_path / "l.lua").write_text(AFTER[where])
    rcs, errs, took = run_ranks(tmp_path / "l.lua", [f"quits={quits}"], HOWS[quits])
    other = 1 - quits
    assert rcs[quits] == 0 and rcs[other] == 1, (rcs, errs)
    assert took < 60, (took, errs)
    assert (f"rank {other} of 2: rank {quits} ended (exit code 0) while this rank waited for it" in errs[other]
            or f"rank {quits} had ended (exit code 0)" in errs[other]), errs


def test_under_torchrun_a_rank_that_returns_before_wick_train_ends_the_run_at_once_named(tmp_path):
    """The real torchrun (the venv's): its agent hosts the store; rank 0
    reads there that rank 1's recipe returned and stops, and torchrun ends."""
    import sys

    (tmp_path / "l.lua").write_text(LAUNCHED)
    e = {k: v for k, v in ENV.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "SLURM_", "LOCAL_"))}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", free_port(), "--no-python", WICK, "run", str(tmp_path / "l.lua"), "early=1",
                        f"ready={tmp_path / 'ready'}"], env={**e, "WICK_DIST_TIMEOUT": "240"}, capture_output=True,
                       text=True, timeout=300)
    took = time.monotonic() - t0
    assert p.returncode != 0, p.stdout + p.stderr
    assert took < 60, (took, p.stderr)
    assert "rank 0 of 2: rank 1 ended (exit code 0) without reaching the rendezvous" in p.stderr, p.stderr


def test_a_process_that_only_looks_like_rank_0_of_several_ends_at_once(tmp_path):
    """An sbatch script's own step (SLURM_PROCID=0 of SLURM_NTASKS=4) or RANK=0
    set by hand, running a recipe with no wick.train: it ends at once, not
    after waiting for ranks that never come."""
    (tmp_path / "p.lua").write_text('print("prepared")\n')
    for env in rank_envs("SLURM")[:1] + rank_envs("torchrun-style variables")[:1]:
        e = {k: v for k, v in ENV.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "SLURM_", "LOCAL_"))}
        e.update(env, WICK_DIST_TIMEOUT="240")
        t0 = time.monotonic()
        p = subprocess.run([WICK, "run", str(tmp_path / "p.lua")], env=e, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "prepared" in p.stdout, p.stderr
        assert time.monotonic() - t0 < 30, env
