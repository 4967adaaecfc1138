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
