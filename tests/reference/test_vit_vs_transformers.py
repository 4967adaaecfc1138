"""The `vit` plugin against Hugging Face transformers on tiny random ViTModel,
CLIPVisionModel and CLIPModel folders: last_hidden_state, pooler_output and
gradients in fp32, and wick's saved weights loading back into transformers."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

RECIPE = """
local wick = require "wick"
local a = wick.args
local hidden = wick.model("vit", { path = a.path, output = "hidden" })
local pooled = wick.model("vit", { path = a.path, output = "pooled" })
wick.core.predict(hidden, a.batch, a.hidden)
wick.core.predict(pooled, a.batch, a.pooled)
local head = wick.model("vit", { path = a.path, classes = 5 })
wick.core.gradients(head, a.batch, a.grads)
if a.saved then wick.save_pretrained(hidden, a.saved) end
"""

SIZES = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4)


def spread(model):
    with torch.no_grad():  # some spread in every norm and bias
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias") or "embed" in n or "token" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def run(tmp_path, run_wick, folder, save=True):
    torch.manual_seed(1)
    images = torch.randint(0, 256, (3, 3, 16, 16), dtype=torch.uint8)
    labels = torch.tensor([0, 3, 4])
    save_file({"image": images, "label": labels}, tmp_path / "batch.safetensors")
    (tmp_path / "r.lua").write_text(RECIPE)
    args = [f"path={folder}", f"batch={tmp_path / 'batch.safetensors'}", f"hidden={tmp_path / 'h.safetensors'}",
            f"pooled={tmp_path / 'p.safetensors'}", f"grads={tmp_path / 'g.safetensors'}"]
    if save:
        args.append(f"saved={tmp_path / 'saved'}")
    run_wick("run", tmp_path / "r.lua", *args)
    return images, labels, load_file(tmp_path / "h.safetensors")["output"], load_file(tmp_path / "p.safetensors")["output"], \
        load_file(tmp_path / "g.safetensors")


def pixels(images, mean, std):
    m = torch.tensor(mean).view(1, 3, 1, 1)
    s = torch.tensor(std).view(1, 3, 1, 1)
    return (images.float() / 255 - m) / s


def test_vit_matches_transformers(tmp_path, run_wick):
    torch.manual_seed(0)
    ref = spread(transformers.ViTModel(transformers.ViTConfig(**SIZES)).eval())
    ref.save_pretrained(tmp_path / "hf")
    images, labels, hidden, pooled, g = run(tmp_path, run_wick, tmp_path / "hf")
    out = ref(pixel_values=pixels(images, [0.5] * 3, [0.5] * 3))
    assert (hidden - out.last_hidden_state).abs().max().item() < 1e-4
    assert (pooled - out.pooler_output).abs().max().item() < 1e-4

    assert g["items"].item() == 3
    assert "grad.vit.encoder.layer.0.attention.attention.query.weight" in g

    # wick's weights load back into transformers with no missing or unexpected names
    back, info = transformers.ViTModel.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        again = back.eval()(pixel_values=pixels(images, [0.5] * 3, [0.5] * 3)).last_hidden_state
    assert (again - out.last_hidden_state).abs().max().item() < 1e-5


def legacy(name):
    """transformers 5's ViT parameter names to the ones its checkpoints (and wick) use."""
    if not name.startswith("layers."):
        return name
    name = "encoder.layer." + name[len("layers."):]
    for new, old in [(".attention.q_proj.", ".attention.attention.query."), (".attention.k_proj.", ".attention.attention.key."),
                     (".attention.v_proj.", ".attention.attention.value."), (".attention.o_proj.", ".attention.output.dense."),
                     (".mlp.fc1.", ".intermediate.dense."), (".mlp.fc2.", ".output.dense.")]:
        name = name.replace(new, old)
    return name


GRAD_RECIPE = """
local wick = require "wick"
local a = wick.args
local m = wick.model("vit", { path = a.path, classes = 5 })
m:load(a.weights)
wick.core.gradients(m, a.batch, a.grads)
"""


