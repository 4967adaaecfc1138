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


PADDED = """
local wick = require "wick"
local a = wick.args
local data = wick.data("video_folder", { manifest = a.manifest, max_frames = 4, image_size = 32, resize = "exact",
  tokenizer = "bytes", prompt = "<image>", text_length = 64, pad_to_multiple_of = tonumber(a.pad) })
data:window(0, data:size(), 1):save(a.win)  -- the micro-batches of 1 the run steps through
wick.seed(0)
local m = wick.model("vlm", { image_size = 32, patch_size = 8, vision_hidden_size = 64, vision_intermediate_size = 128,
  vision_layers = 2, vision_heads = 4, hidden_size = 32, intermediate_size = 64, layers = 2, heads = 2,
  frame_tokens = 1, freeze_vision = false, projector = "mlp2x_gelu", vision_style = "clip",
  image_token_id = data.image_token_id, vocab_size = data.vocab_size })
local run = wick.train { model = m, data = data, optim = wick.optim("sgd", { lr = 0.1 }), micro_batch = 1,
  accumulate = 2, max_steps = 2, epochs = 2, shuffle = false, quiet = true, seed = 1 }
local losses = {}
for _, h in ipairs(run.history) do losses[#losses + 1] = string.format("%.9g", h.loss) end
print("LOSSES " .. table.concat(losses, " "))
m:save(a.weights)
"""


def test_padding_to_a_multiple_leaves_training_where_it_was(tmp_path, run_wick, clips):
    """pad_to_multiple_of = 32 pads every batch's captions to 32 tokens (they
    differ: 2 to 4 distinct lengths without it), after every real token: the
    causal language model's real positions and the loss are those of the
    unpadded batches, so the losses and the trained weights are the same."""
    import torch
    from safetensors.torch import load_file
    (tmp_path / "p.lua").write_text(PADDED)
    got = {}
    for pad in (1, 32):
        out = run_wick("run", tmp_path / "p.lua", f"manifest={clips / 'manifest.csv'}", f"pad={pad}",
                       f"weights={tmp_path / f'w{pad}.safetensors'}", f"win={tmp_path / f'b{pad}.safetensors'}").stdout
        batches = load_file(tmp_path / f"b{pad}.safetensors")
        lengths = [t.shape[1] for k, t in sorted(batches.items()) if k.endswith(".input_ids")]
        losses = [float(x) for l in out.splitlines() if l.startswith("LOSSES") for x in l.split()[1:]]
        got[pad] = lengths, losses
    assert len(set(got[1][0])) > 1 and max(got[1][0]) < 32, got[1][0]  # the captions differ, under 32
    assert set(got[32][0]) == {32}, got[32][0]
    assert len(got[1][1]) == len(got[32][1]) == 2
    for a, b in zip(got[1][1], got[32][1]):
        assert abs(a - b) <= 1e-5 * abs(a), (got[1][1], got[32][1])
    w1, w32 = load_file(tmp_path / "w1.safetensors"), load_file(tmp_path / "w32.safetensors")
    assert w1.keys() == w32.keys()
    worst = max((w1[k] - w32[k]).abs().max().item() for k in w1)
    print("losses", got[1][1], got[32][1], "largest weight difference", worst)
    assert worst <= 1e-6, worst
