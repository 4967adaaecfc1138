"""wick's CUDA paths against its CPU results, as a table (scripts/gpu-check).

Every check trains a small recipe twice and compares what the two runs give
(final and first-step loss, weights, memory figures, the micro-batch chosen):
once on the CPU and once on CUDA, or twice on CUDA with one setting changed
where the setting has a device side of its own (pinned copies, checkpointing,
chunked cross-entropy, micro_batch = 'auto', ranks). With --self-test the
CUDA side runs on the CPU as well: the checks' own logic exercised where no
GPU is. Without a usable CUDA device (and without --self-test) it says so and
exits 0, so the suite stays green on CPU machines (the ctest that runs it
carries the label `cuda` and prints a SKIP line).

Tolerances are written in each row. wick does not enable TF32 (nothing in
host/ or plugins/ sets allow_tf32 or float32_matmul_precision, and LibTorch
leaves cuBLAS fp32 matmuls in full fp32), so fp32 rows hold CPU and GPU to
1e-4; cuDNN convolutions (the ViT patch embedding) may use TF32 by LibTorch's
default, which only the media rows (GPU against GPU) meet.

Runs with the same arguments are made once and shared between checks, and
every check's first runs are started ahead, several at a time
(WICK_GPU_CHECK_PARALLEL, default 4), so that the seconds each wick process
spends loading LibTorch and making a CUDA context overlap. On CUDA a block
naming the device comes first; --json PATH writes every row (name, cpu,
device, verdict, ok, seconds) and every wick run (arguments, seconds) to a
file. Only the standard library is needed, and torch for the device block
(a device machine's Python has torch; numpy and safetensors are not needed:
the weights are read from the safetensors files directly, bf16 included).

  python3 tests/gpu/gpu_check.py [--self-test] [--only NAME ...] [--json PATH] [--device-info] [--list]

WICK names the wick binary (default: the build tree's build/bin/wick).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

# (a bundle may ship this file alone: the build tree is only the default when WICK is unset)
_HERE = Path(__file__).resolve()
WICK = os.environ.get("WICK") or str((_HERE.parents[2] if len(_HERE.parents) > 2 else _HERE.parent) / "build" / "bin" / "wick")
RUN_TIMEOUT = 240      # seconds one wick process may take
LAUNCH_TIMEOUT = 90    # several ranks: WICK_DIST_TIMEOUT below stops a stuck collective first
DIST_TIMEOUT = "30"
# wick processes at once: every check's first runs are started ahead, PARALLEL at a time, so that
# their start-up (loading LibTorch, making a CUDA context: seconds each) overlaps
PARALLEL = max(1, int(os.environ.get("WICK_GPU_CHECK_PARALLEL", "4")))

RECIPE = r"""
local wick = require "wick"
local a = wick.args
local function flag(k) return tostring(a[k]) == "true" end
local model, data
if a.model == "decoder" then
  -- one document, or (docs = N) the same lines in N files: documents that pack_attention may keep apart
  local docs, files = tonumber(a.docs) or 1, {}
  for d = 1, docs do
    files[d] = docs == 1 and a.text or string.format("%s.%d.txt", a.text, d)
    local f = assert(io.open(files[d], "w"))
    for i = math.floor((d - 1) * 48 / docs) + 1, math.floor(d * 48 / docs) do
      f:write(string.format("line %d of a small text, repeated so that a decoder can learn it. ", i % 7))
    end
    f:close()
  end
  data = wick.data("text", { files = files, max_length = 64, pack = true, pack_attention = a.pack_attention })
  wick.seed(3)
  local width = tonumber(a.width) or 64
  model = wick.model("decoder_lm", { vocab_size = data.vocab_size, hidden_size = width, intermediate_size = 2 * width,
                                     layers = tonumber(a.layers) or 2, heads = 4, kv_heads = 2, loss_chunk = tonumber(a.loss_chunk),
                                     deferred = flag("deferred"), quantize = flag("nf4") and "nf4" or "none" })
  if flag("qlora") then wick.optim("qlora", { r = 4, alpha = 8, compute_dtype = a.compute or "fp32" }):apply(model) end
elseif a.model == "video" then
  data = wick.data("video_folder", { root = a.root, max_frames = 4, image_size = 32 })
  wick.seed(3)
  model = wick.model("video_classifier", { classes = data.num_classes, image_size = 32, patch_size = 8, hidden_size = 32,
                                           intermediate_size = 64, layers = 1, heads = 2, max_frames = 4 })
elseif a.model == "image" then
  data = wick.data("image_folder", { root = a.root, image_size = 32 })
  wick.seed(3)
  model = wick.model("vit", { classes = data.num_classes, image_size = 32, patch_size = 8, hidden_size = 32,
                              intermediate_size = 64, layers = 1, heads = 2 })
else
  data = wick.data("synthetic", { size = tonumber(a.size) or 256, inputs = 32, classes = 4, seed = 2 })
  wick.seed(3)
  model = wick.model("mlp", { inputs = 32, hidden = { tonumber(a.hidden) or 64, tonumber(a.hidden) or 64 }, outputs = 4 })
end
local optim
if a.optim == "adamw8bit" then
  optim = wick.optim("adamw8bit", { lr = 1e-3, min_8bit_size = tonumber(a.min8) or 4096 })
else
  optim = wick.optim("adamw", { lr = 1e-3 })
