"""The small working test plugins (tests/host/plugin/working/), one SDK
interface each, loaded by `wick run` from WICK_PLUGIN_PATH and checked end
to end: a Predictor's outputs through wick.core.predict, a Generator's ids
through model:generate with the options the host passes on, a WindowCoupled
model trained as one large batch, a Transform applied, saved and loaded."""
import os
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WICK = os.environ.get("WICK", str(Path(__file__).resolve().parents[3] / "build" / "bin" / "wick"))
PLUGINS = Path(os.environ.get("WICK_TEST_PLUGIN_DIR",
                              str(Path(WICK).resolve().parents[1] / "lib" / "wick" / "test-plugins"))) / "working"


def run(tmp_path, recipe, *pairs, ok=True):
    (tmp_path / "recipe.lua").write_text("local wick = require 'wick'\n" + recipe)
    env = {**os.environ, "WICK_PLUGIN_PATH": str(PLUGINS), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([WICK, "run", tmp_path / "recipe.lua", *pairs], capture_output=True, text=True, timeout=300,
                       env=env)
    assert (p.returncode == 0) == ok, p.stderr
    return p


def test_the_working_plugins_are_listed_with_their_kinds(tmp_path):
    p = subprocess.run([WICK, "plugins"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "WICK_PLUGIN_PATH": str(PLUGINS)})
    assert p.returncode == 0, p.stderr
    kinds = {line.split()[1]: line.split()[0] for line in p.stdout.splitlines() if " test_" in line}
    assert kinds == {"test_predictor": "model", "test_generator": "model", "test_window_coupled": "model",
                     "test_transform": "optim/transform"}, p.stdout


def test_predictor_outputs_are_written_by_wick_core_predict(tmp_path):
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    save_file({"x": x}, tmp_path / "batch.safetensors")
    run(tmp_path, """local m = wick.model('test_predictor', { inputs = 4, outputs = 2, seed = 3 })
m:save(wick.args.weights)
wick.core.predict(m, wick.args.batch, wick.args.out)
""", f"weights={tmp_path / 'w.safetensors'}", f"batch={tmp_path / 'batch.safetensors'}",
        f"out={tmp_path / 'out.safetensors'}")
    w = load_file(tmp_path / "w.safetensors")["w"]
    out = load_file(tmp_path / "out.safetensors")["output"]
    assert w.shape == (2, 4)
    torch.testing.assert_close(out, x @ w.T)


def test_a_model_without_predict_is_refused_by_wick_core_predict(tmp_path):
    save_file({"x": torch.zeros(2, 4)}, tmp_path / "batch.safetensors")
    p = run(tmp_path, """local m = wick.model('test_generator', {})
wick.core.predict(m, wick.args.batch, wick.args.out)
""", f"batch={tmp_path / 'batch.safetensors'}", f"out={tmp_path / 'out.safetensors'}", ok=False)
    assert "this model does not implement predict()" in p.stderr


def counting(prompt, vocab, step, max_new, eos=(), stop_at=None):
    """The generator's rule, written again: the reference for its ids."""
    out, last = [], prompt[-1]
    while len(out) < max_new:
        last = (last + step) % vocab
        out.append(last)
        if last in eos or last == stop_at:
            break
    return out


def test_generator_keeps_the_options_the_host_passes_on(tmp_path):
    p = run(tmp_path, """local m = wick.model('test_generator', { vocab = 10, step = 3 })
local function show(name, ids) print(name .. ' ' .. table.concat(ids, ',')) end
local seen = {}
show('plain', m:generate({ 1, 2 }, { max_new_tokens = 5, on_token = function(t) seen[#seen + 1] = t end }))
show('seen', seen)
show('eos_id', m:generate({ 1 }, { max_new_tokens = 10, eos_id = 7 }))
show('eos_ids', m:generate({ 1 }, { max_new_tokens = 10, eos_ids = { 9, 4 } }))
show('stopped', m:generate({ 1 }, { max_new_tokens = 10, on_token = function(t) return t == 6 end }))
""")
    got = dict(line.split(" ", 1) for line in p.stdout.splitlines())
    ids = lambda s: [int(t) for t in s.split(",")]
    assert ids(got["plain"]) == counting([1, 2], 10, 3, 5)
    assert ids(got["seen"]) == ids(got["plain"])  # streamed, each id once, in order
    assert ids(got["eos_id"]) == counting([1], 10, 3, 10, eos=(7,))
    assert ids(got["eos_ids"]) == counting([1], 10, 3, 10, eos=(9, 4))
    assert ids(got["stopped"]) == counting([1], 10, 3, 10, stop_at=6)
    assert len(ids(got["eos_id"])) < 10  # the end token did end it


COUPLED = """local data = wick.data('synthetic', { size = 32, inputs = 4, classes = 2, seed = 1 })
local function train(micro, accumulate, coupled, file)
  local m = wick.model('test_window_coupled', { inputs = 4, dim = 3, seed = 5, coupled = coupled })
  print(file .. ' coupled ' .. tostring(m:window_coupled()))
  wick.train { model = m, data = data, optim = wick.optim('sgd', { lr = 0.05 }), micro_batch = micro,
               accumulate = accumulate, max_steps = 3, shuffle = false, quiet = true }
  m:save(wick.args.dir .. '/' .. file .. '.safetensors')
end
train(8, 1, true, 'whole')
train(2, 4, true, 'split')
train(2, 4, false, 'plain')
"""


def test_a_window_coupled_model_trains_as_one_large_batch(tmp_path):
    p = run(tmp_path, COUPLED, f"dir={tmp_path}")
    assert "split coupled true" in p.stdout and "plain coupled false" in p.stdout
    w = {k: load_file(tmp_path / f"{k}.safetensors")["w"] for k in ("whole", "split", "plain")}
    torch.testing.assert_close(w["split"], w["whole"], rtol=1e-5, atol=1e-6)
    # the loss couples the window: micro-batches alone would train elsewhere
    assert (w["plain"] - w["whole"]).abs().max() > 1e-3


TRANSFORM = """local data = wick.data('synthetic', { size = 32, inputs = 4, classes = 2, seed = 1 })
local function mlp() return wick.model('mlp', { inputs = 4, hidden = { 8 }, outputs = 2 }) end
local function train(m) wick.train { model = m, data = data, optim = wick.optim('sgd', { lr = 0.5 }), micro_batch = 8,
                                    max_steps = 3, quiet = true } end
local d = wick.args.dir
local m = mlp()
m:save(d .. '/before.safetensors')
local t = wick.optim('test_transform', { suffix = wick.args.suffix })
print('kind ' .. t:kind())
t:apply(m)
train(m)
m:save(d .. '/after.safetensors')
t:save(m, d)
local again = mlp()
again:save(d .. '/again_before.safetensors')
wick.optim('test_transform', {}):load(again, d)
train(again)
again:save(d .. '/again_after.safetensors')
"""


def test_a_transform_is_applied_saved_and_loaded_through_the_host(tmp_path):
    p = run(tmp_path, TRANSFORM, f"dir={tmp_path}", "suffix=bias")
    assert "kind transform" in p.stdout
    names = set(load_file(tmp_path / "before.safetensors"))
    biases = sorted(n for n in names if n.endswith("bias"))
    assert len(biases) == 2 and len(names) == 4, names
    assert sorted((tmp_path / "frozen.txt").read_text().split()) == biases
    for pair in (("before", "after"), ("again_before", "again_after")):
        a, b = (load_file(tmp_path / f"{n}.safetensors") for n in pair)
        for name in a:
            if name.endswith("bias"):
                assert torch.equal(a[name], b[name]), (pair, name)  # frozen: untouched by training
            else:
                assert not torch.equal(a[name], b[name]), (pair, name)


def test_a_transforms_error_reaches_the_user_with_its_words(tmp_path):
    p = run(tmp_path, TRANSFORM, f"dir={tmp_path}", "suffix=gamma", ok=False)
    assert "test_transform: no parameter name ends with 'gamma'" in p.stderr
