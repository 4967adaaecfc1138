"""wick's CUDA paths against its CPU results, as a table (scripts/gpu-check).

Every check trains the same small recipe twice, once on the CPU and once on
CUDA (or, with --self-test, twice on the CPU: the check's own logic exercised
where no GPU is), and compares what the two runs give: final loss, weights,
the memory figures, the number of out-of-memory splits. Without a usable
CUDA device it says so and exits 0, so the suite stays green on CPU machines
(the ctest that runs it carries the label `cuda` and prints a SKIP line).

  python3 tests/gpu/gpu_check.py [--self-test] [--only NAME ...]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WICK = os.environ.get("WICK", str(REPO / "build" / "bin" / "wick"))

RECIPE = r"""
local wick = require "wick"
local a = wick.args
local model, data
if a.model == "decoder" then
  local f = assert(io.open(a.text, "w"))
  for i = 1, 48 do f:write(string.format("line %d of a small text, repeated so that a decoder can learn it. ", i % 7)) end
  f:close()
  data = wick.data("text", { files = { a.text }, max_length = 64, pack = true })
  wick.seed(3)
  model = wick.model("decoder_lm", { vocab_size = data.vocab_size, hidden_size = 64, intermediate_size = 128,
                                     layers = 2, heads = 4, kv_heads = 2 })
  if tostring(a.qlora) == "true" then wick.optim("qlora", { r = 4, alpha = 8, compute_dtype = "fp32" }):apply(model) end
else
  data = wick.data("synthetic", { size = tonumber(a.size) or 256, inputs = 32, classes = 4, seed = 2 })
  wick.seed(3)
  model = wick.model("mlp", { inputs = 32, hidden = { tonumber(a.hidden) or 64, tonumber(a.hidden) or 64 }, outputs = 4 })
end
local run = wick.train {
  model = model, data = data, optim = wick.optim("adamw", { lr = 1e-3 }), device = a.device,
  micro_batch = tonumber(a.micro) or 16, accumulate = tonumber(a.acc) or 2, epochs = 1, max_steps = tonumber(a.steps) or 8,
  precision = a.precision or "fp32", workers = tonumber(a.workers) or 0, seed = 4, quiet = true, out = a.out,
  memory_fraction = tonumber(a.fraction) or 0, empty_cache_every = tonumber(a.empty) or 0, overwrite = true,
  checkpointing = tostring(a.checkpointing) == "true", offload_activations = tostring(a.offload) == "true",
}
model:save(a.weights)
local f = assert(io.open(a.result, "w"))
f:write(string.format('{"final_loss": %.9g, "steps": %d, "micro_batch": %d, "accumulate": %d, "skipped": %d}\n',
  run.final_loss, run.steps, run.micro_batch or 0, run.accumulate or 0, run.skipped_steps or 0))
