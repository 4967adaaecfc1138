"""Many ranks on one machine over gloo: the same result as one rank with the
same effective batch, torchrun and SLURM variables, checkpoints written once
and resumed with another rank count, and failures that end the run, never hang."""
import os
import re
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import WICK, free_port  # tests/conftest.py

RECIPE = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = a.size, inputs = 8, classes = 3, max_items = 3, seed = 4 })
wick.seed(5)
local model = wick.model("mlp", { inputs = 8, hidden = { 12 }, outputs = 3 })
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }),
  schedule = a.schedule or "cosine", warmup_steps = 2, micro_batch = a.micro, accumulate = a.acc,
  epochs = a.epochs or 2, max_steps = a.max_steps or 0, seed = 9, clip_grad_norm = 0.5, quiet = true,
  bucket_mb = a.bucket_mb or 25, sync = a.sync or "window", out = a.out, resume = a.resume or false, save_every = a.save_every or 0,
  checkpointing = a.ck or false, precision = a.precision or "fp32" }
if wick.rank == 0 then model:save(a.result) end
print(string.format("rank %d steps %d loss %.9f", wick.rank, run.steps, run.final_loss))
"""


@pytest.fixture
def recipe(tmp_path):
    p = tmp_path / "recipe.lua"
    p.write_text(RECIPE)
    return p


def weights(path):
    return load_file(str(path))


def assert_same_weights(a, b, rtol=1e-5):
    wa, wb = weights(a), weights(b)
    assert set(wa) == set(wb)
    for k in wb:
        rel = ((wa[k] - wb[k]).abs().max() / wb[k].abs().max()).item()
        assert rel < rtol, f"{k}: relative difference {rel}"


# 3 epochs: at least 20 AdamW steps; samples carry 1..3 items each
@pytest.mark.parametrize("size,micro,acc,nproc,sync", [
    (56, 2, 2, 2, "window"),        # (world 2, micro 2, accumulate 2) vs (world 1, micro 8)
    (100, 2, 4, 2, "window"),
    (97, 2, 4, 2, "window"),        # uneven shards
    (100, 2, 2, 3, "window"),       # world 3, uneven shards
    (100, 2, 4, 2, "micro_batch"),  # DDP-style sync after every micro-batch: the same result
    (100, 2, 4, 2, "checkpointing"),  # blocks recomputed in the backward that reduces the gradients
])
def test_ranks_end_where_one_rank_with_the_same_effective_batch_ends(tmp_path, recipe, run_wick, size, micro, acc,
                                                                      nproc, sync):
    many, one = tmp_path / "many.safetensors", tmp_path / "one.safetensors"
    extra = ["ck=true"] if sync == "checkpointing" else []
    sync = "window" if sync == "checkpointing" else sync
    p = run_wick("launch", "--nproc-per-node", nproc, recipe, f"size={size}", f"micro={micro}", f"acc={acc}",
                 "epochs=3", f"sync={sync}", f"result={many}", *extra)
    assert "[rank 1] rank 1 steps" in p.stdout  # other ranks' lines are prefixed
    steps = int(p.stdout.split("rank 0 steps ")[1].split()[0])
    assert steps >= 20
    run_wick("run", recipe, f"size={size}", f"micro={micro * acc * nproc}", "acc=1", "epochs=3", f"result={one}")
    assert_same_weights(many, one)


def test_ranks_start_from_rank_0s_weights(tmp_path, recipe, run_wick):
    seeded = tmp_path / "seeded.lua"
    seeded.write_text(RECIPE.replace("wick.seed(5)", "wick.seed(5 + wick.rank)"))
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    run_wick("launch", "--nproc-per-node", 2, seeded, "size=64", "micro=2", "acc=2", f"result={a}")
    run_wick("run", recipe, "size=64", "micro=8", "acc=1", f"result={b}")
    assert_same_weights(a, b)


def test_many_small_buckets_give_the_same_result(tmp_path, recipe, run_wick):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    run_wick("launch", "--nproc-per-node", 2, recipe, "size=64", "micro=2", "acc=2", f"result={a}")
    run_wick("launch", "--nproc-per-node", 2, recipe, "size=64", "micro=2", "acc=2", "bucket_mb=0.0001", f"result={b}")
    assert_same_weights(a, b, rtol=1e-6)


def start_ranks(recipe, args, envs):
    procs = []
    for env in envs:
        e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
        e.update(env)
        procs.append(subprocess.Popen([WICK, "run", str(recipe), *args], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    return outs


def test_wick_run_joins_under_torchrun_and_slurm_variables(tmp_path, recipe, run_wick):
    args = ["size=64", "micro=2", "acc=2"]
    ref = tmp_path / "ref.safetensors"
    run_wick("launch", "--nproc-per-node", 2, recipe, *args, f"result={ref}")
    port = free_port()
    torchrun = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for r in range(2)]
    start_ranks(recipe, args + [f"result={tmp_path / 't.safetensors'}"], torchrun)
    assert_same_weights(tmp_path / "t.safetensors", ref, rtol=1e-6)
    port = free_port()
    slurm = [{"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r), "SLURM_NTASKS_PER_NODE": "2",
              "SLURM_NODELIST": "localhost", "MASTER_PORT": port} for r in range(2)]
    start_ranks(recipe, args + [f"result={tmp_path / 's.safetensors'}"], slurm)
    assert_same_weights(tmp_path / "s.safetensors", ref, rtol=1e-6)


def test_wick_run_under_the_real_torchrun_joins_its_agents_store(tmp_path, recipe, run_wick):
    """torchrun (the venv's, 2 processes) hosts the rendezvous store in its
    agent on --master-port and says so (TORCHELASTIC_USE_AGENT_STORE=True):
    every rank connects to it as a client, none binds the port itself, and
    the run ends at the weights `wick launch` reaches."""
    import sys

    args = ["size=64", "micro=2", "acc=2"]
    ref = tmp_path / "ref.safetensors"
    run_wick("launch", "--nproc_per_node=2", "--standalone", recipe, *args, f"result={ref}")
    outer = tmp_path / "outer.lua"
    outer.write_text('local wick = require "wick"\n'
                     'print("source " .. wick.core.dist().source)\n'
                     f'dofile("{recipe}")\n')
    e = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "SLURM_"))}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-port", free_port(), "--no-python", WICK, "run", str(outer), *args,
                        f"result={tmp_path / 't.safetensors'}"], env=e, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("source torchrun's agent store") == 2, p.stdout
    assert_same_weights(tmp_path / "t.safetensors", ref, rtol=1e-6)


def test_checkpoint_is_written_once_and_resumes_with_another_rank_count(tmp_path, recipe, run_wick):
    out = tmp_path / "run"
    common = ["size=96", "micro=2", "schedule=constant", "epochs=3"]
    # 2 ranks x accumulate 4 = 16 per step; stop after 4 of the 18 steps
    run_wick("launch", "--nproc-per-node", 2, recipe, *common, "acc=4", "max_steps=4", f"out={out}",
             f"result={tmp_path / 'first.safetensors'}")
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["last", "step-00000004"]  # one folder, no temporary left behind
    assert (out / "checkpoints" / "last").read_text() == "step-00000004\n"
    # resume on one rank: accumulate 8 keeps the effective batch of 16
    p = run_wick("run", recipe, *common, "acc=4", "resume=true", f"out={out}",
                 f"result={tmp_path / 'resumed.safetensors'}")
    assert "accumulate 4 -> 8 keeps the effective batch of 16" in p.stderr
    assert "steps 18" in p.stdout
    run_wick("run", recipe, *common, "acc=8", f"result={tmp_path / 'unbroken.safetensors'}")
    assert_same_weights(tmp_path / "resumed.safetensors", tmp_path / "unbroken.safetensors")


SAVE_FROM_EVERY_RANK = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 32, inputs = 8, classes = 3, seed = 4 })
local model = wick.model("mlp", { inputs = 8, hidden = { 12 }, outputs = 3 })
wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }), micro_batch = 4, epochs = 1,
  quiet = true }
-- each rank its own decoder weights: the folder shows whose were written
wick.seed(7 + wick.rank)
local lm = wick.model("decoder_lm", { vocab_size = 16, hidden_size = 8, intermediate_size = 16, layers = 1, heads = 2 })
-- rank 1 saves last: had it written, its weights would be what the files hold
if wick.rank == 1 then os.execute("sleep 1") end
model:save(a.dest .. "/model.safetensors")
lm:save(a.dest .. "/lm.safetensors")
wick.save_pretrained(lm, a.dest .. "/lm", a.tok)
print(string.format("rank %d of %d is_main %s", wick.rank, wick.world_size, tostring(wick.is_main())))
"""


def test_saving_from_every_rank_writes_once_from_rank_0(tmp_path, run_wick):
    """model:save and wick.save_pretrained called on every rank: rank 0
    writes each file once, whole; the other ranks go on, and the run exits 0.
    wick.is_main() is rank 0."""
    recipe = tmp_path / "save.lua"
    recipe.write_text(SAVE_FROM_EVERY_RANK)
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"model": {}}\n')
    out = tmp_path / "out"
    p = run_wick("launch", "--nproc-per-node", 2, recipe, f"dest={out}", f"tok={tok}")
    assert "rank 0 of 2 is_main true" in p.stdout
    assert "[rank 1] rank 1 of 2 is_main false" in p.stdout
    # one intact file each, no temporary left behind
    assert sorted(f.name for f in out.iterdir()) == ["lm", "lm.safetensors", "model.safetensors"]
    assert sorted(f.name for f in (out / "lm").iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "lm" / "tokenizer.json").read_text() == tok.read_text()
    assert len(weights(out / "model.safetensors")) == 4  # the MLP's two weights and biases
    # the files hold rank 0's decoder (seed 7), as one process makes it, not rank 1's
    one = tmp_path / "one"
    p = run_wick("run", recipe, f"dest={one}", f"tok={tok}")
    assert "rank 0 of 1 is_main true" in p.stdout
    want = weights(one / "lm.safetensors")
    for f in (out / "lm.safetensors", out / "lm" / "model.safetensors"):
        got = weights(f)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), f


