"""The exponential moving average of the weights (ema, ema_start): equal to an
average written out here over the weights each step left, in fp32 for
half-precision weights too; saved, evaluated (eval_ema) and resumed."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

LOOP = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 40, inputs = 6, classes = 3, seed = 3 })
wick.seed(4)
local model = wick.model("mlp", { inputs = 6, hidden = { 10 }, outputs = 3 })
local trainer = wick.trainer { model = model, optim = wick.optim("adamw", { lr = 0.02 }), precision = a.precision,
  ema = a.decay, ema_start = a.start }
model:save(a.dir .. "/w0.safetensors")  -- after the trainer: in the run's precision
local loader = wick.loader(data, { micro_batch = 4, accumulate = 1, shuffle = false })
local step = 0
for epoch = 0, 1 do
  loader:start_epoch(epoch)
  for window in loader.next, loader do
    trainer:step(window)
    step = step + 1
    model:save(a.dir .. "/w" .. step .. ".safetensors")
  end
end
trainer:save_ema(a.dir .. "/ema.safetensors")
print("steps " .. step)
"""


@pytest.mark.parametrize("precision", ["fp32", "bf16-true"])
@pytest.mark.parametrize("start", [0, 4])
def test_ema_is_the_average_of_the_weights_each_step_left(tmp_path, run_wick, precision, start):
    (tmp_path / "loop.lua").write_text(LOOP)
    decay = 0.8
    p = run_wick("run", tmp_path / "loop.lua", f"dir={tmp_path}", f"precision={precision}", f"decay={decay}",
                 f"start={start}")
    steps = int(p.stdout.split("steps ")[1])
    assert steps == 20
    w = [load_file(tmp_path / f"w{t}.safetensors") for t in range(steps + 1)]
    want = {k: v.double() for k, v in w[0].items()}
    for t in range(1, steps + 1):
        for k in want:
            want[k] = w[t][k].double() if t <= start else decay * want[k] + (1 - decay) * w[t][k].double()
    got = load_file(tmp_path / "ema.safetensors")
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == torch.float32, f"{k}: the average is kept in fp32, got {got[k].dtype}"
        # the average is not the last weights: it lags them
        assert not torch.allclose(got[k].double(), w[steps][k].double(), atol=1e-4), k
        torch.testing.assert_close(got[k].double(), want[k], rtol=1e-6, atol=1e-7, msg=k)
    with safe_open(str(tmp_path / "ema.safetensors"), "pt") as f:
        meta = f.metadata()
    assert float(meta["wick.ema"]) == decay and int(meta["wick.ema_step"]) == steps


RUN = """
local wick = require "wick"
local a = wick.args
local data = wick.data("synthetic", { size = 40, inputs = 6, classes = 3, seed = 3 })
local held = wick.data("synthetic", { size = 24, inputs = 6, classes = 3, seed = 5 })
wick.seed(4)
local model = wick.model("mlp", { inputs = 6, hidden = { 10 }, outputs = 3 })
local run = wick.train { model = model, data = data, eval_data = held, optim = wick.optim("adamw", { lr = 0.02 }),
  micro_batch = 4, epochs = 2, max_steps = a.max_steps or 0, save_every = 3, ema = 0.9, eval_ema = true,
  out = a.out, resume = a.resume or false, quiet = true }
-- the evaluation's ema_loss is the loss of the saved average
local avg = wick.model("mlp", { inputs = 6, hidden = { 10 }, outputs = 3 })
avg:load(run.ema)
local e = wick.evaluate(avg, held, { micro_batch = 4 })
print(string.format("ema_loss %.9f evaluated %.9f loss %.9f", run.eval.ema_loss, e.loss, run.eval.loss))
"""


def test_ema_is_evaluated_saved_and_resumed(tmp_path, run_wick):
    (tmp_path / "run.lua").write_text(RUN)
    p = run_wick("run", tmp_path / "run.lua", f"out={tmp_path / 'a'}")
    ema_loss, evaluated, loss = (float(x) for x in p.stdout.split()[1::2])
    assert abs(ema_loss - evaluated) < 1e-6 * max(1.0, abs(evaluated))
    assert abs(ema_loss - loss) > 1e-4  # the average is evaluated, not the trained weights
    # stopped after 5 steps, then resumed to the end: the average equals the unbroken run's, bit for bit
    run_wick("run", tmp_path / "run.lua", f"out={tmp_path / 'b'}", "max_steps=5")
    run_wick("run", tmp_path / "run.lua", f"out={tmp_path / 'b'}", "resume=true")
    a, b = load_file(tmp_path / "a" / "ema.safetensors"), load_file(tmp_path / "b" / "ema.safetensors")
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
