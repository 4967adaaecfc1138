"""Fresh vision models start where transformers' do (issue 20: from-scratch
models initialise as their counterparts' _init_weights): a new wick `vit`
(ViTForImageClassification), `clip` (CLIPModel, with an initializer_factor)
and `vlm`'s projector, saved and loaded into transformers, hold parameters
whose mean and standard deviation match a fresh transformers model of the
same config, tensor by tensor (biases 0 and norms 1 exactly)."""
import json

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

VIT = """
local wick = require "wick"
wick.seed(5)
local m = wick.model("vit", { classes = 7, image_size = 64, patch_size = 8, hidden_size = 96, intermediate_size = 192,
  layers = 3, heads = 4 })
wick.save_pretrained(m, wick.args.out)
"""
CLIP = """
local wick = require "wick"
wick.seed(5)
local m = wick.model("clip", { image_size = 64, patch_size = 8, hidden_size = 96, intermediate_size = 192, layers = 3,
  heads = 4, vocab_size = 500, text_hidden_size = 64, text_intermediate_size = 128, text_layers = 4, text_heads = 4,
  projection_dim = 48, max_length = 32, eos_token_id = 499 })
wick.save_pretrained(m, wick.args.out)
"""
VLM = """
local wick = require "wick"
wick.seed(5)
local m = wick.model("vlm", { vision_hidden_size = 96, vision_intermediate_size = 192, vision_layers = 2,
  vision_heads = 4, image_size = 32, patch_size = 8, vocab_size = 300, hidden_size = 128, intermediate_size = 256,
  layers = 2, heads = 4 })
m:save(wick.args.out)
"""


def same_statistics(ours, theirs, what):
    checked = 0
    for name, r in theirs.items():
        if name not in ours or not r.is_floating_point():
            continue
        t, r = ours[name].float(), r.float()
        if r.numel() < 600:  # norms and biases: transformers' constants exactly
            if torch.all(r == r.flatten()[0]) and r.flatten()[0].item() in (0.0, 1.0):
                assert torch.equal(t, r), f"{what}: {name}"
            continue
        assert abs(t.std().item() - r.std().item()) < 0.06 * r.std().item(), \
            f"{what}: {name} std {t.std().item():.5f} against {r.std().item():.5f}"
        assert abs(t.mean().item() - r.mean().item()) < 0.1 * r.std().item(), f"{what}: {name}"
        checked += 1
    return checked


def fresh_state(model):
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_fresh_vit_matches_transformers(tmp_path, run_wick):
    (tmp_path / "r.lua").write_text(VIT)
    run_wick("run", tmp_path / "r.lua", f"out={tmp_path / 'vit'}")
    ours = fresh_state(transformers.ViTForImageClassification.from_pretrained(tmp_path / "vit"))
    cfg = transformers.ViTConfig.from_pretrained(tmp_path / "vit")
    torch.manual_seed(0)
    theirs = fresh_state(transformers.ViTForImageClassification(cfg))
    assert same_statistics(ours, theirs, "vit") >= 3 * 6 + 3


def test_fresh_clip_matches_transformers(tmp_path, run_wick):
    (tmp_path / "r.lua").write_text(CLIP)
    run_wick("run", tmp_path / "r.lua", f"out={tmp_path / 'clip'}")
    ours = fresh_state(transformers.CLIPModel.from_pretrained(tmp_path / "clip"))
    cfg = transformers.CLIPConfig.from_pretrained(tmp_path / "clip")
    torch.manual_seed(0)
    theirs = fresh_state(transformers.CLIPModel(cfg))
    # every block's q/k/v/out/fc1/fc2 (scaled by width and depth), embeddings, projections
    assert same_statistics(ours, theirs, "clip") >= (3 + 4) * 6 + 4


def test_fresh_vlm_projector_matches_llava(tmp_path, run_wick):
    (tmp_path / "r.lua").write_text(VLM)
    run_wick("run", tmp_path / "r.lua", f"out={tmp_path / 'vlm.safetensors'}")
    ours = load_file(tmp_path / "vlm.safetensors")
    vision = transformers.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=96, intermediate_size=192,
                                           num_hidden_layers=2, num_attention_heads=4)
    text = transformers.LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4)
    torch.manual_seed(0)
    theirs = fresh_state(transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=257)))
    proj = {k: v for k, v in theirs.items() if "multi_modal_projector" in k or "language_model" in k}
    assert same_statistics(ours, proj, "vlm") >= 2 + 2 * 7 + 1


VIDEO = """
local wick = require "wick"
wick.seed(5)
local m = wick.model("video_classifier", { classes = 40, image_size = 64, patch_size = 8, hidden_size = 96,
  intermediate_size = 192, layers = 2, heads = 4, temporal = "transformer", temporal_layers = 2, max_frames = 64,
  freeze_vision = false })
m:save(wick.args.out .. "/model.safetensors")
"""


def test_fresh_video_classifier_matches_vit_init(tmp_path, run_wick):
    """video_classifier's tower and temporal transformer start as a fresh
    transformers ViT's layers do (normal(0, 0.02), biases 0, norms 1), the
    temporal positions at normal(0, 0.02), the head as ViTForImageClassification's."""
    (tmp_path / "r.lua").write_text(VIDEO)
    run_wick("run", tmp_path / "r.lua", f"out={tmp_path}")
    ours = load_file(tmp_path / "model.safetensors")
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=64, patch_size=8, hidden_size=96, intermediate_size=192,
                                 num_hidden_layers=2, num_attention_heads=4, num_labels=40)
    theirs = fresh_state(transformers.ViTForImageClassification(cfg))
    # wick keeps ViTLayer's legacy names (those checkpoints on disk carry); transformers 5's own names here
    legacy = {"attention.attention.query": "attention.q_proj", "attention.attention.key": "attention.k_proj",
              "attention.attention.value": "attention.v_proj", "attention.output.dense": "attention.o_proj",
              "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2"}

    def renamed(state, prefix, to):
        out = {}
        for k, v in state.items():
            if not k.startswith(prefix):
                continue
            rest = k[len(prefix):]
            for old, new in legacy.items():
                if rest.startswith(old + "."):
                    rest = new + rest[len(old):]
            out[to + rest] = v
        return out

    head = {k: v for k, v in theirs.items() if k.startswith("classifier.")}
    assert same_statistics(ours, head, "head") == 1  # the weight; the bias is 0 exactly
    theirs = {k: v for k, v in theirs.items() if not k.startswith("classifier.")}
    checked = same_statistics(ours, theirs, "embeddings")
    for i in range(2):
        checked += same_statistics(renamed(ours, f"vit.encoder.layer.{i}.", f"vit.layers.{i}."), theirs, f"tower {i}")
    # each temporal layer against transformers' ViT's first layer
    layer = {k: v for k, v in theirs.items() if k.startswith("vit.layers.0.")}
    for i in range(2):
        mine = renamed(ours, f"temporal.layers.{i}.", "vit.layers.0.")
        assert set(mine) == set(layer)
        checked += same_statistics(mine, layer, f"temporal layer {i}")
    assert "classifier.weight" in ours and checked >= 20
    pos = ours["temporal.position_embeddings"]
    assert abs(pos.std().item() - 0.02) < 0.06 * 0.02
    torch.testing.assert_close(ours["temporal.layernorm.weight"], torch.ones(96), rtol=0, atol=0)