def test_ranks_with_different_options_are_refused(tmp_path, run_wick):
    r = tmp_path / "r.lua"
    r.write_text(RECIPE.replace("micro_batch = a.micro", "micro_batch = a.micro + wick.rank"))
    p = run_wick("launch", "--nproc-per-node", 2, r, "size=32", "micro=2", "acc=1",
                 f"result={tmp_path / 'x.safetensors'}", check=False)
    assert p.returncode == 1
    assert "rank 1's recipe and wick.train options differs from rank 0's" in p.stderr
    assert "micro_batch=3" in p.stderr and "micro_batch=2" in p.stderr


def test_ranks_whose_data_differ_in_content_are_refused(tmp_path, run_wick):
    """The same number of samples, other samples (each rank its own data): not
    the run of one rank with the same effective batch."""
    r = tmp_path / "r.lua"
    r.write_text(RECIPE.replace("classes = 3, max_items = 3, seed = 4", "classes = 3, max_items = 3, seed = 4 + wick.rank"))
    p = run_wick("launch", "--nproc-per-node", 2, r, "size=32", "micro=2", "acc=1",
                 f"result={tmp_path / 'x.safetensors'}", check=False)
    assert p.returncode == 1
    assert "rank 1's recipe and wick.train options differs from rank 0's" in p.stderr
    # only what differs is named
    assert re.search(r"options differs from rank 0's: data-digest [0-9a-f]{16} vs [0-9a-f]{16} \(every rank", p.stderr), \
        p.stderr


