"""The vlm learns to caption the toy images `wick make-clips` writes ("a red
circle"): its loss on the captions falls well below that of the same language
model trained on the captions alone (which cannot see colour or shape), its
captions of held-out images are well-formed, name the colour nearly always and
the shape more often than chance (1 in 3): a vision tower trained from scratch
on 420 tiny pictures generalises shape only so far."""
import csv
import re
import subprocess

import pytest

from conftest import WICK

MAX_RATIO = 0.5  # vlm loss over the text-only loss: see the test

RECIPE = """
local wick = require "wick"
local a = wick.args
local function data(m) return wick.data("image_folder", { manifest = m, image_size = 32, resize = "exact",
  tokenizer = "bytes", prompt = "<image>", text_length = 32 }) end
local train, test = data(a.train), data(a.test)
local lm = { vocab_size = train.vocab_size, hidden_size = 64, intermediate_size = 128, layers = 2, heads = 4 }
local seed = tonumber(a.seed or 1)
local function train_on(model, d)
  wick.seed(seed)
  -- warmup, cosine and clipping: without them, 2 of 8 runs (seeds 1-4, avx2
  -- and avx512) ended far from the others (the loss ratio 0.51 and 0.59)
  wick.train { model = model, data = d, optim = wick.optim("adamw", { lr = 1e-3, weight_decay = 0 }),
    micro_batch = 16, epochs = tonumber(a.epochs), quiet = true, seed = seed, schedule = "cosine", warmup_steps = 50,
    clip_grad_norm = 1.0 }
  return wick.evaluate(model, d).loss
end
wick.seed(seed)
local vlm_opts = { image_token_id = train.image_token_id, image_size = 32, patch_size = 4, vision_hidden_size = 64,
  vision_intermediate_size = 128, vision_layers = 2, vision_heads = 4, freeze_vision = false, vision_feature_layer = -1 }
for k, v in pairs(lm) do vlm_opts[k] = v end
local vlm = wick.model("vlm", vlm_opts)
print("vlm_loss", train_on(vlm, train))
for i = 0, test:size() - 1 do
  local ids = vlm:generate(test:window(i, 1), { max_new_tokens = 24, eos_id = test.eos_id })
  print("caption", i, test:decode(ids))
end
for i = 0, 29 do
  local ids = vlm:generate(train:window(i, 1), { max_new_tokens = 24, eos_id = train.eos_id })
  print("seen", i, train:decode(ids))
end
-- the baseline: the same language model on the captions alone
local text = wick.data("text", { file = a.captions, max_length = 32, cache_dir = "none" })
print("text_loss", train_on(wick.model("decoder_lm", lm), text))
"""


