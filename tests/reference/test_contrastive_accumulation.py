"""CLIP's contrastive loss under gradient accumulation, against PyTorch on the
same weights and data (transformers' CLIPModel, its loss with return_loss):

- accumulation = "exact" (the window's embeddings first, the loss over all of
  them, then backward micro-batch by micro-batch): (micro 4, accumulate 4) and
  two ranks of (micro 4, accumulate 2) end where one full batch of 16 does;
- accumulation = "plain" (each micro-batch its own loss, fewer negatives):
  ends where PyTorch's naive accumulation ends, and measurably away from the
  full batch. The test expects that difference."""
import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import WICK  # tests/conftest.py

transformers = pytest.importorskip("transformers")

RECIPE = """
local wick = require "wick"
local a = wick.args
local data = wick.data("tensors", { file = a.data })
local model = wick.model("clip", { path = a.path, accumulation = a.mode })
local run = wick.train {
  model = model, data = data, optim = wick.optim("sgd", { lr = 0.5 }),
  micro_batch = a.micro, accumulate = a.acc, epochs = 1, shuffle = false, quiet = true, out = a.out,
  shard = a.shard,
}
if wick.rank == 0 then model:save(a.result) end
"""

N, BATCH, LR = 32, 16, 0.5


def tiny_clip():
    torch.manual_seed(0)
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=12, eos_token_id=49),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=8),
        projection_dim=16)
    return transformers.CLIPModel(cfg).float()


def make_data():
    g = torch.Generator().manual_seed(1)
    images = torch.randn(N, 3, 16, 16, generator=g)
    ids = torch.randint(0, 49, (N, 10), generator=g)
    lengths = torch.randint(4, 11, (N,), generator=g)
    mask = (torch.arange(10)[None, :] < lengths[:, None]).long()
    ids[torch.arange(N), lengths - 1] = 49  # end of text, then padding
    ids = ids * mask
    return images, ids, mask


def reference(model, images, ids, mask, micro):
    """SGD over windows of BATCH samples; each window's gradient is the mean over
    its micro-batches of transformers' CLIP loss (micro == BATCH: the full batch)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for w in range(0, N, BATCH):
        opt.zero_grad()
        for m in range(w, w + BATCH, micro):
            s = slice(m, m + micro)
            out = model(input_ids=ids[s], attention_mask=mask[s], pixel_values=images[s], return_loss=True)
            (out.loss * micro / BATCH).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("clip")
    model = tiny_clip()
    model.save_pretrained(d / "hf", safe_serialization=True)
    images, ids, mask = make_data()
    save_file({"image": images, "input_ids": ids, "attention_mask": mask}, d / "data.safetensors")
    (d / "r.lua").write_text(RECIPE)
    full = reference(tiny_clip(), images, ids, mask, BATCH)
    plain = reference(tiny_clip(), images, ids, mask, 4)
    return d, full, plain


def run(d, tag, mode, micro, acc, nproc=1, *more):
    args = [str(d / "r.lua"), f"path={d / 'hf'}", f"data={d / 'data.safetensors'}", f"mode={mode}",
            f"micro={micro}", f"acc={acc}", f"result={d / (tag + '.safetensors')}", f"out={d / tag}", *more]
    cmd = [WICK, "run", *args] if nproc == 1 else [WICK, "launch", "--nproc-per-node", str(nproc), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    # the run declares which form of the loss it trains
    scope = json.loads((d / tag / "run.json").read_text())["loss_scope"]
    assert scope == ("window" if mode == "exact" else "micro_batch"), scope
    return load_file(str(d / (tag + ".safetensors")))


def worst(got, ref):
    # relative to each tensor's size, but not below 1e-3: the key projections'
    # biases get zero gradient (softmax ignores a shift) and stay ~0 up to rounding
    return max(((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-3)).item()
               for k in ref if k in got and ref[k].is_floating_point())


def test_exact_accumulation_equals_the_full_batch(setup):
    d, full, plain = setup
    got = run(d, "exact", "exact", 4, 4)
    assert worst(got, full) < 1e-4
    assert (got["logit_scale"] - tiny_clip().state_dict()["logit_scale"]).abs().item() > 1e-5  # it trained
    one = run(d, "exact_full", "exact", 16, 1)
    assert worst(got, one) < 1e-5


def test_exact_accumulation_over_two_ranks_equals_the_full_batch(setup):
    d, full, plain = setup
    got = run(d, "exact_2ranks", "exact", 4, 2, nproc=2)
    assert worst(got, full) < 1e-4


@pytest.mark.parametrize("micro,acc,nproc", [(4, 2, 2), (2, 4, 2), (2, 2, 3)])
def test_exact_accumulation_with_divided_weights_equals_the_full_batch(setup, micro, acc, nproc):
    """shard = "parameters" (ZeRO-3): the embeddings pass, the loss over the
    window and each micro-batch's backward gather the towers' blocks as they
    run, and every backward reduce-scatters its gradients (the temperature's
    with the first). On 3 ranks (windows of 12 over 32 samples) the last
    window leaves rank 2 one micro-batch fewer, which it runs as its stand-in
    in both passes: the same as 3 unsharded ranks."""
    d, full, plain = setup
    got = run(d, f"exact_z3_{micro}_{nproc}", "exact", micro, acc, nproc, "shard=parameters")
    if micro * acc * nproc == BATCH:
        assert worst(got, full) < 1e-4
    assert worst(got, run(d, f"exact_z3_none_{micro}_{nproc}", "exact", micro, acc, nproc)) < 1e-5


def test_plain_accumulation_differs_from_the_full_batch_as_pytorch_says(setup):
    d, full, plain = setup
    got = run(d, "plain", "plain", 4, 4)
    assert worst(got, plain) < 1e-4  # the same as PyTorch's naive accumulation...
    assert worst(got, full) > 1e-3   # ...which is not the full batch: fewer negatives per loss
    assert worst(plain, full) > 1e-3