DIE = """
local wick = require "wick"
local data = wick.data("synthetic", { size = 100000, inputs = 8, classes = 3 })
local model = wick.model("mlp", { inputs = 8, hidden = { 12 }, outputs = 3 })
local loader = wick.loader(data, { micro_batch = 4, accumulate = 2 })
local trainer = wick.trainer { model = model, optim = wick.optim("sgd", {}) }
for i = 1, 100000 do
  trainer:step(loader:next())
  if wick.rank == 1 and i == 5 and wick.args.how == "exit" then os.exit(3) end
  if wick.rank == 1 and i == 5 and wick.args.how == "stall" then while true do end end
  if wick.rank == 1 and i == 5 and wick.args.how == "kill" then
    local pid = io.open("/proc/self/stat"):read("*n")
    os.execute("kill -9 " .. pid)
  end
end
"""


@pytest.mark.parametrize("how,expect", [("exit", "rank 1 exited with code 3"),
                                        ("kill", "rank 1 was killed by signal SIGKILL"),
                                        ("stall", "another rank probably stopped, crashed or stalled")])
def test_a_rank_that_dies_or_stalls_ends_the_run_with_a_clear_error(tmp_path, how, expect):
    r = tmp_path / "die.lua"
    r.write_text(DIE)
    t0 = time.monotonic()
    p = subprocess.run([WICK, "launch", "--nproc-per-node", "2", str(r), f"how={how}"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "WICK_DIST_TIMEOUT": "3"})
    assert p.returncode == 1
    assert expect in p.stderr, p.stderr
    assert "another rank probably stopped, crashed or stalled" in p.stderr or how != "stall"
    assert "wick launch: rank" in p.stderr
    assert time.monotonic() - t0 < 60