end
local run = wick.train {
  model = model, data = data, optim = optim, device = a.device,
  micro_batch = a.micro == "auto" and "auto" or tonumber(a.micro) or 16, batch_size = tonumber(a.batch),
  accumulate = tonumber(a.acc) or 2, epochs = tonumber(a.epochs) or 1, max_steps = tonumber(a.steps) or 8,
  precision = a.precision or "fp32", master_weights = flag("master"), shard = a.shard or "none",
  workers = tonumber(a.workers) or 0, seed = 4, quiet = true, out = a.out, log_every = 1,
  memory_fraction = tonumber(a.fraction) or 0, empty_cache_every = tonumber(a.empty) or 0,
  overwrite = not flag("resume"), resume = flag("resume"),
  checkpointing = flag("checkpointing"), offload_activations = flag("offload"), offload_embeddings = flag("host_table"),
  clip_grad_norm = tonumber(a.clip) or 0, ema = tonumber(a.ema) or 0, eval_ema = (tonumber(a.ema) or 0) > 0 and flag("eval"),
  profile = flag("profile"),
  eval_data = flag("eval") and data or nil,
}
if wick.rank == 0 then
  model:save(a.weights)
  local f = assert(io.open(a.result, "w"))
  f:write(string.format('{"final_loss": %.9g, "steps": %d, "micro_batch": %d, "accumulate": %d, "skipped": %d, ' ..
    '"optimizer_bytes": %d, "master_bytes": %d, "world": %d, "eval_loss": %.9g, "eval_ema_loss": %.9g, ' ..
    '"collectives": %d, "shard": "%s"}\n',
    run.final_loss, run.steps, run.micro_batch or 0, run.accumulate or 0, run.skipped_steps or 0,
    run.memory.optimizer or 0, run.memory.master_weights or 0, wick.world_size or 1,
    run.eval and run.eval.loss or -1, run.eval and run.eval.ema_loss or -1,
    run.comm and run.comm.collectives or 0, tostring(run.shard or "none")))
  f:close()
