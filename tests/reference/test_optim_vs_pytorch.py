"""wick's sgd and adamw, with a cosine schedule and gradient accumulation, end at
the weights PyTorch's own optimizers reach from the same weights on the same data."""
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

RECIPE = """
local wick = require "wick"
local a = wick.args
local data = wick.data("tensors", { file = a.data })
local model = wick.model("mlp", { inputs = 6, hidden = { 10, 7 }, outputs = 3, activation = "tanh" })
model:load(a.init)
local opts = wick.core.json_decode(a.optim_opts)
local run = wick.train {
  model = model, data = data, optim = wick.optim(a.optim, opts),
  schedule = wick.schedule(a.schedule, { warmup_steps = 3, min_lr_ratio = 0.1 }),
  micro_batch = a.micro_batch, accumulate = a.accumulate, epochs = a.epochs,
  shuffle = false, clip_grad_norm = a.clip, quiet = true,
}
model:save(a.result)
"""


def schedule(kind, warmup, total, min_ratio):
    """The get_{constant,linear,cosine}_schedule_with_warmup formulas, with a floor."""

    def f(step):
        if step < warmup:
            return step / max(1, warmup)
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            decay = max(0.0, 1.0 - progress)
        else:
            decay = max(0.0, 0.5 * (1 + math.cos(math.pi * progress)))
        return min_ratio + (1 - min_ratio) * decay

    return f


def reference(init, x, y, optim_name, opts, batch, epochs, clip, sched_kind):
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)
    )
    model.load_state_dict(init)
    params = list(model.parameters())
    if optim_name == "sgd":
        opt = torch.optim.SGD(params, foreach=False, **opts)
    else:
        o = dict(opts)
        if "betas" in o:
            o["betas"] = tuple(o["betas"])
        opt = torch.optim.AdamW(params, foreach=False, **o)
    steps = epochs * math.ceil(len(x) / batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(sched_kind, 3, steps, 0.1))
    for _ in range(epochs):
        for i in range(0, len(x), batch):  # the last batch is short: it steps with its true size
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[i : i + batch]), y[i : i + batch])
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            sched.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


CASES = [
    ("sgd", {"lr": 0.2}, 0, "cosine"),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}, 0, "cosine"),
    ("sgd", {"lr": 0.1, "momentum": 0.8, "dampening": 0.3}, 0.5, "linear"),
    ("adamw", {"lr": 0.01}, 0, "cosine"),
    ("adamw", {"lr": 0.02, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1, "amsgrad": True}, 0.3, "cosine"),
    ("adamw", {"lr": 0.01, "weight_decay": 0.0}, 0, "constant"),
    ("adamw", {"lr": 0.01}, 1.0, "linear"),
]


@pytest.mark.parametrize("optim_name,opts,clip,sched_kind", CASES)
def test_final_weights_match_pytorch(tmp_path, run_wick, optim_name, opts, clip, sched_kind):
    import json

    torch.manual_seed(1)
    init_model = torch.nn.Sequential(
        torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)
    )
    init = {k: v.detach().clone() for k, v in init_model.state_dict().items()}
    save_file(init, tmp_path / "init.safetensors")
    x = torch.randn(37, 6)
    y = torch.randint(0, 3, (37,))
    save_file({"x": x, "y": y}, tmp_path / "data.safetensors")
    (tmp_path / "recipe.lua").write_text(RECIPE)
    micro, accumulate, epochs = 2, 4, 3
    run_wick(
        "run", tmp_path / "recipe.lua",
        f"data={tmp_path / 'data.safetensors'}", f"init={tmp_path / 'init.safetensors'}",
        f"result={tmp_path / 'wick.safetensors'}", f"optim={optim_name}", f"optim_opts={json.dumps(opts)}",
        f"micro_batch={micro}", f"accumulate={accumulate}", f"epochs={epochs}", f"clip={clip}",
        f"schedule={sched_kind}",
    )
    got = load_file(tmp_path / "wick.safetensors")
    want = reference(init, x, y, optim_name, opts, micro * accumulate, epochs, clip, sched_kind)
    assert set(got) == set(want)
    for k in want:
        # training moved the weights, so the comparison is not between two copies of the start
        assert not torch.allclose(want[k], init[k], atol=1e-3), k
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
