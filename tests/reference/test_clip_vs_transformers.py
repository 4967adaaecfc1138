"""The `clip` plugin against Hugging Face transformers' CLIPModel on a tiny
random config: embeddings, logits, loss and gradients in fp32, weights loading
back; and the contrastive loss over accumulation windows: exact mode equals
the full batch, plain mode does not."""
import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

RECIPE = """
local wick = require "wick"
local a = wick.args
for _, out in ipairs { "image_embeds", "text_embeds", "logits_per_image" } do
  wick.core.predict(wick.model("clip", { path = a.path, output = out }), a.batch, a.dir .. "/" .. out .. ".safetensors")
end
local m = wick.model("clip", { path = a.path })
wick.core.gradients(m, a.batch, a.dir .. "/grads.safetensors")
wick.save_pretrained(m, a.dir .. "/saved")
"""


def tiny(eos):
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=99, hidden_size=24, intermediate_size=30, num_hidden_layers=2, num_attention_heads=2,
                         max_position_embeddings=12, eos_token_id=eos),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                           patch_size=4),
        projection_dim=16)
    return transformers.CLIPModel(cfg)


@pytest.mark.parametrize("eos", [98, 2])
def test_clip_matches_transformers(tmp_path, run_wick, eos):
    torch.manual_seed(0)
    ref = tiny(eos)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n or n.endswith("bias") or "embed" in n:
                p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(tmp_path / "hf")
    N, L = 4, 9
    ids = torch.randint(3, 90, (N, L))
    mask = torch.ones(N, L, dtype=torch.long)
    for i, n in enumerate([9, 5, 7, 3]):  # right padding, end-of-text last
        ids[i, n - 1] = 98 if eos != 2 else 95
        ids[i, n:] = 0
        mask[i, n:] = 0
    images = torch.randint(0, 256, (N, 3, 16, 16), dtype=torch.uint8)
    save_file({"image": images, "input_ids": ids, "attention_mask": mask}, tmp_path / "batch.safetensors")
    (tmp_path / "r.lua").write_text(RECIPE)
    run_wick("run", tmp_path / "r.lua", f"path={tmp_path / 'hf'}", f"batch={tmp_path / 'batch.safetensors'}",
             f"dir={tmp_path}")
    pixels = (images.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    out = ref(input_ids=ids, attention_mask=mask, pixel_values=pixels, return_loss=True)
    for k in ["image_embeds", "text_embeds", "logits_per_image"]:
        got = load_file(tmp_path / f"{k}.safetensors")["output"]
        assert (got - getattr(out, k)).abs().max().item() < 1e-4, k
    out.loss.backward()
    g = load_file(tmp_path / "grads.safetensors")
    assert abs(g["loss"].item() - out.loss.item()) < 1e-5
    assert g["items"].item() == N
    for n, p in ref.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(g["grad." + n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
    back, info = transformers.CLIPModel.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        again = back.eval()(input_ids=ids, attention_mask=mask, pixel_values=pixels)
    assert (again.logits_per_image - out.logits_per_image).abs().max().item() < 1e-5


TRAIN = """
local wick = require "wick"
local a = wick.args
wick.seed(5)
local m = wick.model("clip", { accumulation = a.mode, image_size = 16, patch_size = 8, hidden_size = 32,
  intermediate_size = 48, layers = 1, heads = 4, text_hidden_size = 32, text_intermediate_size = 48, text_layers = 1,
  text_heads = 4, vocab_size = 40, eos_token_id = 39, max_length = 8, projection_dim = 16 })
wick.train { model = m, data = wick.data("tensors", { file = a.data }), optim = wick.optim("sgd", { lr = 0.5 }),
  micro_batch = a.micro, accumulate = a.acc, epochs = 2, shuffle = false, quiet = true }
m:save(a.result)
"""


def test_exact_accumulation_equals_the_full_batch_and_plain_does_not(tmp_path, run_wick):
    torch.manual_seed(6)
    n = 16
    ids = torch.randint(0, 39, (n, 8))
    ids[:, -1] = 39
    save_file({"image": torch.randint(0, 256, (n, 3, 16, 16), dtype=torch.uint8), "input_ids": ids},
              tmp_path / "data.safetensors")
    (tmp_path / "t.lua").write_text(TRAIN)
    results = {}
    for mode, micro, acc in [("exact", 16, 1), ("exact", 4, 4), ("plain", 4, 4)]:
        out = tmp_path / f"{mode}_{micro}x{acc}.safetensors"
        run_wick("run", tmp_path / "t.lua", f"data={tmp_path / 'data.safetensors'}", f"mode={mode}", f"micro={micro}",
                 f"acc={acc}", f"result={out}")
        results[(mode, micro)] = load_file(out)
    full, exact, plain = results[("exact", 16)], results[("exact", 4)], results[("plain", 4)]
    for k in full:
        torch.testing.assert_close(exact[k], full[k], rtol=1e-4, atol=1e-5, msg=k)
    # plain accumulation: each micro-batch has 3 negatives instead of 15, a different loss and other weights
    diff = max((plain[k] - full[k]).abs().max().item() for k in full)
    assert diff > 1e-3, diff