end
"""


class Skip(Exception):
    """A check that has no meaning here: its row says why, and it counts as neither passed nor failed."""


class _Planned(Exception):
    pass


class Planner:
    """Stands in for the Runner while a check is looked at ahead: notes the runs its first call asks
    for (later calls may depend on their results) and stops it there."""

    def __init__(self, runner):
        self._runner, self.specs = runner, []

    def run(self, **spec):
        self.specs.append(spec)
        raise _Planned

    def runs(self, *specs):
        self.specs.extend(specs)
        raise _Planned

    def __getattr__(self, name):
        return getattr(self._runner, name)


def wick_version() -> dict:
    p = subprocess.run([WICK, "version"], capture_output=True, text=True)
    out = {}
    for line in p.stdout.splitlines():
        k, _, v = line.partition(" ")
        if k:
            out[k] = v.strip()
    return out


def cuda_usable() -> tuple[bool, str]:
    line = wick_version().get("cuda_usable", "unknown")
    return line.startswith("yes"), line


def gpu_count() -> int:
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        return len([l for l in p.stdout.splitlines() if l.startswith("GPU ")])
    except FileNotFoundError:
        return 0


def device_info() -> dict:
    """The device block printed first on CUDA (and kept in --json): the card, then the versions."""
    info: dict = {}
    try:
        import torch
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["device"] = torch.cuda.get_device_name(0)
            info["total memory"] = f"{p.total_memory / 2**30:.1f} GiB ({p.total_memory} bytes)"
            info["capability"] = f"{p.major}.{p.minor}, {p.multi_processor_count} SMs"
            info["torch devices"] = torch.cuda.device_count()
            try:  # what LibTorch does by default, which wick leaves as it is
                import warnings
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    info["tf32 by default"] = (f"cuBLAS {torch.backends.cuda.matmul.allow_tf32}, "
                                               f"cuDNN {torch.backends.cudnn.allow_tf32}")
            except Exception:  # noqa: BLE001
                pass
        else:
            info["device"] = "torch sees no CUDA device"
        info["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    except Exception as e:  # noqa: BLE001 -- the block informs, it does not decide
        info["torch"] = f"not importable ({e})"
    info["nvidia-smi GPUs"] = gpu_count()
    for k, v in wick_version().items():
        if k in ("wick", "libtorch", "cuda_runtime", "cuda_driver", "nccl", "cuda_usable"):
            info[k if k == "wick" else f"wick {k}"] = v
    return info


def cuda_total_memory() -> int:
    try:
        import torch
        return torch.cuda.get_device_properties(0).total_memory
    except Exception:  # noqa: BLE001 -- no torch here: ask the driver
        p = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, check=True)
        return int(float(p.stdout.split()[0]) * 2**20)


class Runner:
    """Runs the recipe; a run with the same arguments as an earlier one is that run (its folder, its result)."""

    def __init__(self, work: Path, device: str, env: dict):
        self.work, self.device, self.env = work, device, env
        (work / "recipe.lua").write_text(RECIPE)
        self.n = 0
        self.cache: dict = {}  # argument tuple -> Future of the run's result
        self.lock = threading.Lock()
        self.log: list = []  # every wick run: its arguments, seconds, outcome (in --json)
        self.clips: Path | None = None

    def runs(self, *specs: dict) -> list:
        """Several runs at once (each its own process; their start-up, CUDA's included, overlaps):
        their results in order. The first failure is raised once all have ended."""
        if len(specs) == 1:
            return [self.run(**specs[0])]
        with ThreadPoolExecutor(max_workers=min(len(specs), PARALLEL)) as pool:
            futures = [pool.submit(self.run, **spec) for spec in specs]
        return [f.result() for f in futures]

    def run(self, device=None, launch=0, env=None, **args):
        args = {"device": device or self.device, **{k: str(v) for k, v in args.items()}}
        key = (launch, tuple(sorted((env or {}).items())), tuple(sorted(args.items())))
        with self.lock:
            if key not in self.cache:
                self.cache[key] = Future()
                mine = True
            else:
                mine = False
            future = self.cache[key]
        if not mine:  # made (or being made) for an earlier check: the same result, or the same failure
            return future.result()
        try:
            res = self._run(args, launch, env)
        except Exception as e:
            future.set_exception(e)
            with self.lock:
                self.log.append({"launch": launch, "env": env or {}, "args": args, "ok": False, "error": str(e)})
            raise
        future.set_result(res)
        with self.lock:
            self.log.append({"launch": launch, "env": env or {}, "args": args, "ok": True,
                             "seconds": round(res["seconds"], 2)})
        return res

    def _run(self, args, launch, env):
        with self.lock:
            self.n += 1
            d = self.work / f"run{self.n}"
        d.mkdir()
        # (an `out` given is a run folder shared on purpose: resume)
        args = {"out": d / "out", **args, "weights": d / "w.safetensors", "result": d / "result.json",
                "text": d / "text.txt"}
        out = Path(args["out"])
        cmd = [WICK, "run", str(self.work / "recipe.lua")] + [f"{k}={v}" for k, v in args.items()]
        if launch:
            cmd = [WICK, "launch", "--nproc-per-node", str(launch)] + cmd[2:]
        full_env = {**os.environ, **self.env, **(env or {})}
        # runs side by side: LibTorch's CPU threads shared out rather than each taking every core
        full_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // PARALLEL)))
        if launch:
            full_env.setdefault("WICK_DIST_TIMEOUT", DIST_TIMEOUT)
        t = time.time()
        limit = LAUNCH_TIMEOUT if launch else RUN_TIMEOUT
        # its own process group: a run past its time is ended with every rank it started
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                             start_new_session=True)
        try:
            stdout, stderr = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
            p.communicate()
            raise RuntimeError(f"wick did not end within {limit} s (ended): "
                               + " ".join(str(c) for c in cmd[:5]) + " ... " + " ".join(
                                   f"{k}={v}" for k, v in args.items() if k not in ("out", "weights", "result", "text")))
        if p.returncode != 0:
            lines = [l for l in stderr.strip().splitlines() if l.strip()]
            err = RuntimeError(f"wick exited {p.returncode}: {lines[-1] if lines else ''}")
            err.stderr = stderr  # type: ignore[attr-defined]
            raise err
        res = json.loads((d / "result.json").read_text())
        res["seconds"] = time.time() - t
        res["weights"] = d / "w.safetensors"
        metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
        res["records"] = [r for r in metrics if "step" in r]
        res["out"] = out
        run_json = out / "run.json"
        res["run"] = json.loads(run_json.read_text()) if run_json.exists() else {}
        res["stderr"] = stderr
        res["stdout"] = stdout
        return res

    def media(self) -> Path:
        """A toy clip and image set (wick make-clips), made once."""
        if self.clips is None:
            d = self.work / "clips"
            p = subprocess.run([WICK, "make-clips", str(d), "--classes", "2", "--per-class", "8", "--size", "64x48",
                                "--seconds", "1", "--fps", "4", "--no-extras"], capture_output=True, text=True,
                               timeout=120)
            if p.returncode != 0:
                raise RuntimeError(f"wick make-clips exited {p.returncode}: {p.stderr.strip()[-300:]}")
            self.clips = d
        return self.clips


def _values(dtype: str, data: bytes) -> list:
    """A safetensors tensor's elements as Python floats (the standard library alone: a device
    machine's Python has torch but maybe not numpy or safetensors, and none of them reads bf16
    into numpy)."""
    import array
    import struct
    if dtype == "BF16":  # the top half of an fp32
        half = array.array("H", data)
        return list(array.array("f", array.array("I", (h << 16 for h in half)).tobytes()))
    if dtype == "F16":
        return list(struct.unpack(f"<{len(data) // 2}e", data))
    codes = {"F32": "f", "F64": "d", "I64": "q", "I32": "i", "I16": "h", "I8": "b", "U8": "B", "BOOL": "B"}
    return list(array.array(codes[dtype], data))


def load_weights(path: Path) -> dict:
    """name -> (dtype, list of floats): the safetensors format read directly."""
    import struct
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for k, v in head.items():
        if k == "__metadata__":
            continue
        lo, hi = v["data_offsets"]
        out[k] = (v["dtype"], _values(v["dtype"], raw[base + lo:base + hi]))
    return out


def weight_diff(a: Path, b: Path) -> tuple[float, float, set]:
    """(max |a - b|, max over tensors of max |a - b| / max |b|, dtypes) of two weight files with the same names."""
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys(), (sorted(wa), sorted(wb))
    ab = rl = 0.0
    for k in wa:
        x, y = wa[k][1], wb[k][1]
        assert len(x) == len(y), (k, len(x), len(y))
        if not x:
            continue
        d = max(abs(p - q) for p, q in zip(x, y))
        if any(v != v for v in x):  # a NaN (which max would pass over) counts as no agreement at all
            d = float("inf")
        ab = max(ab, d)
        rl = max(rl, d / max(max(abs(q) for q in y), 1e-12))
    return ab, rl, {v[0] for v in wa.values()}


def max_weight_diff(a: Path, b: Path) -> float:
    return weight_diff(a, b)[0]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def first_loss(res) -> float:
    return res["records"][0]["loss"]


# Each check returns (cpu figure, device figure, verdict text, passed) or raises Skip.
def check_fp32(r: Runner):
    cpu, dev = r.runs(dict(device="cpu"), {})
    d = max_weight_diff(dev["weights"], cpu["weights"])
    return f"loss {cpu['final_loss']:.6f}", f"loss {dev['final_loss']:.6f}", f"max |dw| {d:.1e} (< 1e-4)", d < 1e-4


# How much a loss can tell: on this decoder another initialisation (wick.seed 7 or 8 for 3) moves
# the step-1 loss by 5e-3 relative and the final loss by 8e-3, while bf16-true against fp32 on the
# CPU moves them by 1e-5 and 1e-3. A final-loss tolerance of 5e-2 alone would pass a different
# model; the step-1 loss (the same weights through one forward) held to 5e-4 would not.
STEP1_TOL = 5e-4


def check_precision(precision, tol, master=False):
    def check(r: Runner):
        extra = {"master": "true"} if master else {}
        args = dict(model="decoder", precision=precision, micro=4, acc=2, **extra)
        cpu, dev = r.runs(dict(device="cpu", **args), args)
        e = rel(dev["final_loss"], cpu["final_loss"])
        e1 = rel(first_loss(dev), first_loss(cpu))
        skipped = f", skipped {dev['skipped']}" if precision.startswith("fp16") else ""
        ok = e < tol and e1 < STEP1_TOL
        note = ""
        if master:  # the fp32 copies exist on both sides
            ok = ok and cpu["master_bytes"] > 0 and dev["master_bytes"] > 0
            note = f", fp32 masters {dev['master_bytes'] / 2**10:.0f} KiB"
        if precision.endswith("-true"):  # the weights stay half precision: the saved file says so
            half = {v[0] for v in load_weights(dev["weights"]).values()}
            ok = ok and half <= {"BF16", "F16"}
            note += f", saved {'/'.join(sorted(half))}"
        return (f"loss {cpu['final_loss']:.4f}", f"loss {dev['final_loss']:.4f}{skipped}{note}",
                f"relative {e:.1e} (< {tol:g}), step 1 {e1:.1e} (< {STEP1_TOL:g})", ok)
    return check


def check_scaler(r: Runner):
    dev = r.run(model="decoder", precision="fp16-mixed", micro=4, acc=2)
    scales = [rec.get("loss_scale") for rec in dev["records"] if rec.get("loss_scale") is not None]
    ok = bool(scales) and all(s > 0 for s in scales)
    return "-", f"scales {scales[0] if scales else '-'}..{scales[-1] if scales else '-'}", \
        "the scale is logged each record", ok


def check_memory_figures(r: Runner):
    dev = r.run()
    rec = dev["records"][-1]
    if r.device == "cpu":
        keys = ("mem_peak_resident", "mem_tensors_peak")
    else:
        keys = ("mem_allocated", "mem_reserved", "mem_peak")
    vals = {k: rec.get(k) for k in keys}
    ok = all(isinstance(v, (int, float)) and v > 0 for v in vals.values())
    if r.device != "cpu":
        ok = ok and vals["mem_peak"] >= vals["mem_allocated"] and vals["mem_reserved"] >= vals["mem_allocated"]
    return "-", ", ".join(f"{k[4:]} {v / 2**20:.1f} MiB" for k, v in vals.items() if v), \
        "all > 0, peak >= allocated <= reserved", ok


def check_empty_cache(r: Runner):
    plain, emptied = r.runs(dict(hidden=512), dict(hidden=512, empty=1))
    key = "mem_reserved" if r.device != "cpu" else "mem_tensors_peak"
    a, b = plain["records"][-1].get(key, 0), emptied["records"][-1].get(key, 0)
    same = plain["final_loss"] == emptied["final_loss"]
    ok = same and (b <= a)
    return f"reserved {a / 2**20:.1f} MiB", f"with empty_cache_every=1: {b / 2**20:.1f} MiB", \
        "no more reserved, same loss", ok


def check_memory_fraction(r: Runner):
    dev = r.run(fraction=0.5)
    ok = "no effect" not in dev["stderr"] if r.device != "cpu" else True
    return "-", f"loss {dev['final_loss']:.6f}", "runs under a 0.5 cap, no 'no effect' note", ok


OOM_ARGS = dict(hidden=256, size=4096, micro=4096, acc=1, steps=2)
OOM_CAP = 12 * 2**20


# LibTorch gives each cuBLAS handle a workspace from the caching allocator, 32 MiB on Hopper and
# Blackwell (8 MiB before): under a cap of a few MiB the first matmul would fail whatever the
# micro-batch. The capped runs (and the plain runs they are measured against) take the smallest
# documented setting, 8 x 16 KiB, so that the cap weighs activations.
SMALL_CUBLAS = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}


def capped(r: Runner, cap: int) -> dict:
    """The arguments (env, fraction) that hold a run under `cap` bytes on this side."""
    if r.device == "cpu":
        return {"env": {"WICK_CPU_MEMORY_LIMIT": str(int(cap))}}
    return {"env": SMALL_CUBLAS, "fraction": f"{cap / cuda_total_memory():.9f}"}


def small_cublas(r: Runner) -> dict:
    return {} if r.device == "cpu" else {"env": SMALL_CUBLAS}


def check_oom_split(r: Runner):
    # activations (micro-batch x hidden) far above the weights: a micro-batch of 4096
    # cannot fit under a 12 MiB cap; split to what fits, same weights as the plain run
    plain, split = r.runs(dict(device="cpu", **OOM_ARGS), dict(**capped(r, OOM_CAP), **OOM_ARGS))
    d = max_weight_diff(split["weights"], plain["weights"])
    ok = split["micro_batch"] < 4096 and d < 1e-4
    return "micro 4096 x 1", f"micro {split['micro_batch']} x {split['accumulate']} under 12 MiB", \
        f"max |dw| {d:.1e} (< 1e-4)", ok


def check_micro_auto(r: Runner):
    # micro_batch = 'auto' probes the largest micro-batch whose forward and backward fit 90% of
    # the memory it may use (the device's times memory_fraction; on the CPU the tensor cap).
    # The cap is set from the plain run's own peak, so that the whole batch cannot fit but half can.
    plain = r.run(hidden=1024, size=4096, micro=4096, acc=1, steps=2, **small_cublas(r))
    rec = plain["records"][-1]
    peak = rec.get("mem_peak" if r.device != "cpu" else "mem_tensors_peak", 0)
    if not peak:
        raise RuntimeError("the plain run logged no peak memory")
    cap = int(peak * 0.85)
    auto = r.run(hidden=1024, size=4096, micro="auto", batch=4096, acc=1, steps=2, **capped(r, cap))
    d = max_weight_diff(auto["weights"], plain["weights"])
    chose = re.findall(r"micro_batch auto: (.*)", auto["stderr"])
    ok = auto["micro_batch"] < 4096 and auto["micro_batch"] * auto["accumulate"] == 4096 and d < 1e-4
    return (f"micro 4096 x 1, peak {peak / 2**20:.1f} MiB",
            f"auto: micro {auto['micro_batch']} x {auto['accumulate']} under {cap / 2**20:.1f} MiB",
            f"micro < 4096, max |dw| {d:.1e} (< 1e-4)" + ("" if ok or not chose else f" [{chose[-1][:120]}]"), ok)


def check_pinned(r: Runner):
    plain, workers = r.runs({}, dict(workers=2))
    d = max_weight_diff(workers["weights"], plain["weights"])
    return "workers 0", "workers 2 (pinned, non-blocking)", f"max |dw| {d:.1e} (= 0)", d == 0


def check_media(kind):
    # the media loader: frames decoded by worker threads, pinned (on a GPU) and copied
    # non-blocking, against the same clips loaded on the training thread
    def check(r: Runner):
        root = r.media() / ("videos" if kind == "video" else "images")
        args = dict(model=kind, root=root, micro=2, acc=2, epochs=2, steps=4)
        plain, workers, cpu = r.runs(args, dict(workers=2, **args), dict(device="cpu", **args))
        d = max_weight_diff(workers["weights"], plain["weights"])
        e1 = rel(first_loss(plain), first_loss(cpu))
        tol = 1e-3 if r.device != "cpu" else 1e-5  # cuDNN may run the patch convolution in TF32
        ok = d <= 1e-6 and e1 < tol and plain["steps"] == 4
        return (f"loss {cpu['final_loss']:.5f}", f"workers 0: {plain['final_loss']:.5f}, workers 2: max |dw| {d:.1e}",
                f"workers 2 vs 0 max |dw| {d:.1e} (<= 1e-6, 0 expected); vs cpu step 1 {e1:.1e} (< {tol:g})", ok)
    return check


def check_qlora(r: Runner):
    args = dict(model="decoder", qlora="true", micro=4)
    cpu, dev = r.runs(dict(device="cpu", **args), args)
    e = rel(dev["final_loss"], cpu["final_loss"])
    return f"loss {cpu['final_loss']:.5f}", f"loss {dev['final_loss']:.5f}", f"relative {e:.1e} (< 1e-3)", e < 1e-3


def check_qlora_bf16(r: Runner):
    # NF4 base weights dequantized to bf16 for each product (qlora's default compute_dtype)
    args = dict(model="decoder", qlora="true", compute="bf16", micro=4)
    cpu, dev = r.runs(dict(device="cpu", **args), args)
    e, e1 = rel(dev["final_loss"], cpu["final_loss"]), rel(first_loss(dev), first_loss(cpu))
    ab, _, _ = weight_diff(dev["weights"], cpu["weights"])
    tol = 2e-2
    return (f"loss {cpu['final_loss']:.5f}", f"loss {dev['final_loss']:.5f}, max |dw| {ab:.1e}",
            f"relative {e:.1e} (< {tol:g}), step 1 {e1:.1e} (< {STEP1_TOL:g})", e < tol and e1 < STEP1_TOL)


def check_offload(r: Runner):
    # the block inputs to pinned host memory and back on a side stream, each block's backward starting the copy back
    # of the block before: the same bits as checkpointing alone. Block inputs of 2 MiB (16 x 64 x 512 fp32), so that a
    # copy that is not waited for, or memory reused under one, shows
    args = dict(model="decoder", width=512, layers=4, micro=16, checkpointing="true")
    kept, moved = r.runs(args, dict(args, offload="true"))
    d = max_weight_diff(moved["weights"], kept["weights"])
    off = moved["run"].get("memory", {}).get("offloaded", 0)
    return ("checkpointing", f"+ offload ({off / 2**10:.0f} KiB on the host)", f"max |dw| {d:.1e} (= 0), offloaded > 0",
            d == 0 and off > 0)


def check_offload_embeddings(r: Runner):
    # the decoder's frozen input embedding kept in host memory (QLoRA, bf16 autocast): each lookup on the host, the
    # rows copied to the device from pinned memory on its stream; the same bits as the table on the device, and its
    # bytes out of the device's weights. Then in a launched group of one (NCCL on a GPU), whose start broadcasts the
    # host table through the device in pieces
    args = dict(model="decoder", qlora="true", compute="bf16", precision="bf16-mixed", micro=4)
    backend = "gloo" if r.device == "cpu" else "nccl"
    kept, host, one = r.runs(args, dict(args, host_table="true"),
                             dict(args, host_table="true", launch=1, device=r.device, env={"WICK_DIST_BACKEND": backend}))
    d, d1 = max_weight_diff(host["weights"], kept["weights"]), max_weight_diff(one["weights"], kept["weights"])
    mem_kept, mem_host = kept["run"].get("memory", {}), host["run"].get("memory", {})
    table = mem_host.get("host_weights", 0)
    moved = mem_kept.get("weights", 0) - mem_host.get("weights", 0)
    return ("table on the device", f"in host memory ({table / 2**10:.0f} KiB; weights -{moved / 2**10:.0f} KiB); "
            f"{backend} group of one", f"max |dw| {d:.1e} (= 0), {d1:.1e} (< 1e-6)",
            d == 0 and d1 < 1e-6 and table > 0 and moved == table)


def check_checkpointing(r: Runner):
    # every decoder block recomputed in backward against no checkpointing, both on the device
    plain, ck = r.runs(dict(model="decoder", micro=4), dict(model="decoder", micro=4, checkpointing="true"))
    d = max_weight_diff(ck["weights"], plain["weights"])
    act = (plain["run"].get("memory", {}).get("activations", 0), ck["run"].get("memory", {}).get("activations", 0))
    return ("no checkpointing", f"checkpointing (activations {act[0] / 2**10:.0f} -> {act[1] / 2**10:.0f} KiB)",
            f"max |dw| {d:.1e} (< 1e-5)", d < 1e-5)


def check_profile(r: Runner):
    # PyTorch's profiler through CUPTI: the device's kernels in the trace and
    # the summary, and a profiled run ends at the unprofiled run's weights
    args = dict(model="decoder", precision="bf16-mixed", micro=4, acc=2)
    plain, prof = r.runs(args, dict(args, profile="true"))
    d = max_weight_diff(prof["weights"], plain["weights"])
    summary = prof["run"].get("profile", {})
    trace = json.loads((prof["out"] / "profile.json").read_text())
    cats = {e.get("cat") for e in trace.get("traceEvents", []) if isinstance(e, dict)}
    # the host's scopes (on a GPU Kineto adds a gpu_user_annotation copy of each scope that launched work)
    steps = sum(1 for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("name") == "wick::step"
                and e.get("cat") == "user_annotation")
    ok = d == 0 and summary.get("steps") == 3 and steps == 3 and bool(summary.get("host_ops"))
    if r.device == "cpu":
        seen = f"{len(summary.get('host_ops', []))} host operators"
    else:
        kernels = summary.get("device_ops", [])
        ok = ok and "kernel" in cats and bool(kernels) and summary.get("device_ms_per_step", 0) > 0
        seen = (f"{summary.get('device_ms_per_step', 0):.2f} ms of device work a step, top "
                f"{kernels[0]['name'][:40] if kernels else '-'}")
    return (f"loss {plain['final_loss']:.4f}", f"steps 2-4 profiled: {seen}",
            f"max |dw| {d:.1e} (= 0), 3 wick::step in the trace" + (", kernel events" if r.device != "cpu" else ""), ok)


def check_pack_attention(r: Runner):
    # documents packed apart (position_ids and a per-document mask through scaled-dot-product attention) on the
    # device against the CPU, in fp32 as check_fp32
    args = dict(model="decoder", micro=4, docs=6, pack_attention="document")
    cpu, dev = r.runs(dict(device="cpu", **args), args)
    d = max_weight_diff(dev["weights"], cpu["weights"])
    return f"loss {cpu['final_loss']:.6f}", f"loss {dev['final_loss']:.6f}", f"max |dw| {d:.1e} (< 1e-4)", d < 1e-4


def check_chunked_ce(r: Runner):
    # decoder_lm's loss_chunk: head and cross-entropy over 32 tokens at a time (8 chunks a
    # micro-batch of 4 x 64), against the whole logits at once (loss_chunk = 0), on the device;
    # and the chunked run on the device against the CPU's
    whole, chunked, cpu = r.runs(dict(model="decoder", micro=4, loss_chunk=0), dict(model="decoder", micro=4, loss_chunk=32),
                                 dict(device="cpu", model="decoder", micro=4, loss_chunk=32))
    d = max_weight_diff(chunked["weights"], whole["weights"])
    e, e1 = rel(chunked["final_loss"], cpu["final_loss"]), rel(first_loss(chunked), first_loss(cpu))
    ok = d < 1e-4 and e < 1e-4 and e1 < 1e-5
    return (f"chunked loss {cpu['final_loss']:.6f}", f"chunked {chunked['final_loss']:.6f}, whole {whole['final_loss']:.6f}",
            f"chunked vs whole max |dw| {d:.1e} (< 1e-4); vs cpu relative {e:.1e} (< 1e-4), step 1 {e1:.1e} (< 1e-5)", ok)


def check_adamw8bit(r: Runner):
    # min_8bit_size 1024: the 2048- and 4096-element weights of the 32-64-64-4 MLP get 8-bit
    # blockwise moments (the default 4096 would leave the first one fp32)
    args = dict(optim="adamw8bit", min8=1024)
    cpu, dev, fp32 = r.runs(dict(device="cpu", **args), args, {})  # adamw: what the 8-bit state weighs against
    d = max_weight_diff(dev["weights"], cpu["weights"])
    e = rel(dev["final_loss"], cpu["final_loss"])
    small = dev["optimizer_bytes"] < fp32["optimizer_bytes"] / 2
    # a moment one code apart (CPU and GPU gradients differ in the last bits) moves an element by a
    # few percent of lr per step; half an lr (5e-4) is what a wrong code or absmax would exceed
    ok = d < 5e-4 and e < 1e-4 and small
    return (f"loss {cpu['final_loss']:.6f}",
            f"loss {dev['final_loss']:.6f}, state {dev['optimizer_bytes'] / 2**10:.1f} KiB (adamw "
            f"{fp32['optimizer_bytes'] / 2**10:.1f})",
            f"max |dw| {d:.1e} (< 5e-4), loss relative {e:.1e} (< 1e-4), state < half of adamw's", ok)


def check_ema_clip_eval(r: Runner):
    # clip_grad_norm (the global norm of the whole gradient, on the device), the fp32 moving average
    # of the weights beside them (ema), and an evaluation pass with both weight sets, against the CPU
    args = dict(clip=0.05, ema=0.9, eval="true")
    cpu, dev = r.runs(dict(device="cpu", **args), args)
    d = max_weight_diff(dev["weights"], cpu["weights"])
    de = max_weight_diff(dev["out"] / "ema.safetensors", cpu["out"] / "ema.safetensors")
    e = rel(dev["eval_loss"], cpu["eval_loss"])
    ee = rel(dev["eval_ema_loss"], cpu["eval_ema_loss"])
    def norms(res):
        return [x["grad_norm"] for x in res["records"] if "grad_norm" in x]
    pairs = list(zip(norms(dev), norms(cpu)))
    en = max(rel(x, y) for x, y in pairs) if len(pairs) == 8 else float("inf")
    ok = d < 1e-4 and de < 1e-4 and e < 1e-5 and ee < 1e-5 and en < 1e-4 and cpu["eval_loss"] > 0
    return (f"eval {cpu['eval_loss']:.6f}, ema {cpu['eval_ema_loss']:.6f}",
            f"eval {dev['eval_loss']:.6f}, ema {dev['eval_ema_loss']:.6f}",
            f"max |dw| {d:.1e}, ema {de:.1e} (< 1e-4); eval loss {e:.1e}, ema {ee:.1e} (< 1e-5); grad norms {en:.1e} "
            "(< 1e-4)", ok)


def check_resume(r: Runner):
    # 4 steps, a checkpoint (weights, optimizer state and RNG states leave the device), then resume
    # to step 8 in the same folder: the unbroken 8-step run's weights
    unbroken = r.run()
    first = r.run(steps=4, out=r.work / "resume")
    second = r.run(steps=8, resume="true", out=r.work / "resume")
    d = max_weight_diff(second["weights"], unbroken["weights"])
    ok = d == 0 and first["steps"] == 4 and second["run"].get("start_step") == 4
    return ("unbroken 8 steps", f"4 steps + resume to {second['steps']} (from {second['run'].get('start_step')})",
            f"max |dw| {d:.1e} (= 0)", ok)


def launch_device(r: Runner) -> str:
    # several ranks on CUDA: rank r on cuda:LOCAL_RANK (modulo the GPUs seen); on the CPU, gloo
    return "auto" if r.device != "cpu" else "cpu"


def check_shard(shard):
    # 2 ranks on the one GPU: NCCL refuses ranks sharing a device, so they run
    # on gloo with CUDA tensors (WICK_DIST_BACKEND=gloo: each collective on host
    # copies); with 2 GPUs or more, NCCL as wick picks it
    def check(r: Runner):
        env = {}
        backend = "gloo"
        if r.device != "cpu":
            backend = "nccl" if gpu_count() >= 2 else "gloo"
            env = {"WICK_DIST_BACKEND": backend}
        two = r.run(launch=2, device=launch_device(r), micro=8, acc=2, shard=shard, env=env)
        one = r.run(micro=8, acc=4)
        d = max_weight_diff(two["weights"], one["weights"])
        where = "the CPU" if r.device == "cpu" else ("one GPU" if backend == "gloo" else "two GPUs")
        return ("1 rank, acc 4", f"2 ranks on {where} ({backend}, shard {shard}), acc 2, optimizer state on rank 0 "
                f"{two['optimizer_bytes'] / 2**10:.1f} KiB of {one['optimizer_bytes'] / 2**10:.1f}", f"max |dw| {d:.1e} (< 1e-4)",
                d < 1e-4 and (shard == "none" or two["optimizer_bytes"] < one["optimizer_bytes"]))
    return check


def check_deferred(r: Runner):
    # a decoder built deferred (no weight bytes until the trainer divides it)
    # on 2 ranks under shard = "parameters": each rank makes its chunks on the
    # CPU and moves them to the device (move_hollow, GradReducer::fill); the
    # weights equal the whole build's run, plain, QLoRA over NF4 layers, and
    # QLoRA over float layers (each quantized as its values are made)
    env = {"WICK_DIST_BACKEND": "gloo" if r.device == "cpu" or gpu_count() < 2 else "nccl"}
    common = dict(launch=2, device=launch_device(r), model="decoder", micro=4, acc=1, steps=4, shard="parameters",
                  env=env)
    runs = r.runs(dict(common, deferred="true"), dict(common, deferred="false"),
                  dict(common, deferred="true", nf4="true", qlora="true"),
                  dict(common, deferred="false", nf4="true", qlora="true"),
                  dict(common, deferred="true", qlora="true"), dict(common, deferred="false", qlora="true"))
    plain = max_weight_diff(runs[0]["weights"], runs[1]["weights"])
    qlora = max_weight_diff(runs[2]["weights"], runs[3]["weights"])
    after = max_weight_diff(runs[4]["weights"], runs[5]["weights"])
    return ("2 ranks, whole build",
            f"2 ranks ({env['WICK_DIST_BACKEND']}), built deferred: plain, QLoRA, QLoRA over float layers",
            f"max |dw| {plain:.1e}, {qlora:.1e}, {after:.1e} (< 1e-5)", max(plain, qlora, after) < 1e-5)


def check_one_rank_launch(r: Runner):
    # WICK_DIST_BACKEND names a backend, so one launched rank joins a group of
    # one: NCCL's init and its all-reduce, reduce-scatter (shard = "gradients")
    # and all-gather run on the one GPU, to the plain run's weights
    backend = "gloo" if r.device == "cpu" else "nccl"
    env = {"WICK_DIST_BACKEND": backend}
    plain = r.run(micro=8, acc=4)
    rows = []
    worst, ok = 0.0, True
    for shard in ("none", "gradients"):
        one = r.run(launch=1, device=r.device, micro=8, acc=4, shard=shard, env=env)
        d = max_weight_diff(one["weights"], plain["weights"])
        worst = max(worst, d)
        rows.append(f"shard {one['shard']}: {one['collectives']} collectives")
        ok = ok and one["collectives"] > 0 and one["shard"] == shard
    return ("plain run", f"launch --nproc-per-node 1, {backend} group of one (" + "; ".join(rows) + ")",
            f"max |dw| {worst:.1e} (< 1e-6), collectives > 0", ok and worst < 1e-6)


def check_ranks(r: Runner):
    if r.device == "cpu":
        raise Skip("NCCL needs 2 GPUs (the shard rows run 2 gloo ranks on the CPU)")
    if gpu_count() < 2:
        raise Skip(f"{gpu_count()} GPU(s), 2 needed")
    one, two = r.runs(dict(micro=8, acc=4), dict(launch=2, device="auto", micro=8, acc=2))
    d = max_weight_diff(two["weights"], one["weights"])
    return "1 rank, acc 4", "2 ranks (NCCL), acc 2", f"max |dw| {d:.1e} (< 1e-4)", d < 1e-4


CHECKS = {
    "fp32": check_fp32,
    "bf16-mixed": check_precision("bf16-mixed", 5e-2),
    "fp16-mixed": check_precision("fp16-mixed", 5e-2),
    "loss scaler": check_scaler,
    "memory figures": check_memory_figures,
    "empty_cache_every": check_empty_cache,
    "memory_fraction": check_memory_fraction,
    "out-of-memory split": check_oom_split,
    "pinned copies": check_pinned,
    "qlora": check_qlora,
    "offload_activations": check_offload,
    "offload_embeddings": check_offload_embeddings,
    "2 ranks": check_ranks,
    "bf16-true": check_precision("bf16-true", 5e-2),
    "bf16-true + master_weights": check_precision("bf16-true", 5e-2, master=True),
    "fp16-true + master_weights": check_precision("fp16-true", 5e-2, master=True),
    "checkpointing": check_checkpointing,
    "chunked cross-entropy": check_chunked_ce,
    "pack_attention document": check_pack_attention,
    "qlora bf16": check_qlora_bf16,
    "adamw8bit": check_adamw8bit,
    "micro_batch auto": check_micro_auto,
    "media workers (video)": check_media("video"),
    "media workers (images)": check_media("image"),
    "shard optimizer": check_shard("optimizer"),
    "shard gradients": check_shard("gradients"),
    "shard parameters": check_shard("parameters"),
    "deferred (shard parameters)": check_deferred,
    "1 rank (NCCL group of one)": check_one_rank_launch,
    "clip + ema + eval": check_ema_clip_eval,
    "profile": check_profile,
    "resume": check_resume,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--self-test", action="store_true", help="run every check with the CPU in place of CUDA")
    ap.add_argument("--only", nargs="*", help="run only these checks")
    ap.add_argument("--json", metavar="PATH", help="also write the rows (and the device) to this JSON file")
    ap.add_argument("--device-info", action="store_true", help="print the device block and exit")
    ap.add_argument("--list", action="store_true", help="list the checks and exit")
    args = ap.parse_args()
    if args.list:
        print("\n".join(CHECKS))
        return 0
    unknown = [n for n in args.only or [] if n not in CHECKS]
    if unknown:
        print(f"unknown check(s): {', '.join(unknown)} (known: {', '.join(CHECKS)})", file=sys.stderr)
        return 2
    usable, why = cuda_usable()
    info = device_info() if usable or args.device_info else {}
    if info:
        width = max(len(k) for k in info)
        for k, v in info.items():
            print(f"{k.ljust(width)}  {v}")
        print()
    if args.device_info:
        return 0
    if not usable and not args.self_test:
        print(f"SKIP gpu-check: no usable CUDA device ({why}); nothing checked")
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": why, "rows": []}, indent=1) + "\n")
        return 0
    device = "cuda" if usable and not args.self_test else "cpu"
    names = args.only or list(CHECKS)
    rows, failed, skipped = [], 0, 0
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="wick-gpu-check-") as tmp, ThreadPoolExecutor(PARALLEL) as ahead:
        r = Runner(Path(tmp), device, {})
        # every check's first runs, started ahead in the checks' order (a failure there is the
        # check's to report, when it asks for the same run)
        for name in names:
            planner = Planner(r)
            try:
                CHECKS[name](planner)
            except Exception:  # noqa: BLE001 -- _Planned, Skip, or what the check will meet again
                pass
            for spec in planner.specs:
                ahead.submit(r.run, **spec)
        for name in names:
            t, tail = time.time(), ""
            try:
                cpu, dev, verdict, ok = CHECKS[name](r)
                status = "ok" if ok else "FAIL"
            except Skip as e:
                cpu, dev, verdict, ok, status = "-", "-", str(e), None, "SKIP"
                tail = getattr(e, "stderr", "")[-3000:]
            except Exception as e:  # a check that cannot run is a failure, said in its row
                cpu, dev, verdict, ok, status = "-", "-", f"error: {e}", False, "FAIL"
                tail = getattr(e, "stderr", "")[-3000:]
                if tail:
                    print(f"  {name}: wick's stderr ends:\n" + "\n".join("    " + l for l in tail.splitlines()[-15:]),
                          file=sys.stderr, flush=True)
            failed += ok is False
            skipped += ok is None
            secs = time.time() - t
            rows.append({"name": name, "cpu": cpu, "device": dev, "verdict": verdict, "ok": ok, "status": status,
                         "seconds": round(secs, 2)})
            if tail:
                rows[-1]["stderr_tail"] = tail
            print(f"  {name}: {status}: {verdict} [{secs:.0f} s]", file=sys.stderr, flush=True)
    total = time.time() - start
    head = ("check", "cpu", device + (" (self-test)" if args.self_test else ""), "result")
    table = [(x["name"], x["cpu"], x["device"], f"{x['status']}: {x['verdict']} [{x['seconds']:.0f} s]") for x in rows]
    widths = [max(len(str(row[i])) for row in table + [head]) for i in range(4)]
    for row in [head] + table:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    passed = len(rows) - failed - skipped
    print(f"{passed} of {len(rows) - skipped} checks passed" + (f", {failed} FAILED" if failed else "") +
          (f", {skipped} skipped" if skipped else "") + f" ({total:.0f} s, {r.n} wick runs)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "self_test": args.self_test, "info": info,
                                               "seconds": round(total, 2), "wick_runs": r.n, "rows": rows,
                                               "runs": [{**x, "args": {k: str(v) for k, v in x["args"].items()}}
                                                        for x in r.log]},
                                              indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