@pytest.mark.parametrize("kind", ["vit", "clip"])
def test_classifier_gradients_match_pytorch(tmp_path, run_wick, kind):
    """The loss and every gradient of a head on the pooled features, against transformers + torch.nn.Linear."""
    torch.manual_seed(2)
    if kind == "vit":
        ref = spread(transformers.ViTModel(transformers.ViTConfig(**SIZES)))
        mean, std, prefix = [0.5] * 3, [0.5] * 3, "vit."
    else:
        ref = spread(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**SIZES)))
        mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
        prefix = "vision_model."
    ref.save_pretrained(tmp_path / "hf")
    head = torch.nn.Linear(32, 5)
    state = {prefix + k: v for k, v in load_file(tmp_path / "hf" / "model.safetensors").items()}
    state["classifier.weight"], state["classifier.bias"] = head.weight.detach(), head.bias.detach()
    save_file(state, tmp_path / "w.safetensors")
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    labels = torch.tensor([0, 3, 4, 1])
    save_file({"image": images, "label": labels}, tmp_path / "batch.safetensors")
    (tmp_path / "g.lua").write_text(GRAD_RECIPE)
    run_wick("run", tmp_path / "g.lua", f"path={tmp_path / 'hf'}", f"weights={tmp_path / 'w.safetensors'}",
             f"batch={tmp_path / 'batch.safetensors'}", f"grads={tmp_path / 'g.safetensors'}")
    g = load_file(tmp_path / "g.safetensors")
    ref.train()  # no dropout in these configs; train mode as wick's gradients run
    out = ref(pixel_values=pixels(images, mean, std))
    loss = torch.nn.functional.cross_entropy(head(out.pooler_output), labels)
    loss.backward()
    assert abs(g["loss"].item() - loss.item()) < 1e-5
    grads = {prefix + legacy(n): p.grad for n, p in ref.named_parameters() if p.grad is not None}
    grads["classifier.weight"], grads["classifier.bias"] = head.weight.grad, head.bias.grad
    # ViTModel's pooler is used by the pooled features; every trained tensor must match
    for n, want in grads.items():
        torch.testing.assert_close(g["grad." + n], want, rtol=1e-4, atol=1e-5, msg=n)
    assert set(k[5:] for k in g if k.startswith("grad.")) == set(grads)


def test_clip_vision_tower_matches_transformers(tmp_path, run_wick):
    torch.manual_seed(3)
    ref = spread(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**SIZES)).eval())
    ref.save_pretrained(tmp_path / "hf")
    images, labels, hidden, pooled, g = run(tmp_path, run_wick, tmp_path / "hf")
    out = ref(pixel_values=pixels(images, [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]))
    assert (hidden - out.last_hidden_state).abs().max().item() < 1e-4
    assert (pooled - out.pooler_output).abs().max().item() < 1e-4
    back, info = transformers.CLIPVisionModel.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_the_vision_tower_of_a_clip_model_folder(tmp_path, run_wick):
    torch.manual_seed(4)
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=99, hidden_size=24, intermediate_size=30, num_hidden_layers=2, num_attention_heads=2),
        vision_config=SIZES, projection_dim=16)
    ref = spread(transformers.CLIPModel(cfg).eval())
    ref.save_pretrained(tmp_path / "hf")
    images, labels, hidden, pooled, g = run(tmp_path, run_wick, tmp_path / "hf", save=False)
    out = ref.vision_model(pixel_values=pixels(images, [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]))
    assert (hidden - out.last_hidden_state).abs().max().item() < 1e-4
    assert (pooled - out.pooler_output).abs().max().item() < 1e-4


