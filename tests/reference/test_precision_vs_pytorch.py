"""Mixed precision against PyTorch on the same weights and data: bf16-mixed is
torch.autocast's bf16; fp16-mixed is torch.autocast's fp16 with
torch.amp.GradScaler, so the sequence of loss scales and skipped steps, with
overflows injected at chosen steps, is GradScaler's, and the weights end where
PyTorch's do. Gradients are unscaled before clip_grad_value_ and clip_grad_norm_."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

RECIPE = """
local wick = require "wick"
local a = wick.args
local data = wick.data("tensors", { file = a.data })
local model = wick.model("mlp", { inputs = 6, hidden = { 10 }, outputs = 3, activation = "relu" })
model:load(a.init)
local run = wick.train {
  model = model, data = data, optim = wick.optim("adamw", { lr = 0.01 }),
  micro_batch = a.micro, accumulate = a.acc, epochs = 1, shuffle = false, quiet = true, out = a.out,
  precision = a.precision, loss_scale = { init = 1024, growth = 2, backoff = 0.5, interval = 3 },
  clip_grad_value = a.clip_value, clip_grad_norm = a.clip_norm,
}
model:save(a.result)
print(string.format("skipped %d", run.skipped_steps))
"""

STEPS, BATCH = 14, 8
POISON = (3, 4, 9)  # steps whose scaled gradients overflow fp16


def model():
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))


def reference(init, x, y, precision, clip_value, clip_norm):
    m = model()
    m.load_state_dict(init)
    params = list(m.parameters())
    opt = torch.optim.AdamW(params, lr=0.01, foreach=False)
    fp16 = precision == "fp16-mixed"
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=3, enabled=fp16)
    dtype = torch.float16 if fp16 else torch.bfloat16
    scales, skipped = [], []
    for i in range(0, len(x), BATCH):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            out = m(x[i:i + BATCH])
        loss = torch.nn.functional.cross_entropy(out.float(), y[i:i + BATCH])
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if clip_value:
            torch.nn.utils.clip_grad_value_(params, clip_value)
        if clip_norm:
            torch.nn.utils.clip_grad_norm_(params, clip_norm)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if fp16:
            scales.append(before)
            skipped.append(scaler.get_scale() < before)  # GradScaler backs off exactly when it skipped
    return {k: v.detach() for k, v in m.state_dict().items()}, scales, skipped


# micro 8: the reference's own batches, the same arithmetic; micro 4 x 2: the
# weight gradients of each half are rounded to bf16/fp16 before they are
# summed, so the match is looser (the scales and skips are still exact).
@pytest.mark.parametrize("precision,clip_value,clip_norm,micro,rtol", [
    ("fp16-mixed", 0, 0, 8, 2e-4),
    ("fp16-mixed", 0.05, 0.5, 8, 2e-4),
    ("fp16-mixed", 0.05, 0.5, 4, 5e-3),
    ("bf16-mixed", 0, 0, 8, 2e-4),
    ("bf16-mixed", 0.05, 0.5, 8, 2e-4),
    ("bf16-mixed", 0, 0, 4, 3e-2),
])
def test_mixed_precision_matches_autocast_and_gradscaler(tmp_path, run_wick, precision, clip_value, clip_norm, micro,
                                                         rtol):
    torch.manual_seed(3)
    init = {k: v.detach().clone() for k, v in model().state_dict().items()}
    save_file(init, tmp_path / "init.safetensors")
    x = torch.randn(STEPS * BATCH, 6)
    y = torch.randint(0, 3, (STEPS * BATCH,))
    if precision == "fp16-mixed":
        for s in POISON:  # one sample 3000x larger: its scaled gradient overflows fp16
            x[s * BATCH + 1] *= 3000.0
    save_file({"x": x, "y": y}, tmp_path / "data.safetensors")
    (tmp_path / "recipe.lua").write_text(RECIPE)
    out = tmp_path / "run"
    p = run_wick("run", tmp_path / "recipe.lua", f"data={tmp_path / 'data.safetensors'}",
                 f"init={tmp_path / 'init.safetensors'}", f"result={tmp_path / 'wick.safetensors'}",
                 f"precision={precision}", f"out={out}", f"micro={micro}", f"acc={BATCH // micro}", f"clip_value={clip_value}", f"clip_norm={clip_norm}")
    want, scales, skipped = reference(init, x, y, precision, clip_value, clip_norm)
    steps = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if "eval" not in l]
    assert len(steps) == STEPS
    if precision == "fp16-mixed":
        assert [s["loss_scale"] for s in steps] == scales
        assert [bool(s.get("skipped")) for s in steps] == skipped
        assert [i for i, s in enumerate(skipped) if s] == list(POISON)  # the injected overflows, and only they
        assert f"skipped {len(POISON)}" in p.stdout
    else:
        assert all("loss_scale" not in s and not s.get("skipped") for s in steps)
    got = load_file(tmp_path / "wick.safetensors")
    for k in want:
        assert got[k].dtype == torch.float32, "master weights stay fp32"
        assert not torch.allclose(want[k], init[k], atol=1e-3), k
        err = ((got[k] - want[k]).abs().max() / want[k].abs().max()).item()
        assert err < rtol, f"{k}: relative difference {err}"
