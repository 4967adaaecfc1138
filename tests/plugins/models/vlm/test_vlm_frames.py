"""vlm on clips `wick make-clips` writes, the vision tower trained: with
checkpointing and frame_chunk, the tower runs as one block per chunk of frames
(model.vision_tower.frames), so a step's tensor peak hardly grows with the
frame count beyond the input frames and the language model's tokens; with
every frame through the tower at once it grows with the tower's activations.
The figures are printed."""
import subprocess

import pytest

RECIPE = """
local wick = require "wick"
local a = wick.args
local T = tonumber(a.frames)
local data = wick.data("video_folder", { manifest = a.manifest, max_frames = T, image_size = 32, resize = "exact",
  tokenizer = "bytes", prompt = "<image>", text_length = 16 })
wick.seed(0)
local m = wick.model("vlm", { image_size = 32, patch_size = 8, vision_hidden_size = 64, vision_intermediate_size = 128,
  vision_layers = 2, vision_heads = 4, hidden_size = 32, intermediate_size = 64, layers = 1, heads = 2,
  frame_tokens = 1, frame_chunk = tonumber(a.chunk), freeze_vision = false, projector = "mlp2x_gelu",
  vision_style = "clip", image_token_id = data.image_token_id, vocab_size = data.vocab_size })
local run = wick.train { model = m, data = data, optim = wick.optim("sgd", { lr = 0.01 }), micro_batch = 2,
  max_steps = 2, checkpointing = true, shuffle = false, quiet = true, seed = 1 }
print(string.format("PEAK %d", run.memory.peak))
"""


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    from conftest import WICK
    d = tmp_path_factory.mktemp("clips")
    subprocess.run([WICK, "make-clips", str(d), "--classes", "2", "--per-class", "2", "--size", "64x48", "--seconds",
                    "1.4", "--no-extras", "--no-images"], check=True, capture_output=True)
    return d


def test_frames_in_chunks_keep_a_trained_towers_memory_flat(tmp_path, run_wick, clips):
    """From 8 to 32 frames (one visual token each), the peak grows by under a
    third of what it grows by without frame_chunk (the tower's blocks
    checkpointed one by one over every frame)."""
    (tmp_path / "m.lua").write_text(RECIPE)
    growth = {}
    for chunk in (0, 4):
        peak = {}
        for T in (8, 32):
            out = run_wick("run", tmp_path / "m.lua", f"manifest={clips / 'manifest.csv'}", f"frames={T}",
                           f"chunk={chunk}").stdout
            peak[T] = int([l for l in out.splitlines() if l.startswith("PEAK")][0].split()[1])
        growth[chunk] = peak[32] - peak[8]
        print(f"frame_chunk={chunk}: tensor peak 8 -> 32 frames {peak[8] / 2**20:.2f} -> {peak[32] / 2**20:.2f} MiB")
    assert 0 < growth[4] < growth[0] / 3, growth
