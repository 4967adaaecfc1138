"""Event files read back with TensorBoard's own readers: the Python event
accumulator (EventAccumulator.Scalars, which checks both masked CRC-32C of
every record), the plugin accumulator behind TensorBoard's Python backend, and
the Rust data server that TensorBoard's UI queries. Every scalar of every step
in metrics.jsonl must read back equal, under the tag wick's documented mapping
gives it, at float32 (TensorBoard's scalar type). Scalars are
Summary.Value.simple_value, as torch.utils.tensorboard's add_scalar writes
them."""
import json
import os
import socket
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tensorboard.backend.event_processing import plugin_event_accumulator as pea
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as stub
from tensorboard.util import tensor_util

SRC = Path(__file__).resolve().parents[3]


def tags_of(rec):
    """The mapping wick documents in scripts/lua/wick/runlog.lua."""
    out = {}
    group = "eval/" if rec.get("eval") else "train/"
    for k, v in rec.items():
        if k in ("step", "epoch", "eval"):
            continue
        if isinstance(v, bool):
            v = 1.0 if v else 0.0
        if isinstance(v, (int, float)):
            # TensorBoard's scalars are float32 (its data server shows no other dtype)
            out[("memory/" + k[4:]) if k.startswith("mem_") else group + k] = float(np.float32(v))
    return out


RECIPE = """
local wick = require "wick"
local data = wick.data("synthetic", { size = 96, inputs = 8, classes = 3, seed = 2 })
local eval = wick.data("synthetic", { size = 32, inputs = 8, classes = 3, seed = 3 })
wick.train {
  model = wick.model("mlp", { inputs = 8, hidden = { 16 }, outputs = 3 }),
  data = data, eval_data = eval, eval_every = 5,
  optim = wick.optim("adamw", { lr = 1e-2 }), schedule = "cosine", warmup_steps = 2,
  micro_batch = 4, accumulate = 2, epochs = 2, precision = "%s", out = "%s", quiet = true,
  -- fp16: a scale far too large, so the first steps overflow and are skipped
  loss_scale = { init = 2^40, backoff = 2^-10 },
  -- scalars a recipe logs from its callbacks
  on_step = function(r) return { log = { lr_x2 = r.lr * 2 } } end,
  on_eval = function(r) return { log = { loss_plus_1 = r.loss + 1 } } end,
}
"""


def run_recipe(run_wick, tmp_path, precision="fp32", name="run"):
    out = tmp_path / name
    recipe = tmp_path / f"{name}.lua"
    recipe.write_text(RECIPE % (precision, out))
    run_wick("run", recipe)
    return out, recipe


