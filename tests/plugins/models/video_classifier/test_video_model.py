"""video_classifier on clips `wick make-clips` writes: the tensor peak of a
training run grows linearly with max_frames when the frame encoder runs on all
N x T frames at once, with and without checkpointing, and hardly grows with
frame_chunk under checkpointing (the trained encoder recomputed chunk by chunk);
the figures are printed."""
import json
import subprocess

import pytest

RECIPE = """
local wick = require "wick"
local a = wick.args
local T = tonumber(a.frames)
local data = wick.data("video_folder", { root = a.root, max_frames = T, image_size = 32 })
local m = wick.model("video_classifier", { classes = data.num_classes, image_size = 32, patch_size = 8, hidden_size = 64,
  intermediate_size = 128, layers = 2, heads = 4, temporal = "transformer", max_frames = T,
  frame_chunk = tonumber(a.chunk or 0) })
local run = wick.train { model = m, data = data, optim = wick.optim("sgd", { lr = 0.01 }), micro_batch = 2, max_steps = 2,
  checkpointing = a.ck == true or a.ck == "true", shuffle = false, quiet = true, seed = 1 }
print(string.format("PEAK %d %d", run.memory.peak, run.memory.activations))
"""


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    from conftest import WICK
    d = tmp_path_factory.mktemp("clips")
    subprocess.run([WICK, "make-clips", str(d), "--classes", "2", "--per-class", "2", "--size", "64x48", "--seconds", "1.4",
                    "--no-extras", "--no-images"], check=True, capture_output=True)
    return d


@pytest.mark.parametrize("checkpointing", [False, True])
def test_peak_memory_grows_linearly_with_max_frames(tmp_path, run_wick, clips, checkpointing):
    (tmp_path / "m.lua").write_text(RECIPE)
    peak = {}
    for T in (8, 16, 32):
        out = run_wick("run", tmp_path / "m.lua", f"root={clips / 'videos'}", f"frames={T}",
                       f"ck={str(checkpointing).lower()}").stdout
        line = [l for l in out.splitlines() if l.startswith("PEAK")][0]
        peak[T] = int(line.split()[1])
    print(f"checkpointing={checkpointing}: tensor peak max_frames 8/16/32 = " +
          " / ".join(f"{peak[T] / 2**20:.2f} MiB" for T in (8, 16, 32)))
    d1, d2 = peak[16] - peak[8], peak[32] - peak[16]
    assert 0 < d1 < d2
    assert 2 * d1 / 1.5 <= d2 <= 2 * d1 * 1.5, peak


def test_frames_in_chunks_keep_a_trained_encoders_memory_flat(tmp_path, run_wick, clips):
    """frame_chunk = 4 with checkpointing: each chunk of frames is one block
    (vit.frames), so the forward keeps only the input frames and a feature
    per frame, and the encoder runs again chunk by chunk in backward. From 8
    to 32 frames the peak grows by under a third of what it grows by with
    every frame through the encoder at once (checkpointing per block)."""
    (tmp_path / "m.lua").write_text(RECIPE)
    growth = {}
    for chunk in (0, 4):
        peak = {}
        for T in (8, 32):
            out = run_wick("run", tmp_path / "m.lua", f"root={clips / 'videos'}", f"frames={T}", "ck=true",
                           f"chunk={chunk}").stdout
            peak[T] = int([l for l in out.splitlines() if l.startswith("PEAK")][0].split()[1])
        growth[chunk] = peak[32] - peak[8]
        print(f"frame_chunk={chunk}: tensor peak 8 -> 32 frames {peak[8] / 2**20:.2f} -> {peak[32] / 2**20:.2f} MiB")
    assert 0 < growth[4] < growth[0] / 3, growth


PADDED = """
local wick = require "wick"
local a = wick.args
local m = wick.model("video_classifier", { classes = 3, image_size = 32, patch_size = 8, hidden_size = 64,
  intermediate_size = 128, layers = 2, heads = 4, temporal = a.temporal, max_frames = 8 })
wick.core.predict(m, a.dir .. "/batch.safetensors", a.dir .. "/out.safetensors")
for r = 0, 2 do wick.core.predict(m, a.dir .. "/clip" .. r .. ".safetensors", a.dir .. "/out" .. r .. ".safetensors") end
"""


