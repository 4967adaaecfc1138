"""Deferred construction of the vision models (vit, clip, video_classifier):
their encoders built hollow, each rank of a shard = "parameters" run making
only its chunks, with the bits of a whole build (random values replayed part
by part from the generator states the build recorded, or a folder's tensors
read as the host makes them)."""
import subprocess

import pytest

from conftest import WICK  # tests/conftest.py
from test_shard import assert_same_entries

RECIPE = """
local wick = require "wick"
local a = wick.args
local kind = a.model
local data
if kind == "video_classifier" then
  data = wick.data("video_folder", { manifest = a.videos, max_frames = 2, image_size = 32, resize = "exact" })
else
  data = wick.data("image_folder", { manifest = a.images, image_size = 32, resize = "exact",
    tokenizer = kind == "clip" and "bytes" or nil, text_length = kind == "clip" and 24 or nil })
end
wick.seed(2)
local opts = { image_size = 32, patch_size = 8, hidden_size = 64, intermediate_size = 128, layers = 3, heads = 4,
  style = a.style or "vit", dtype = a.dtype or "fp32" }
if kind == "vit" then opts.pooler = true end
if kind == "clip" then opts.text_hidden_size, opts.text_intermediate_size, opts.text_layers, opts.projection_dim = 32, 64, 2, 16 end
if kind == "video_classifier" then opts.temporal, opts.max_frames = "transformer", 2 end
if a.path then  -- a folder: the frame encoder's for video_classifier, the model's for the others
  opts = { dtype = a.dtype or "fp32" }
  if kind == "video_classifier" then opts.vision_path = a.path else opts.path = a.path end
end
if kind ~= "clip" then opts.classes = data.num_classes end
opts.deferred = a.deferred == true
local m = wick.model(kind, opts)
local built = wick.memory(false).cpu_tensors
if a.save then wick.save_pretrained(m, a.save) return end
if a.kind then wick.optim(a.kind, a.kind == "qlora" and { r = 4, compute_dtype = "fp32" } or { r = 4 }):apply(m) end
local run = wick.train { model = m, data = data, optim = wick.optim("adamw", { lr = 0.01 }), micro_batch = 2,
  max_steps = 2, checkpointing = true, shuffle = false, quiet = true, seed = 1, shard = "parameters",
  precision = a.precision or "fp32", master_weights = a.masters == true }
if wick.rank == 0 then m:save(a.result) end
print(string.format("BUILT %d %d %.9f", wick.rank, built, run.final_loss))
"""

# the encoders' tensors (what a deferred build defers)
ENCODER = ("vit.", "vision_model.", "text_model.")


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    subprocess.run([WICK, "make-clips", str(d), "--classes", "2", "--per-class", "4", "--size", "64x48",
                    "--seconds", "0.4", "--no-extras"], check=True, capture_output=True)
    return d


@pytest.mark.parametrize("case", ["vit", "vit-clip-style-bf16-masters", "vit-folder", "vit-folder-qlora", "clip",
                                  "clip-folder", "video_classifier-folder-lora"])
def test_a_deferred_vision_model_is_made_divided_with_the_bits_of_a_whole_build(tmp_path, run_wick, media, case):
    """vit (ViT style with its pooler; CLIP style in bf16 with fp32 masters;
    a ViT folder, plain and under QLoRA: each layer quantized as its values
    are made), clip (both towers; a CLIPModel folder) and
    video_classifier (a frame encoder from a folder, under LoRA) with
    deferred = true, trained on 2 ranks under shard = "parameters": the
    trained model has the bits of the same run from a whole build, the
    losses are the same, and the deferred build holds none of the
    encoders' bytes but their norms."""
    kind = case.split("-")[0]
    common = [tmp_path / "v.lua", f"model={kind}", f"images={media / 'images' / 'manifest.csv'}",
              f"videos={media / 'manifest.csv'}"]
    (tmp_path / "v.lua").write_text(RECIPE)
    more = []
    if "clip-style" in case:
        more += ["style=clip", "dtype=bf16", "precision=bf16-true", "masters=true"]
    if "folder" in case:  # saved by a whole build of other random values, in bf16 as transformers saves
        folder_kind = "vit" if kind == "video_classifier" else kind
        run_wick("run", tmp_path / "v.lua", f"model={folder_kind}", f"images={media / 'images' / 'manifest.csv'}",
                 "dtype=bf16", f"save={tmp_path / 'hf'}")
        more.append(f"path={tmp_path / 'hf'}")
    if case.endswith("lora"):
        more.append("kind=" + case.split("-")[-1])

    def launch(deferred):
        p = run_wick("launch", "--nproc-per-node", 2, *common, *more, f"deferred={str(deferred).lower()}",
                     f"result={tmp_path / f'{deferred}.safetensors'}")
        assert "made whole" not in p.stderr, p.stderr  # (divided: never whole)
        out = p.stdout.replace("[rank 1] ", "")
        return {int(l.split()[1]): (int(l.split()[2]), l.split()[3]) for l in out.splitlines() if l.startswith("BUILT ")}
    whole, deferred = launch(False), launch(True)
    trained = assert_same_entries(tmp_path / "True.safetensors", tmp_path / "False.safetensors")
    assert [whole[r][1] for r in range(2)] == [deferred[r][1] for r in range(2)], (whole, deferred)
    encoder = sum(t.numel() * t.element_size() for k, t in trained.items()
                  if k.startswith(ENCODER) and "lora_" not in k and "norm" not in k)
    assert encoder > 0, sorted(trained)
    for r in range(2):
        # what a deferred build keeps of the encoders: their norms, the
        # generator's state before each part (5 KB a part) and, from a folder,
        # nothing of the file (mapped, read when the host makes a tensor)
        assert whole[r][0] - deferred[r][0] >= 0.9 * encoder, (case, r, whole[r], deferred[r], encoder)
    print(case, whole, deferred, encoder)