def test_wrong_image_size_is_a_clear_error(tmp_path, run_wick):
    save_file({"image": torch.zeros(1, 3, 20, 20, dtype=torch.uint8), "label": torch.tensor([0])}, tmp_path / "b.safetensors")
    (tmp_path / "e.lua").write_text(
        'local wick = require "wick"\n'
        'local m = wick.model("vit", { image_size = 16, patch_size = 4, hidden_size = 32, layers = 1, heads = 4, classes = 2 })\n'
        "wick.core.gradients(m, wick.args.batch, wick.args.out)\n")
    p = run_wick("run", tmp_path / "e.lua", f"batch={tmp_path / 'b.safetensors'}", f"out={tmp_path / 'o.safetensors'}",
                 check=False)
    assert p.returncode != 0
    assert "images are 20x20, the encoder expects 16x16" in p.stderr


INTERPOLATE = """
local wick = require "wick"
local a = wick.args
local m = wick.model("vit", { path = a.path, output = "hidden", interpolate_pos_encoding = true })
wick.core.predict(m, a.batch, a.hidden)
"""


@pytest.mark.parametrize("kind", ["vit", "clip"])
@pytest.mark.parametrize("size", [(24, 20), (16, 16), (12, 12)])
def test_interpolated_positions_match_transformers(tmp_path, run_wick, kind, size):
    """interpolate_pos_encoding = true: images of another size than the
    tower's (larger, non-square, smaller) give transformers' hidden states with
    interpolate_pos_encoding=True; the tower's own size is unchanged."""
    torch.manual_seed(2)
    if kind == "vit":
        ref = spread(transformers.ViTModel(transformers.ViTConfig(**SIZES)).eval())
        mean = std = [0.5] * 3
    else:
        ref = spread(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**SIZES)).eval())
        mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    ref.save_pretrained(tmp_path / "hf")
    images = torch.randint(0, 256, (2, 3, *size), dtype=torch.uint8)
    save_file({"image": images}, tmp_path / "batch.safetensors")
    (tmp_path / "r.lua").write_text(INTERPOLATE)
    run_wick("run", tmp_path / "r.lua", f"path={tmp_path / 'hf'}", f"batch={tmp_path / 'batch.safetensors'}",
             f"hidden={tmp_path / 'h.safetensors'}")
    got = load_file(tmp_path / "h.safetensors")["output"]
    with torch.no_grad():
        want = ref(pixel_values=pixels(images, mean, std), interpolate_pos_encoding=True).last_hidden_state
    assert got.shape == want.shape == (2, 1 + (size[0] // 4) * (size[1] // 4), 32)
    assert (got - want).abs().max().item() < 1e-4


PROFILED = """
local wick = require "wick"
local a = wick.args
local m = wick.model("vit", { path = a.path, output = "hidden", interpolate_pos_encoding = true })
wick.profile(function() wick.core.predict(m, a.batch, a.hidden) end, { trace = a.trace })
"""


@pytest.mark.parametrize("size", [(16, 16), (24, 20)])
def test_positions_are_resized_only_for_images_of_another_size(tmp_path, run_wick, size):
    """At the tower's own size the position table is used as it is: no
    bicubic pass in the forward (every forward resized it to its own size, a
    float copy and a kernel a chunk of frames on a GPU); at another size it
    is resized, as transformers does."""
    torch.manual_seed(3)
    ref = spread(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**SIZES)).eval())
    ref.save_pretrained(tmp_path / "hf")
    images = torch.randint(0, 256, (2, 3, *size), dtype=torch.uint8)
    save_file({"image": images}, tmp_path / "batch.safetensors")
    (tmp_path / "r.lua").write_text(PROFILED)
    run_wick("run", tmp_path / "r.lua", f"path={tmp_path / 'hf'}", f"batch={tmp_path / 'batch.safetensors'}",
             f"hidden={tmp_path / 'h.safetensors'}", f"trace={tmp_path / 'trace.json'}")
    ops = {e["name"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e.get("ph") == "X"}
    assert "aten::conv2d" in ops  # the trace holds the forward's operators
    assert ("aten::upsample_bicubic2d" in ops) == (size != (16, 16)), sorted(ops)
    mean, std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    with torch.no_grad():
        want = ref(pixel_values=pixels(images, mean, std), interpolate_pos_encoding=True).last_hidden_state
    assert (load_file(tmp_path / "h.safetensors")["output"] - want).abs().max().item() < 1e-4