def records(out):
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def scalars(out, tag):
    """(step, value) of a tag as TensorBoard's EventAccumulator reads it."""
    ea = EventAccumulator(str(out), size_guidance={"scalars": 0})
    ea.Reload()
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def expected(out):
    want = {}
    for r in records(out):
        for tag, v in tags_of(r).items():
            want.setdefault(tag, []).append((r["step"], v))
    return want


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
def test_every_scalar_reads_back_equal(run_wick, tmp_path, precision):
    out, recipe = run_recipe(run_wick, tmp_path, precision)
    files = list(out.glob("events.out.tfevents.*"))
    assert len(files) == 1
    want = expected(out)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/items_per_s", "memory/resident", "eval/loss",
            "train/lr_x2", "eval/loss_plus_1"} <= set(want)
    if precision == "fp16-mixed":
        assert "train/loss_scale" in want
        skipped = [s for s, v in want["train/skipped"] if v == 1]
        assert skipped and all(s not in skipped for s, _ in want["train/grad_norm"])
    # TensorBoard's EventAccumulator, as a user reads a run: every scalar
    # under Scalars, at the steps and float32 values metrics.jsonl gives
    ea = EventAccumulator(str(out), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    assert set(ea.Tags()["scalars"]) == set(want)
    assert set(ea.Tags()["tensors"]) == {"recipe", "options"}
    for tag, series in want.items():
        assert [(e.step, e.value) for e in ea.Scalars(tag)] == series, tag  # exact, at float32
    assert [(e.step, e.value) for e in ea.Scalars("train/loss")] == \
        [(r["step"], float(np.float32(r["loss"]))) for r in records(out) if not r.get("eval")]
    # the plugin accumulator (TensorBoard's Python backend) takes simple_value
    # as the scalars plugin's float32 tensors
    acc = pea.EventAccumulator(str(out), size_guidance={pea.TENSORS: 0})
    acc.Reload()
    assert set(want) | {"recipe", "options"} == set(acc.Tags()["tensors"])
    for tag, series in want.items():
        assert acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"
        got = [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]
        assert got == series, tag
    steps = [r["step"] for r in records(out) if not r.get("eval")]
    assert steps == list(range(1, 25))
    text = tensor_util.make_ndarray(acc.Tensors("recipe")[0].tensor_proto).item().decode()
    assert recipe.read_text() in text
    assert acc.SummaryMetadata("recipe").plugin_data.plugin_name == "text"
    opts = tensor_util.make_ndarray(acc.Tensors("options")[0].tensor_proto).item().decode()
    assert "| precision | %s |" % precision in opts and "| micro_batch | 4 |" in opts


def test_records_are_framed_with_masked_crc32c(run_wick, tmp_path):
    """TFRecord framing checked byte by byte with TensorBoard's CRC-32C."""
    out, _ = run_recipe(run_wick, tmp_path)
    data = next(out.glob("events.out.tfevents.*")).read_bytes()
    from tensorboard.compat.proto import event_pb2
    pos, n = 0, 0
    events = []
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        assert hcrc == stub.masked_crc32c(header)
        body = data[pos + 12:pos + 12 + length]
        (dcrc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
        assert dcrc == stub.masked_crc32c(body)
        events.append(event_pb2.Event.FromString(body))
        pos += 16 + length
        n += 1
    assert pos == len(data)
    # file version, session start, recipe, options, 24 steps, 5 evaluations
    assert n == 4 + 24 + 5
    assert events[0].file_version == "brain.Event:2"
    assert events[1].session_log.status == event_pb2.SessionLog.START
    kinds = [e.WhichOneof("what") for e in events]
    assert kinds == ["file_version", "session_log"] + ["summary"] * (n - 2)
    # scalars: Summary.Value.simple_value (field 2), as torch.utils.tensorboard writes them
    steps = [e for e in events[2:] if any(v.tag == "train/loss" for v in e.summary.value)]
    assert [e.step for e in steps] == list(range(1, 25))
    for e in events[2:]:
        for v in e.summary.value:
            assert v.WhichOneof("value") == ("tensor" if v.tag in ("recipe", "options") else "simple_value"), v.tag
    # a flipped bit is caught by the reader
    bad = bytearray(data)
    bad[-6] ^= 0x10
    p = tmp_path / "bad" / "events.out.tfevents.1.x"
    p.parent.mkdir()
    p.write_bytes(bytes(bad))
    r = stub.PyRecordReader_New(str(p))
    with pytest.raises(Exception, match="crc"):
        for _ in range(n):
            r.GetNext()


def test_resumed_run_continues_the_series(run_wick, tmp_path):
    """A resumed run appends to metrics.jsonl and writes a second event file;
    TensorBoard reads both as one series with every step once."""
    out = tmp_path / "run"
    recipe = tmp_path / "run.lua"
    recipe.write_text(RECIPE.replace("epochs = 2,", "epochs = 2, max_steps = tonumber(wick.args.stop) or 0, resume = true,")
                      % ("fp32", out))
    run_wick("run", recipe, "stop=10")
    time.sleep(1.1)  # event file names carry the second they were opened in
    run_wick("run", recipe)
    assert len(list(out.glob("events.out.tfevents.*"))) == 2
    got = scalars(out, "train/loss")
    assert [s for s, _ in got] == list(range(1, 25))
    assert got == expected(out)["train/loss"]
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "finished" and meta["resumed"] == 1 and meta["steps"] == 24


def test_steps_run_again_after_a_resume_are_read_once(run_wick, tmp_path):
    """Steps logged after the last checkpoint of a killed run are run again
    by the resume: TensorBoard reads each step once, the resumed run's value
    (metrics.jsonl keeps only those too)."""
    out = tmp_path / "run"
    recipe = tmp_path / "run.lua"
    recipe.write_text(RECIPE.replace("epochs = 2,", "epochs = 2, max_steps = tonumber(wick.args.stop) or 0, resume = true, "
                                     "save_every = 4,") % ("fp32", out))
    run_wick("run", recipe, "stop=10")
    # as after a kill at step 10: the last checkpoint is step 8's
    import shutil
    shutil.rmtree(out / "checkpoints" / "step-00000010")
    (out / "checkpoints" / "last").write_text("step-00000008\n")
    first = {r["step"]: r["loss"] for r in records(out) if not r.get("eval")}
    time.sleep(1.1)
    run_wick("run", recipe, "lr_scale=1")  # (an unused key: the run itself is the same)
    got = scalars(out, "train/loss")
    assert [s for s, _ in got] == list(range(1, 25))
    assert got == expected(out)["train/loss"]
    # steps 9 and 10 are the resumed run's (equal to the first's here: the same weights and data)
    assert [r["step"] for r in records(out) if not r.get("eval")] == list(range(1, 25))
    assert first[9] == dict(got)[9] or abs(first[9] - dict(got)[9]) < 1e-6


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensorboard_data_server_serves_the_scalars(run_wick, tmp_path):
    """The Rust data server behind TensorBoard's UI, queried over gRPC as the
    UI's backend does."""
    tds = pytest.importorskip("tensorboard_data_server")
    from tensorboard.data import grpc_provider
    from tensorboard.data.proto import data_provider_pb2_grpc
    from tensorboard import context
    import grpc

    out, _ = run_recipe(run_wick, tmp_path)
    logdir = tmp_path  # the run is the subfolder "run"
    port_file = tmp_path / "port"
    server = subprocess.Popen([tds.server_binary(), "--logdir", str(logdir), "--port", "0", "--port-file",
                               str(port_file), "--die-after-stdin", "--reload", "once"],
                              stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not (port_file.exists() and port_file.read_text().strip()) and time.time() < deadline:
            time.sleep(0.1)
        addr = "localhost:" + port_file.read_text().strip()
        stub_ = data_provider_pb2_grpc.TensorBoardDataProviderStub(grpc.insecure_channel(addr))
        provider = grpc_provider.GrpcDataProvider(addr, stub_)
        ctx = context.RequestContext()
        want = expected(out)
        got = {}
        while time.time() < deadline:
            got = provider.read_scalars(ctx, experiment_id="", plugin_name="scalars", downsample=10000)
            if got.get("run") and len(got["run"]) == len(want) and \
                    all(len(got["run"][t]) == len(want[t]) for t in want):
                break
            time.sleep(0.2)
        series = got["run"]
        assert set(series) == set(want)
        for tag, pts in want.items():
            assert [(d.step, d.value) for d in series[tag]] == pts, tag
    finally:
        server.stdin.close()
        server.wait(timeout=30)