def train_and_caption(tmp_path, seed=1):
    """The recipe above on clips make-clips writes: (vlm loss, text-only loss,
    captions of the held-out images, their true captions, every row)."""
    d = tmp_path / "clips"
    subprocess.run([WICK, "make-clips", d, "--classes", "3", "--per-class", "160", "--size", "64x48", "--seconds",
                    "0.2", "--no-extras"], check=True, capture_output=True, timeout=600)
    with open(d / "images" / "manifest.csv") as f:
        rows = list(csv.DictReader(f))
    held = [r for i, r in enumerate(rows) if i % 8 == 0]
    rest = [r for i, r in enumerate(rows) if i % 8 != 0]
    for name, part in (("train.csv", rest), ("test.csv", held)):
        with open(d / "images" / name, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["path", "label", "text"])
            w.writeheader()
            w.writerows(part)
    # the baseline's samples: the same tokens after the picture (a one-byte prompt stands in for it)
    import json
    with open(tmp_path / "captions.jsonl", "w") as f:
        for r in rest:
            f.write(json.dumps({"prompt": "?", "completion": r["text"]}) + "\n")
    (tmp_path / "r.lua").write_text(RECIPE)
    p = subprocess.run([WICK, "run", tmp_path / "r.lua", f"train={d / 'images' / 'train.csv'}",
                        f"test={d / 'images' / 'test.csv'}", f"captions={tmp_path / 'captions.jsonl'}", "epochs=30",
                        f"seed={seed}"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    vlm = float(re.search(r"vlm_loss\s+(\S+)", out).group(1))
    text = float(re.search(r"text_loss\s+(\S+)", out).group(1))
    captions = dict((int(i), c) for i, c in re.findall(r"caption\s+(\d+)\s+(.*)", out))
    seen = dict((int(i), c) for i, c in re.findall(r"seen\s+(\d+)\s+(.*)", out))
    return (vlm, text, [captions[i] for i in range(len(held))], [r["text"] for r in held], rows,
            [seen[i] for i in range(30)], [r["text"] for r in rest[:30]])


def test_vlm_learns_captions_and_names_held_out_shapes(tmp_path):
    vlm, text, captions, truth, rows, _, _ = train_and_caption(tmp_path)
    print(vlm, text, captions)
    # The bounds come from runs over seeds 1-5 with ATEN_CPU_CAPABILITY=avx2
    # and the default (avx512) on an Intel Xeon (docs/design/tests.md, "Tests on other
    # CPUs"): the loss ratio 0.26-0.36, colours 29-30 of 30, shapes 15-21 of
    # 30 (chance: 10); an AMD EPYC (Zen 4) gave the same ranges on 2026-11-28.
    # Before warmup and clipping, one AMD EPYC run measured a ratio of 0.511 and
    # the Xeon 0.59 with avx2, against a bound of 0.5.
    assert vlm < MAX_RATIO * text, (vlm, text, vlm / text)
    colours = {r["text"].split()[1] for r in rows}
    shapes = {r["text"].split()[-1] for r in rows}
    shape_right = colour_right = 0
    for c, t in zip(captions, truth):
        words = c.split()
        assert len(words) == 3 and words[0] in ("a", "an") and words[1] in colours and words[2] in shapes, c
        colour_right += words[1] == t.split()[1]
        shape_right += words[2] == t.split()[-1]
    # a colour is in every pixel of the shape: seen in nearly every picture
    assert colour_right >= 0.8 * len(truth), (colour_right, captions, truth)
    # a shape from 420 tiny pictures generalises only so far: above chance (1 in 3)
    assert shape_right >= 0.4 * len(truth), (shape_right, captions, truth)


ALL_FRAMES = """
local wick = require "wick"
local a = wick.args
local data = wick.data("video_folder", { manifest = a.manifest, max_frames = 0, sampling = "stride", fps = 3,
  image_size = 32, resize = "exact", tokenizer = "bytes", prompt = "<image>", text_length = 24 })
wick.seed(1)
local m = wick.model("vlm", { image_token_id = data.image_token_id, vocab_size = data.vocab_size, image_size = 32,
  patch_size = 8, vision_hidden_size = 32, vision_intermediate_size = 64, vision_layers = 1, vision_heads = 2,
  vision_feature_layer = -1, hidden_size = 32, intermediate_size = 64, layers = 1, heads = 2, freeze_vision = false,
  frame_tokens = 4,
  time_pool = 2, frame_chunk = 16 })
m:save(a.init)
wick.train { model = m, data = data, optim = wick.optim("sgd", { lr = 0.5, momentum = 0.9 }),
  micro_batch = tonumber(a.micro), accumulate = tonumber(a.acc), max_steps = 2, shuffle = false, quiet = true, seed = 1,
  checkpointing = a.ck == "true" }
m:save(a.weights)
local ids = m:generate(data:window(1, 1), { max_new_tokens = 4, eos_id = data.eos_id })
print("generated", #ids)
"""


def test_clips_of_all_their_frames_accumulate_to_the_large_batch(tmp_path):
    """video_folder with max_frames = 0 and captions (clips of 1, 3, 6 and 180
    frames at 3 fps, so 4 to 360 visual tokens each) trains the vlm, tower
    included, to the same weights as one micro-batch of 4 whether the window
    is 2 x 2 or 4 x 1 with checkpointing; generation from a padded clip runs.
    (SGD: with AdamW the tower's position table ended 4e-5 apart relative to
    its norm, the rounding of sums taken in another order, which Adam's
    division by each gradient's own size enlarges.)"""
    import torch
    from safetensors.torch import load_file
    d = tmp_path / "clips"
    subprocess.run([WICK, "make-clips", d, "--classes", "1", "--per-class", "1", "--seconds", "2", "--no-images"],
                   check=True, capture_output=True, timeout=600)
    man = tmp_path / "m.csv"
    rows = [("short.mp4", "three frames"), ("vfr.mp4", "a clip of changing pace"), ("bframes.mp4", "two seconds"),
            ("long.mp4", "one minute of shapes")]
    man.write_text("path,label,text\n" + "".join(f"{d / 'extras' / f},0,{t}\n" for f, t in rows))
    (tmp_path / "r.lua").write_text(ALL_FRAMES)
    weights = {}
    for micro, acc, ck in ((4, 1, "false"), (2, 2, "false"), (1, 4, "true")):
        out = tmp_path / f"w{micro}.safetensors"
        p = subprocess.run([WICK, "run", tmp_path / "r.lua", f"manifest={man}", f"micro={micro}", f"acc={acc}", f"ck={ck}",
                            f"weights={out}", f"init={tmp_path / 'init.safetensors'}"],
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        assert re.search(r"generated\s+\d+", p.stdout), p.stdout
        weights[micro] = load_file(out)
    init = load_file(tmp_path / "init.safetensors")
    moved = 0
    for name, w in weights[4].items():
        moved += int((w - init[name]).abs().max().item() > 1e-5)
        for micro in (2, 1):
            o = weights[micro][name]
            assert (w - o).norm().item() <= 1e-5 * max(w.norm().item(), 1e-12) + 1e-7, (name, micro, (w - o).norm().item(), (w - init[name]).norm().item())
    assert moved > 30, (moved, len(weights[4]))
    tower = [n for n in weights[4] if n.startswith("model.vision_tower.")]
    assert any((weights[4][n] - init[n]).abs().max().item() > 1e-4 for n in tower)