f:close()
"""


def cuda_usable() -> tuple[bool, str]:
    p = subprocess.run([WICK, "version"], capture_output=True, text=True)
    m = re.search(r"cuda_usable\s+(.*)", p.stdout)
    line = m.group(1).strip() if m else "unknown"
    return line.startswith("yes"), line


def gpu_count() -> int:
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        return len([l for l in p.stdout.splitlines() if l.startswith("GPU ")])
    except FileNotFoundError:
        return 0


class Runner:
    def __init__(self, work: Path, device: str, env: dict):
        self.work, self.device, self.env = work, device, env
        (work / "recipe.lua").write_text(RECIPE)
        self.n = 0

    def run(self, device=None, launch=0, env=None, **args):
        self.n += 1
        d = self.work / f"run{self.n}"
        d.mkdir()
        args = {"device": device or self.device, "out": d / "out", "weights": d / "w.safetensors",
                "result": d / "result.json", "text": d / "text.txt", **args}
        cmd = [WICK, "run", str(self.work / "recipe.lua")] + [f"{k}={v}" for k, v in args.items()]
        if launch:
            cmd = [WICK, "launch", "--nproc-per-node", str(launch)] + cmd[2:]
        full_env = {**os.environ, **self.env, **(env or {})}
        t = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"wick exited {p.returncode}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}")
        res = json.loads((d / "result.json").read_text())
        res["seconds"] = time.time() - t
        res["weights"] = d / "w.safetensors"
        metrics = [json.loads(l) for l in (d / "out" / "metrics.jsonl").read_text().splitlines() if l.strip()]
        res["records"] = [r for r in metrics if "step" in r]
        run_json = d / "out" / "run.json"
        res["run"] = json.loads(run_json.read_text()) if run_json.exists() else {}
        res["stderr"] = p.stderr
        return res


def max_weight_diff(a: Path, b: Path) -> float:
    from safetensors.numpy import load_file
    import numpy as np
    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys(), (sorted(wa), sorted(wb))
    return max(float(np.max(np.abs(wa[k].astype("float64") - wb[k].astype("float64")))) for k in wa)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# Each check returns (cpu figure, device figure, verdict text, passed).
def check_fp32(r: Runner):
    cpu, dev = r.run(device="cpu"), r.run()
    d = max_weight_diff(dev["weights"], cpu["weights"])
    return f"loss {cpu['final_loss']:.6f}", f"loss {dev['final_loss']:.6f}", f"max |dw| {d:.1e} (< 1e-4)", d < 1e-4


def check_precision(precision, tol):
    def check(r: Runner):
        cpu, dev = r.run(device="cpu", model="decoder", precision=precision, micro=4, acc=2), \
            r.run(model="decoder", precision=precision, micro=4, acc=2)
        e = rel(dev["final_loss"], cpu["final_loss"])
        skipped = f", skipped {dev['skipped']}" if precision.startswith("fp16") else ""
        return (f"loss {cpu['final_loss']:.4f}", f"loss {dev['final_loss']:.4f}{skipped}",
                f"relative {e:.1e} (< {tol:g})", e < tol)
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
    plain, emptied = r.run(hidden=512), r.run(hidden=512, empty=1)
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


def check_oom_split(r: Runner):
    # activations (micro-batch x hidden) far above the weights: a micro-batch of 4096
    # cannot fit under a 12 MiB cap; split to what fits, same weights as the plain run
    args = dict(hidden=256, size=4096, micro=4096, acc=1, steps=2)
    cap = 12 * 2**20
    plain = r.run(device="cpu", **args)
    if r.device == "cpu":
        split = r.run(env={"WICK_CPU_MEMORY_LIMIT": str(cap)}, **args)
    else:
        import torch
        total = torch.cuda.get_device_properties(0).total_memory
        split = r.run(fraction=f"{cap / total:.9f}", **args)
    d = max_weight_diff(split["weights"], plain["weights"])
    ok = split["micro_batch"] < 4096 and d < 1e-4
    return "micro 4096 x 1", f"micro {split['micro_batch']} x {split['accumulate']} under 12 MiB", \
        f"max |dw| {d:.1e} (< 1e-4)", ok


def check_pinned(r: Runner):
    plain, workers = r.run(), r.run(workers=2)
    d = max_weight_diff(workers["weights"], plain["weights"])
    return "workers 0", "workers 2 (pinned, non-blocking)", f"max |dw| {d:.1e} (= 0)", d == 0


def check_qlora(r: Runner):
    cpu, dev = r.run(device="cpu", model="decoder", qlora="true", micro=4), r.run(model="decoder", qlora="true", micro=4)
    e = rel(dev["final_loss"], cpu["final_loss"])
    return f"loss {cpu['final_loss']:.5f}", f"loss {dev['final_loss']:.5f}", f"relative {e:.1e} (< 1e-3)", e < 1e-3


def check_offload(r: Runner):
    # the block inputs to pinned host memory and back: the same bits as checkpointing alone
    kept = r.run(model="decoder", micro=4, checkpointing="true")
    moved = r.run(model="decoder", micro=4, checkpointing="true", offload="true")
    d = max_weight_diff(moved["weights"], kept["weights"])
    off = moved["run"].get("memory", {}).get("offloaded", 0)
    return ("checkpointing", f"+ offload ({off / 2**10:.0f} KiB on the host)", f"max |dw| {d:.1e} (= 0), offloaded > 0",
            d == 0 and off > 0)


def check_ranks(r: Runner):
    one = r.run(micro=8, acc=4)
    two = r.run(launch=2, micro=8, acc=2)
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
    "2 ranks": check_ranks,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--self-test", action="store_true", help="run every check with the CPU in place of CUDA")
    ap.add_argument("--only", nargs="*", help="run only these checks")
    args = ap.parse_args()
    usable, why = cuda_usable()
    if not usable and not args.self_test:
        print(f"SKIP gpu-check: no usable CUDA device ({why}); nothing checked")
        return 0
    device = "cuda" if usable and not args.self_test else "cpu"
    env = {}
    names = args.only or list(CHECKS)
    rows, failed = [], 0
    with tempfile.TemporaryDirectory(prefix="wick-gpu-check-") as tmp:
        r = Runner(Path(tmp), device, env)
        for name in names:
            if name == "2 ranks" and device == "cuda" and gpu_count() < 2:
                rows.append((name, "-", "-", f"SKIP: {gpu_count()} GPU(s), 2 needed"))
                continue
            if name == "2 ranks" and device == "cpu":
                rows.append((name, "-", "-", "SKIP: NCCL needs 2 GPUs (gloo is the suite's distributed test)"))
                continue
            t = time.time()
            try:
                cpu, dev, verdict, ok = CHECKS[name](r)
            except Exception as e:  # a check that cannot run is a failure, said in its row
                cpu, dev, verdict, ok = "-", "-", f"error: {e}", False
            failed += not ok
            rows.append((name, cpu, dev, f"{'ok' if ok else 'FAIL'}: {verdict} [{time.time() - t:.0f} s]"))
            print(f"  {name}: {rows[-1][3]}", file=sys.stderr, flush=True)
    head = ("check", "cpu", device + (" (self-test)" if args.self_test else ""), "result")
    widths = [max(len(str(row[i])) for row in rows + [head]) for i in range(4)]
    for row in [head] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"{len(rows) - failed} of {len(rows)} checks passed" + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