@pytest.mark.parametrize("temporal", ["mean", "transformer"])
def test_padded_clips_equal_each_clip_alone(tmp_path, run_wick, temporal):
    """Clips of 5, 2 and 4 frames padded to 5 with noise and a frame_mask
    (video_folder's max_frames = 0): each row's logits equal the model's on
    that clip alone, unpadded; the padding reaches neither the frame mean nor
    the temporal attention."""
    import torch
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    counts = [5, 2, 4]
    video = torch.randint(0, 256, (3, 5, 3, 32, 32), dtype=torch.uint8)
    mask = torch.tensor([[1] * n + [0] * (5 - n) for n in counts])
    labels = torch.tensor([0, 1, 2])
    save_file({"video": video, "frame_mask": mask, "label": labels}, tmp_path / "batch.safetensors")
    for r, n in enumerate(counts):
        save_file({"video": video[r:r + 1, :n].contiguous(), "label": labels[r:r + 1]}, tmp_path / f"clip{r}.safetensors")
    (tmp_path / "p.lua").write_text(PADDED)
    run_wick("run", tmp_path / "p.lua", f"dir={tmp_path}", f"temporal={temporal}")
    got = load_file(tmp_path / "out.safetensors")["output"]
    for r in range(3):
        alone = load_file(tmp_path / f"out{r}.safetensors")["output"][0]
        assert (got[r] - alone).abs().max().item() < 1e-5, (r, got[r], alone)
    # the same padding read as real frames changes the answer: the mask is what keeps it out
    save_file({"video": video, "label": labels}, tmp_path / "batch.safetensors")
    run_wick("run", tmp_path / "p.lua", f"dir={tmp_path}", f"temporal={temporal}")
    unmasked = load_file(tmp_path / "out.safetensors")["output"]
    assert (unmasked[1] - got[1]).abs().max().item() > 1e-3


TRAIN = """
local wick = require "wick"
local a = wick.args
local data = wick.data("video_folder", { manifest = a.manifest, max_frames = 0, sampling = "stride", fps = 3,
  image_size = 32, resize = "exact" })
local m = wick.model("video_classifier", { classes = 2, image_size = 32, patch_size = 8, hidden_size = 32,
  intermediate_size = 64, layers = 1, heads = 2, temporal = "transformer", max_frames = 256,
  frame_chunk = tonumber(a.chunk or 0) })
m:save(a.init)
wick.train { model = m, data = data, optim = wick.optim("sgd", { lr = 0.1, momentum = 0.9 }), micro_batch = tonumber(a.micro),
  accumulate = tonumber(a.acc), max_steps = 2, shuffle = false, quiet = true, seed = 1, checkpointing = a.ck == "true" }
m:save(a.weights)
"""


@pytest.fixture(scope="module")
def extras(tmp_path_factory):
    from conftest import WICK
    d = tmp_path_factory.mktemp("extras")
    subprocess.run([WICK, "make-clips", str(d), "--classes", "1", "--per-class", "1", "--seconds", "2", "--no-images"],
                   check=True, capture_output=True)
    return d / "extras"


def test_all_frames_accumulate_to_the_large_batch(tmp_path, run_wick, extras):
    """video_folder with max_frames = 0 (clips of 1, 3, 6 and 180 frames at
    3 fps) trains video_classifier to the same weights whether the window is
    one micro-batch of 4 (padded to 180 frames) or 2 x 2 or 4 x 1 (padded
    less, or not at all), with and without checkpointing, and with the frames
    through the encoder 16 at a time (each chunk recomputed in backward)."""
    import torch
    from safetensors.torch import load_file
    ex = extras
    man = tmp_path / "m.csv"
    man.write_text("path,label\n" + "".join(f"{ex / f},{k % 2}\n" for k, f in
                                            enumerate(["short.mp4", "vfr.mp4", "bframes.mp4", "long.mp4"])))
    (tmp_path / "t.lua").write_text(TRAIN)
    weights = {}
    for micro, acc, ck, chunk in ((4, 1, "false", 0), (2, 2, "false", 0), (1, 4, "true", 0), (1, 4, "true", 16)):
        out = tmp_path / f"w{micro}-{chunk}.safetensors"
        run_wick("run", tmp_path / "t.lua", f"manifest={man}", f"micro={micro}", f"acc={acc}", f"ck={ck}", f"weights={out}",
                 f"init={tmp_path / 'init.safetensors'}", f"chunk={chunk}")
        weights[micro if not chunk else "chunked"] = load_file(out)
    weights["init"] = load_file(tmp_path / "init.safetensors")
    moved = 0
    for name, w in weights[4].items():
        moved += int((w - weights["init"][name]).abs().max().item() > 1e-4)
        for micro in (2, 1, "chunked"):
            o = weights[micro][name]
            assert (w - o).norm().item() <= 1e-5 * max(w.norm().item(), 1e-12) + 1e-7, (name, micro)
    assert len(weights[4]) > 10 and moved > 10