def test_sigterm_to_the_launcher_stops_every_rank_after_the_same_step(tmp_path, recipe):
    out = tmp_path / "run"
    p = subprocess.Popen([WICK, "launch", "--nproc-per-node", "2", str(recipe), "size=400000", "micro=4", "acc=2",
                          "epochs=1", f"out={out}", f"result={tmp_path / 'w.safetensors'}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    for _ in range(600):
        if metrics.exists() and metrics.stat().st_size > 0:
            break
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    steps = {line.split()[1]: int(line.split()[3]) for line in stdout.replace("[rank 1] ", "").splitlines()
             if line.startswith("rank")}
    assert steps["0"] == steps["1"] > 0
    assert "SIGTERM at step" in stderr
    assert (out / "checkpoints" / f"step-{steps['0']:08d}" / "state.json").exists()


FP16 = """
local wick = require "wick"
local a = wick.args
local data = wick.data("tensors", { file = a.data })
local model = wick.model("mlp", { inputs = 6, hidden = { 10 }, outputs = 3 })
local run = wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }),
  micro_batch = a.micro, accumulate = a.acc, shuffle = false, quiet = true, precision = "fp16-mixed",
  loss_scale = { init = 1024, interval = 3 } }
local skipped, scales = {}, {}
for _, h in ipairs(run.history) do
  if h.skipped then skipped[#skipped + 1] = h.step end
  scales[#scales + 1] = string.format("%g", h.loss_scale)
end
print(string.format("rank %d skipped [%s] scales [%s]", wick.rank, table.concat(skipped, ","), table.concat(scales, ",")))
if wick.rank == 0 then model:save(a.result) end
"""


def test_fp16_overflow_on_one_rank_only_makes_every_rank_skip_that_step(tmp_path, run_wick):
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    y = torch.randint(0, 3, (64,))
    x[13] *= 1e5  # beyond fp16: inf in the forward; window 2 (samples 8..15), on 2 ranks in rank 1's shard only
    from safetensors.torch import save_file
    save_file({"x": x, "y": y}, tmp_path / "data.safetensors")
    r = tmp_path / "fp16.lua"
    r.write_text(FP16)
    many, one = tmp_path / "many.safetensors", tmp_path / "one.safetensors"
    p = run_wick("launch", "--nproc-per-node", 2, r, f"data={tmp_path / 'data.safetensors'}", "micro=2", "acc=2",
                 f"result={many}")
    lines = {l.replace("[rank 1] ", "").split(" skipped ")[0]: l.split(" skipped ")[1]
             for l in p.stdout.splitlines() if " skipped " in l}
    assert lines["rank 0"] == lines["rank 1"], p.stdout
    assert lines["rank 0"].startswith("[2] scales [1024,1024,512,"), p.stdout
    q = run_wick("run", r, f"data={tmp_path / 'data.safetensors'}", "micro=8", "acc=1", f"result={one}")
    assert q.stdout.split(" skipped ")[1].strip() == lines["rank 0"]
    assert_same_weights(many, one, rtol=5e-3)  # fp16 rounding of differently split sums


def test_a_lone_rank_says_at_once_whom_it_waits_for_and_where(tmp_path, recipe):
    port = free_port()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
           "WICK_DIST_TIMEOUT": "8"}
    t0 = time.monotonic()
    p = subprocess.Popen([WICK, "run", str(recipe), "size=16", "micro=2", "acc=1", f"result={tmp_path / 'x'}"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = p.stderr.readline()  # the notice comes while the rank still waits
    while first.startswith("wick: warning:"):  # result= is read after training: a notice of its own
        first = p.stderr.readline()
    waited = time.monotonic() - t0
    assert p.poll() is None, "said while waiting, not only in the final error"
    assert waited < 5, f"the first notice came after {waited:.1f} s"
    assert f"wick: rank 0 of 3: waiting for ranks 1-2 at 127.0.0.1:{port} (torchrun-style variables)" in first, first
    assert "gives up after 8 s, WICK_DIST_TIMEOUT" in first, first
    rest = p.communicate(timeout=60)[1]
    assert p.returncode == 1
    assert "timed out after 8 s: ranks 1-2 never arrived" in rest, rest


# Rank 0 waits in a child process that ignores SIGTERM, and left one running in
# the background; rank 1 left one in the background too, then gave up.
ORPHANS = """
local rank = tonumber(os.getenv("RANK"))
local tag = wick_tag
os.execute("(trap '' TERM; exec sleep " .. tag .. rank .. ") &")
if rank == 1 then error("rank 1 gives up") end
os.execute("trap '' TERM; sleep " .. tag .. "9")
"""


def sleepers(tag):
    """The processes whose command line is `sleep <tag>...`, by reading /proc."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if len(args) >= 2 and args[0].endswith(b"sleep") and args[1].startswith(tag.encode()):
            found.append(int(pid))
    return found


def test_stopping_the_ranks_stops_every_process_they_started(tmp_path):
    tag = f"{1000 + os.getpid() % 1000}.{int(time.time()) % 1000}"  # sleep's seconds, unique to this test run
    r = tmp_path / "orphans.lua"
    r.write_text(ORPHANS.replace("wick_tag", repr(tag)))
    t0 = time.monotonic()
    p = subprocess.run([WICK, "launch", "--nproc-per-node", "2", str(r)], capture_output=True, text=True, timeout=120)
    try:
        assert p.returncode == 1
        assert "rank 1 exited with code 1; the other ranks were stopped" in p.stderr, p.stderr
        assert time.monotonic() - t0 < 60
        time.sleep(0.5)
        assert sleepers(tag) == [], "a process a rank started outlived the launcher"
    finally:
        for pid in sleepers(tag):
            os.kill(pid, signal.SIGKILL)


CALLBACKS = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 64, inputs = 8, classes = 3, seed = 4 })
local held = wick.data("synthetic", { size = 16, inputs = 8, classes = 3, seed = 5 })
local model = wick.model("mlp", { inputs = 8, hidden = { 12 }, outputs = 3 })
local calls = 0
local run = wick.train { model = model, data = data, eval_data = held, optim = wick.optim("sgd", { lr = 0.1 }),
  micro_batch = 2, accumulate = 2, epochs = 4, quiet = true, eval_every = 2,
  callbacks_every_rank = a.every,
  on_step = function(rec)
    calls = calls + 1
    -- only rank 1 asks: when callbacks run on every rank, every rank stops after step 5
    if wick.rank == 1 and rec.step == 5 then return { stop = "rank 1 had enough" } end
    if wick.rank == 0 and rec.step == 7 then return { stop = true } end
  end }
print(string.format("rank %d steps %d calls %d status %s", wick.rank, run.steps, calls, run.status))
"""


@pytest.mark.parametrize("every,steps,calls0,calls1", [("false", 7, 7, 0), ("true", 5, 5, 5)])
def test_callbacks_run_on_rank_0_and_a_stop_stops_every_rank(tmp_path, run_wick, every, steps, calls0, calls1):
    """on_step runs on rank 0 only unless callbacks_every_rank; a stop asked on
    any rank stops all of them after the same step (no rank left waiting)."""
    recipe = tmp_path / "callbacks.lua"
    recipe.write_text(CALLBACKS)
    p = run_wick("launch", "--nproc-per-node", 2, recipe, f"every={every}")
    assert f"rank 0 steps {steps} calls {calls0} status stopped" in p.stdout, p.stdout + p.stderr
    assert f"[rank 1] rank 1 steps {steps} calls {calls1} status stopped" in p.stdout, p.stdout + p.stderr


# Ranks on one machine share its cores: a rank with every core's worth of
# intra-op threads fights the others (on 2 cores a busy second core made
# PyTorch's products 15 times slower). The launcher gives each rank its share
# of the cores when OMP_NUM_THREADS is not set, and keeps a value given.
@pytest.mark.parametrize("given", [None, "1", "3"])
def test_the_launcher_gives_each_rank_its_share_of_the_cores(tmp_path, given):
    (tmp_path / "t.lua").write_text('local wick = require "wick"\n'
                                    'print("rank " .. wick.rank .. " threads " .. tostring(os.getenv("OMP_NUM_THREADS")))\n')
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if given:
        env["OMP_NUM_THREADS"] = given
    p = subprocess.run([WICK, "launch", "--nproc-per-node", "2", tmp_path / "t.lua"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    want = given or str(max(1, os.cpu_count() // 2))
    lines = sorted(line.replace("[rank 1] ", "") for line in p.stdout.splitlines() if "threads" in line)
    assert lines == [f"rank 0 threads {want}", f"rank 1 threads {want}"], p.stdout
