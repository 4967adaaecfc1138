"""wick reads what the reference safetensors library writes and writes what it reads:
every dtype wick supports, shapes, and the header metadata."""
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

RECIPE = """
local wick = require "wick"
wick.core.copy_tensors(wick.args.src, wick.args.dst)
"""


def test_round_trip_through_wick_keeps_every_dtype_and_metadata(tmp_path, run_wick):
    tensors = {
        "f32": torch.randn(3, 4),
        "f16": torch.randn(5).half(),
        "bf16": torch.randn(2, 3, 2).bfloat16(),
        "i64": torch.arange(-3, 4),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "u8": torch.randint(0, 256, (7,), dtype=torch.uint8),
        "bool": torch.randn(9) > 0,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, tmp_path / "src.safetensors", metadata={"format": "pt", "origin": "python"})
    (tmp_path / "copy.lua").write_text(RECIPE)
    run_wick("run", tmp_path / "copy.lua", f"src={tmp_path / 'src.safetensors'}", f"dst={tmp_path / 'dst.safetensors'}")
    back = load_file(tmp_path / "dst.safetensors")
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype, k
        assert back[k].shape == t.shape, k
        assert torch.equal(back[k], t), k
    with safe_open(tmp_path / "dst.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "origin": "python"}


def test_model_weights_move_between_pytorch_and_wick_unchanged(tmp_path, run_wick):
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    save_file(net.state_dict(), tmp_path / "torch.safetensors")
    (tmp_path / "m.lua").write_text(
        'local wick = require "wick"\n'
        'local m = wick.model("mlp", { inputs = 4, hidden = { 8 }, outputs = 2 })\n'
        "m:load(wick.args.src)\nm:save(wick.args.dst)\n"
    )
    run_wick("run", tmp_path / "m.lua", f"src={tmp_path / 'torch.safetensors'}", f"dst={tmp_path / 'wick.safetensors'}")
    back = load_file(tmp_path / "wick.safetensors")
    net2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    net2.load_state_dict(back)  # strict: same names, same shapes
    x = torch.randn(5, 4)
    assert torch.equal(net(x), net2(x))


def test_mlp_regression_loss_matches_pytorch_mse(tmp_path, run_wick):
    """The mlp's mse loss per item is the mean over outputs: one full-batch SGD
    step from the same weights moves them as torch's MSELoss gradient does."""
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 2))
    init = {k: v.detach().clone() for k, v in net.state_dict().items()}
    save_file(init, tmp_path / "init.safetensors")
    x, y = torch.randn(12, 5), torch.randn(12, 2)
    save_file({"x": x, "y": y}, tmp_path / "data.safetensors")
    (tmp_path / "r.lua").write_text(
        'local wick = require "wick"\n'
        'local m = wick.model("mlp", { inputs = 5, hidden = { 7 }, outputs = 2, activation = "gelu", loss = "mse" })\n'
        "m:load(wick.args.init)\n"
        'local run = wick.train { model = m, data = wick.data("tensors", { file = wick.args.data }),\n'
        '  optim = wick.optim("sgd", { lr = 0.5 }), micro_batch = 4, accumulate = 3, shuffle = false, quiet = true }\n'
        'print(string.format("%.9f", run.final_loss))\n'
        "m:save(wick.args.result)\n"
    )
    p = run_wick("run", tmp_path / "r.lua", f"init={tmp_path / 'init.safetensors'}",
                 f"data={tmp_path / 'data.safetensors'}", f"result={tmp_path / 'out.safetensors'}")
    loss = torch.nn.functional.mse_loss(net(x), y)
    assert abs(float(p.stdout) - loss.item()) < 1e-5
    loss.backward()
    with torch.no_grad():
        for prm in net.parameters():
            prm -= 0.5 * prm.grad
    got = load_file(tmp_path / "out.safetensors")
    for k, v in net.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
