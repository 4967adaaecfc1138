"""Every learning-rate schedule equals transformers' get_*_schedule_with_warmup
(LambdaLR's multiplier) at every step of a run, past its end included; and
the options of one shape given to another are refused by name."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import optimization as opt  # noqa: E402

TOTAL = 40
LR = 0.5
RECIPE = """
local wick = require "wick"
local a = wick.args
local s = wick.schedule(a.type, wick.core.json_decode(a.opts))
local out = {}
for step = 0, a.steps - 1 do out[#out + 1] = s:factor(step, a.total) end
print(wick.core.json(out))
"""

CASES = [
    ("constant", {"warmup_steps": 5}, lambda o: opt.get_constant_schedule_with_warmup(o, 5)),
    ("linear", {"warmup_steps": 5}, lambda o: opt.get_linear_schedule_with_warmup(o, 5, TOTAL)),
    ("cosine", {"warmup_steps": 4}, lambda o: opt.get_cosine_schedule_with_warmup(o, 4, TOTAL)),
    ("cosine", {"warmup_steps": 4, "num_cycles": 1.5}, lambda o: opt.get_cosine_schedule_with_warmup(o, 4, TOTAL, 1.5)),
    ("cosine", {"warmup_steps": 3, "min_lr_ratio": 0.1},
     lambda o: opt.get_cosine_with_min_lr_schedule_with_warmup(o, 3, TOTAL, min_lr_rate=0.1)),
    ("cosine_with_restarts", {"warmup_steps": 3, "num_cycles": 3},
     lambda o: opt.get_cosine_with_hard_restarts_schedule_with_warmup(o, 3, TOTAL, 3)),
    ("cosine_with_restarts", {}, lambda o: opt.get_cosine_with_hard_restarts_schedule_with_warmup(o, 0, TOTAL)),
    ("polynomial", {"warmup_steps": 4, "power": 2.0, "min_lr_ratio": 0.02},
     lambda o: opt.get_polynomial_decay_schedule_with_warmup(o, 4, TOTAL, lr_end=0.02 * LR, power=2.0)),
    ("polynomial", {"warmup_steps": 2, "min_lr_ratio": 1e-6},
     lambda o: opt.get_polynomial_decay_schedule_with_warmup(o, 2, TOTAL, lr_end=1e-6 * LR)),
    ("inverse_sqrt", {"warmup_steps": 6}, lambda o: opt.get_inverse_sqrt_schedule(o, 6)),
    ("inverse_sqrt", {"warmup_steps": 6, "timescale": 20}, lambda o: opt.get_inverse_sqrt_schedule(o, 6, 20)),
    ("inverse_sqrt", {}, lambda o: opt.get_inverse_sqrt_schedule(o, 0)),
    ("warmup_stable_decay", {"warmup_steps": 5, "decay_steps": 10},
     lambda o: opt.get_wsd_schedule(o, 5, 10, num_training_steps=TOTAL)),
    ("warmup_stable_decay", {"warmup_steps": 5, "decay_steps": 12, "stable_steps": 8, "warmup_type": "cosine",
                             "decay_type": "1-sqrt", "min_lr_ratio": 0.1},
     lambda o: opt.get_wsd_schedule(o, 5, 12, num_stable_steps=8, warmup_type="cosine", decay_type="1-sqrt",
                                    min_lr_ratio=0.1)),
    ("warmup_stable_decay", {"warmup_steps": 4, "decay_steps": 16, "warmup_type": "1-sqrt", "decay_type": "linear"},
     lambda o: opt.get_wsd_schedule(o, 4, 16, num_training_steps=TOTAL, warmup_type="1-sqrt", decay_type="linear")),
    ("warmup_stable_decay", {"warmup_steps": 2, "decay_steps": 20, "num_cycles": 1.0},
     lambda o: opt.get_wsd_schedule(o, 2, 20, num_training_steps=TOTAL, num_cycles=1.0)),
]


@pytest.mark.parametrize("kind,opts,make", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_schedule_equals_transformers_at_every_step(tmp_path, run_wick, kind, opts, make):
    (tmp_path / "r.lua").write_text(RECIPE)
    p = run_wick("run", tmp_path / "r.lua", f"type={kind}", f"opts={json.dumps(opts)}", f"steps={TOTAL + 5}",
                 f"total={TOTAL}")
    ours = json.loads(p.stdout.strip().splitlines()[-1])
    o = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    sched = make(o)
    theirs = []
    for _ in range(TOTAL + 5):
        theirs.append(o.param_groups[0]["lr"] / LR)
        o.step()
        sched.step()
    assert len(ours) == len(theirs)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15), f"step {step}: {a} != {b}"


@pytest.mark.parametrize("kind,opts,says", [
    ("cosine", {"power": 2.0}, "power is an option of type polynomial only"),
    ("linear", {"decay_steps": 3}, "decay_steps is an option of type warmup_stable_decay only"),
    ("polynomial", {"timescale": 10}, "timescale is an option of type inverse_sqrt only"),
    ("warmup_stable_decay", {}, "decay_steps is required"),
    ("warmup_stable_decay", {"warmup_steps": 10, "decay_steps": 40, "total_steps": 30},
     "warmup_steps 10 + decay_steps 40 exceed total_steps 30"),
    ("cosine_with_restarts", {"num_cycles": 1.5}, "num_cycles must be a whole number"),
    ("polynomial", {"min_lr_ratio": 1.0}, "min_lr_ratio must be below 1"),
    ("warmup_stable_decay", {"decay_steps": 4, "decay_type": "exp"}, "decay_type"),
])
def test_options_of_another_shape_are_refused_by_name(tmp_path, run_wick, kind, opts, says):
    (tmp_path / "r.lua").write_text(RECIPE)
    p = run_wick("run", tmp_path / "r.lua", f"type={kind}", f"opts={json.dumps(opts)}", "steps=3", "total=10",
                 check=False)
    assert p.returncode != 0
    assert says in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "frame #" not in p.stderr
