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


def mlp():
    """The mlp plugin's layers, as torch.nn (the same parameter names)."""
    return torch.nn.Sequential(
        torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)
    )


def start(tmp_path, seed, recipe):
    """Initial weights and 37 samples of data, written where the recipe reads them."""
    torch.manual_seed(seed)
    init = {k: v.detach().clone() for k, v in mlp().state_dict().items()}
    save_file(init, tmp_path / "init.safetensors")
    x = torch.randn(37, 6)
    y = torch.randint(0, 3, (37,))
    save_file({"x": x, "y": y}, tmp_path / "data.safetensors")
    (tmp_path / "recipe.lua").write_text(recipe)
    return init, x, y


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
    model = mlp()
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

    init, x, y = start(tmp_path, 1, RECIPE)
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


# Parameter groups: wick's groups (patterns) against torch.optim's param_groups
# (the parameters listed by name, written out here). A parameter goes to the
# first group that names it; the rest keep the recipe's options.
GROUP_CASES = [
    (  # transformers' default: no weight decay on biases; the output layer at its own rate
        "adamw",
        {"lr": 0.01, "weight_decay": 0.1,
         "groups": [{"params": "bias", "weight_decay": 0.0}, {"params": ["4"], "lr": 0.03, "name": "head"}]},
        [({"weight_decay": 0.0}, ["0.bias", "2.bias", "4.bias"]), ({"lr": 0.03}, ["4.weight"])],
    ),
    (  # a glob and a regular expression, per-group betas and amsgrad
        "adamw",
        {"lr": 0.02, "groups": [{"params": "re:[02]\\.weight", "betas": [0.8, 0.95], "amsgrad": True},
                                {"params": "*.bias", "lr": 0.005, "weight_decay": 0.0}]},
        [({"betas": (0.8, 0.95), "amsgrad": True}, ["0.weight", "2.weight"]),
         ({"lr": 0.005, "weight_decay": 0.0}, ["0.bias", "2.bias", "4.bias"])],
    ),
    (  # sgd: momentum in one group only, and a group whose lr is 0 (a frozen layer that keeps its state)
        "sgd",
        {"lr": 0.1, "groups": [{"params": "0", "momentum": 0.9, "nesterov": True}, {"params": "2.weight", "lr": 0.0}]},
        [({"momentum": 0.9, "nesterov": True}, ["0.weight", "0.bias"]), ({"lr": 0.0}, ["2.weight"])],
    ),
]

STEPPED = """
local wick = require "wick"
local a = wick.args
local data = wick.data("tensors", { file = a.data })
local opts = wick.core.json_decode(a.optim_opts)
-- a fresh model, optimizer and trainer (a resumed process starts from nothing)
local function fresh()
  local model = wick.model("mlp", { inputs = 6, hidden = { 10, 7 }, outputs = 3, activation = "tanh" })
  model:load(a.init)
  local t = wick.trainer { model = model, optim = wick.optim(a.optim, opts), total_steps = a.total,
    schedule = wick.schedule("cosine", { warmup_steps = 3, min_lr_ratio = 0.1 }), clip_grad_norm = a.clip }
  return model, t
end
local model, trainer = fresh()
local loader = wick.loader(data, { micro_batch = 2, accumulate = 4, shuffle = false })
local step = 0
for epoch = 0, a.epochs - 1 do
  loader:start_epoch(epoch)
  for window in loader.next, loader do
    trainer:step(window)
    step = step + 1
    if step == a.split then
      local dir = trainer:save(a.checkpoints, {}, 1)
      model, trainer = fresh()
      trainer:load(dir)
    end
  end
end
model:save(a.result)
"""


def grouped_reference(init, x, y, optim_name, opts, groups, batch, epochs, clip):
    model = mlp()
    model.load_state_dict(init)
    named = dict(model.named_parameters())
    taken = {n for _, names in groups for n in names}
    param_groups = [{"params": [named[n] for n in names], **o} for o, names in groups]
    param_groups.append({"params": [p for n, p in named.items() if n not in taken]})
    base = {k: v for k, v in opts.items() if k != "groups"}
    cls = torch.optim.SGD if optim_name == "sgd" else torch.optim.AdamW
    opt = cls(param_groups, foreach=False, **base)
    steps = epochs * math.ceil(len(x) / batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule("cosine", 3, steps, 0.1))
    for _ in range(epochs):
        for i in range(0, len(x), batch):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[i : i + batch]), y[i : i + batch])
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
            opt.step()
            sched.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("optim_name,opts,groups", GROUP_CASES)
@pytest.mark.parametrize("split", [0, 7])
def test_param_groups_match_pytorch(tmp_path, run_wick, optim_name, opts, groups, split):
    """Every group at its own options, each scaled by the schedule; split > 0
    saves a checkpoint after that step and goes on in a fresh optimizer loaded
    from it: the groups' state comes back whole."""
    import json

    init, x, y = start(tmp_path, 2, STEPPED)
    epochs, clip = 3, 0.5
    total = epochs * math.ceil(37 / 8)
    run_wick(
        "run", tmp_path / "recipe.lua",
        f"data={tmp_path / 'data.safetensors'}", f"init={tmp_path / 'init.safetensors'}",
        f"result={tmp_path / 'wick.safetensors'}", f"optim={optim_name}", f"optim_opts={json.dumps(opts)}",
        f"epochs={epochs}", f"clip={clip}", f"total={total}", f"split={split}",
        f"checkpoints={tmp_path / 'checkpoints'}",
    )
    got = load_file(tmp_path / "wick.safetensors")
    want = grouped_reference(init, x, y, optim_name, opts, groups, 8, epochs, clip)
    # the groups' options matter: one set of options for all ends elsewhere
    plain = grouped_reference(init, x, y, optim_name, opts, [], 8, epochs, clip)
    assert any(not torch.allclose(plain[k], want[k], atol=1e-4) for k in want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    if optim_name == "sgd":  # the group at lr 0 did not move
        torch.testing.assert_close(got["2.weight"], init["2.weight"], rtol=0, atol=0)
