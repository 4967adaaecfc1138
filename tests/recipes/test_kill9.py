"""kill -9 at random moments of a run that saves every step: every checkpoint
folder left behind is complete (each file of the size and CRC-32C its
state.json records), every restart with resume = true finds one, and the run
carried to its end through the kills ends at the weights of the unbroken run,
bit for bit. WICK_KILLS sets how many kills (default 12; the run's length grows
with it, and fewer kills than asked is a failure, never a quiet lower figure); the figures printed
are the ones docs/concepts/reliability.md states."""
import os
import random
import signal
import subprocess
import time
import json
import math
from pathlib import Path

from safetensors.numpy import load_file

from conftest import WICK

RECIPE = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 512, inputs = 64, classes = 4, seed = 2 })
wick.seed(3)
local model = wick.model("mlp", { inputs = 64, hidden = { 256, 256 }, outputs = 4 })
wick.train { model = model, data = data, optim = wick.optim("adamw", { lr = 1e-3 }), micro_batch = 16,
  accumulate = 2, epochs = tonumber(a.epochs), seed = 4, log_every = 1000, out = a.out, save_every = 1, keep_checkpoints = 2,
  resume = a.resume == "true" }
model:save(a.out .. "/final.safetensors")
"""

_TABLE = []
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    _TABLE.append(c)


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    t = _TABLE
    for b in data:
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def incomplete(ckpt: Path) -> str:
    """Why a checkpoint folder is not complete, or ''."""
    state = ckpt / "state.json"
    if not state.exists():
        return "no state.json"
    files = json.loads(state.read_text()).get("files", {})
    if not files:
        return "state.json lists no files"
    for name, want in files.items():
        p = ckpt / name
        if not p.exists():
            return f"{name} missing"
        data = p.read_bytes()
        if len(data) != want["bytes"] or f"{crc32c(data):08x}" != want["crc32c"]:
            return f"{name} differs from state.json"
    return ""


def test_kill9_leaves_complete_checkpoints_and_resumes_to_the_unbroken_weights(tmp_path, capsys):
    recipe = tmp_path / "recipe.lua"
    recipe.write_text(RECIPE)
    kills = int(os.environ.get("WICK_KILLS", "12"))
    # the run is as long as the kills asked need, at this machine's speed now:
    # each restart lives at most 1.6 s, so the run trains for at least three
    # times kills x 1.6 s (a fixed length ended before the last kill on an idle machine)
    t0 = time.monotonic()
    subprocess.run([WICK, "run", recipe, f"out={tmp_path / 'probe'}", "epochs=5"], check=True, capture_output=True,
                   timeout=600)
    per_epoch = (time.monotonic() - t0) / 5
    epochs = f"epochs={max(5 * max(kills, 12), math.ceil(3 * kills * 1.6 / per_epoch))}"
    subprocess.run([WICK, "run", recipe, f"out={tmp_path / 'plain'}", epochs], check=True, capture_output=True,
                   timeout=600 * max(1, kills // 12))
    unbroken = load_file(str(tmp_path / "plain" / "final.safetensors"))

    rng = random.Random(7)
    out = tmp_path / "killed"
    checked, resumes, killed, started = 0, 0, 0, 0
    while True:
        started += 1
        assert started < kills + 20, "the run never finished"
        p = subprocess.Popen([WICK, "run", recipe, f"out={out}", "resume=true", epochs], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        if killed < kills:
            try:
                p.wait(timeout=rng.uniform(0.4, 1.6))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                p.wait()
                killed += 1
        _, err = p.communicate(timeout=600)
        if started > 1 and (out / "checkpoints").exists():
            assert "resuming from" in err or p.returncode == -9, err
            resumes += "resuming from" in err
        ckpts = [c for c in (out / "checkpoints").glob("step-*") if c.is_dir() and not c.name.endswith(".tmp")] \
            if (out / "checkpoints").exists() else []
        for c in ckpts:
            why = incomplete(c)
            assert not why, f"after kill {killed}: {c.name}: {why}"
        checked += len(ckpts)
        if p.returncode == 0:
            break
        assert p.returncode == -9, err
    assert killed == kills, f"the run ended after {killed} of the {kills} kills asked (WICK_KILLS): it is too short"
    final = load_file(str(out / "final.safetensors"))
    assert final.keys() == unbroken.keys()
    for k in final:
        assert (final[k] == unbroken[k]).all(), k
    with capsys.disabled():
        print(f"\nkill -9: {killed} kills, {checked} checkpoint folders checked, all complete; "
              f"{resumes} resumes found a complete checkpoint; final weights equal to the unbroken run's")
