"""video_classifier on clips `wick make-clips` writes: the tensor peak of a
training run grows linearly with max_frames (the frame encoder runs on all
N x T frames), with and without checkpointing; the figures are printed."""
import json
import subprocess

import pytest

RECIPE = """
local wick = require "wick"
local a = wick.args
local T = tonumber(a.frames)
local data = wick.data("video_folder", { root = a.root, max_frames = T, image_size = 32 })
local m = wick.model("video_classifier", { classes = data.num_classes, image_size = 32, patch_size = 8, hidden_size = 64,
  intermediate_size = 128, layers = 2, heads = 4, temporal = "transformer", max_frames = T })
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
