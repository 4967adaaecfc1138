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


# Malformed files: the reference library refuses each, and so does wick, with
# one line naming the file and the tensor or key.
def _file(header, data=b""):
    import json
    import struct
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def _t(dtype, shape, offsets, **extra):
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets, **extra}


MALFORMED = {
    "overlapping offsets": (_file({"a": _t("F32", [2], [0, 8]), "b": _t("F32", [2], [0, 8])}, bytes(8)), r"tensor 'b'"),
    "a gap before the data": (_file({"a": _t("F32", [1], [4, 8])}, bytes(8)), r"tensor 'a'"),
    "bytes after the last tensor": (_file({"a": _t("F32", [1], [0, 4])}, bytes(8)), r"cover 4 of the file's 8"),
    "offsets outside the file": (_file({"a": _t("F32", [4], [0, 16])}, bytes(8)), r"tensor 'a' ends at data byte 16"),
    "offsets reversed": (_file({"a": _t("F32", [0], [8, 0])}, bytes(8)), r"tensor 'a'"),
    "duplicate names": (_file(b'{"a":' + b'{"dtype":"F32","shape":[1],"data_offsets":[0,4]}' + b',"a":'
                              + b'{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', bytes(8)), r"tensor 'a' is named twice"),
    "a fractional size": (_file(b'{"a":{"dtype":"F32","shape":[16.5,8],"data_offsets":[0,8]}}', bytes(8)), r"shape\[0\] is 16\.5"),
    "a size written as a float": (_file(b'{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', bytes(8)), r"shape\[0\] is 2\.0"),
    "a negative size": (_file(b'{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', bytes(8)), r"shape\[0\] is -2"),
    "an overflowing shape": (_file({"a": _t("F32", [2 ** 62, 2 ** 62], [0, 8])}, bytes(8)), r"tensor 'a': shape .* more bytes than 64 bits"),
    "a [2^40, 2^40] shape": (_file({"a": _t("F32", [2 ** 40, 2 ** 40], [0, 0])}), r"more bytes than 64 bits"),
    "sizes that disagree with the offsets": (_file({"a": _t("F32", [3], [0, 8])}, bytes(8)), r"shape \[3\] and dtype F32 need 12"),
    "a numeric dtype": (_file(b'{"a":{"dtype":3,"shape":[2],"data_offsets":[0,8]}}', bytes(8)), r"tensor 'a': dtype is 3"),
    "a string shape": (_file(b'{"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}}', bytes(8)), r"tensor 'a': shape is \"2\""),
    "string offsets": (_file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":["0","8"]}}', bytes(8)), r"tensor 'a': data_offsets is"),
    "three offsets": (_file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}', bytes(8)), r"tensor 'a': data_offsets is"),
    "a missing field": (_file(b'{"a":{"shape":[2],"data_offsets":[0,8]}}', bytes(8)), r"tensor 'a' lacks dtype"),
    "a metadata number": (_file(b'{"__metadata__":{"a":1}}'), r"__metadata__ key 'a' is 1"),
    "a header that is a list": (_file(b"[1]"), r"header is a JSON array"),
    "a NUL after the header": (_file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}\0\0', bytes(8)), r"NUL byte"),
    "invalid UTF-8": (_file(b'{"\xff":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8)), r"not valid JSON"),
    "a header longer than the file": (b"\x64" + bytes(7) + b"{}", r"header length 100 exceeds the file size"),
    "a cut header length": (b"\x01\x00\x00", r"shorter than its 8-byte header length"),
}


import pytest  # noqa: E402


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_file_the_reference_refuses_wick_refuses_naming_it(tmp_path, run_wick, name):
    import re

    from safetensors import SafetensorError
    raw, message = MALFORMED[name]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw)
    with pytest.raises((SafetensorError, ValueError, OverflowError)):
        load_file(bad)
    (tmp_path / "copy.lua").write_text(RECIPE)
    p = run_wick("run", tmp_path / "copy.lua", f"src={bad}", f"dst={tmp_path / 'out.safetensors'}", check=False)
    assert p.returncode == 1, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("wick: error:") and f"corrupt safetensors file {bad}" in last, last
    assert re.search(message, last), last
    assert "Exception raised from" not in p.stderr and "[json.exception" not in p.stderr
    assert not (tmp_path / "out.safetensors").exists()


ACCEPTED = {
    "entries out of order": _file({"b": _t("F32", [1], [4, 8]), "a": _t("F32", [1], [0, 4])}, bytes(8)),
    "zero-sized tensors sharing an offset": _file({"a": _t("F32", [1], [0, 4]), "y": _t("F32", [0], [4, 4]),
                                                  "z": _t("I8", [0, 3], [4, 4])}, bytes(4)),
    "null metadata, spaces around the JSON, unknown fields": _file(
        b'  {"__metadata__":null,"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1}}   ', bytes(8)),
    "an empty file of tensors": _file(b"{}"),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_a_file_the_reference_reads_wick_reads_the_same(tmp_path, run_wick, name):
    src = tmp_path / "src.safetensors"
    src.write_bytes(ACCEPTED[name])
    want = load_file(src)
    (tmp_path / "copy.lua").write_text(RECIPE)
    run_wick("run", tmp_path / "copy.lua", f"src={src}", f"dst={tmp_path / 'dst.safetensors'}")
    got = load_file(tmp_path / "dst.safetensors")
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
