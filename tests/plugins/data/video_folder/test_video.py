"""video_folder and image_folder against the ffmpeg command line: the frames
wick picks are the ones the sampling rule picks from ffprobe's own frame
timestamps, and their pixels equal ffmpeg's decoding of the same frame with
the same crop and scale (bilinear), on constant and variable frame rate
clips, several codecs and containers, rotation metadata, short clips; bad
files are skipped or fatal by policy with their names; randomness is seeded."""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import WICK


def run_lua(tmp_path, body, check=True):
    recipe = tmp_path / "r.lua"
    recipe.write_text('local wick = require "wick"\n' + body)
    p = subprocess.run([WICK, "run", recipe], capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(p.stderr)
    return p


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    subprocess.run([WICK, "make-clips", d, "--classes", "3", "--per-class", "2", "--seconds", "2"], check=True,
                   capture_output=True, timeout=600)
    return d


def probe(path):
    out = subprocess.run(["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_entries",
                          "stream=width,height,start_time,duration:format=duration", "-of", "json", path],
                         capture_output=True, text=True, check=True).stdout
    j = json.loads(out)
    st = j["streams"][0]
    dur = float(st["duration"]) if st.get("duration") not in (None, "N/A") else float(j["format"]["duration"])
    pts = subprocess.run(["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_entries", "frame=pts_time",
                          "-of", "csv=p=0", path], capture_output=True, text=True, check=True).stdout.split()
    return float(st.get("start_time", 0) or 0), dur, sorted(float(x.strip(",")) for x in pts)


def ffmpeg_frame(path, t, vf, w, h):
    """The frame at presentation time t (ffmpeg: the first frame at or after
    an accurate input seek), filtered, as 3 x h x w RGB."""
    raw = subprocess.run(["ffmpeg", "-v", "error", "-ss", f"{max(0.0, t - 1e-4):.6f}", "-i", path, "-frames:v", "1",
                          "-vf", vf, "-pix_fmt", "gbrp", "-f", "rawvideo", "-"], capture_output=True, check=True).stdout
    assert len(raw) == w * h * 3, (len(raw), path, t)
    g, b, r = np.frombuffer(raw, np.uint8).reshape(3, h, w)  # planar G, B, R
    return np.stack([r, g, b])


def samples(tmp_path, opts, indices=(0,), epoch=0, seed=0):
    out = tmp_path / "s.safetensors"
    run_lua(tmp_path, f"""
local d = wick.data("video_folder", {opts})
wick.save_samples(d, {{{", ".join(map(str, indices))}}}, "{out}", {{ epoch = {epoch}, seed = {seed} }})
""")
    return load_file(out)


def manifest_of(tmp_path, files):
    m = tmp_path / "m.csv"
    m.write_text("path,label\n" + "".join(f"{f},0\n" for f in files))
    return m


def close(a, b, name):
    d = np.abs(a.astype(int) - b.astype(int))
    # bit-equal in practice; rotated clips differ by 1 in a few pixels (ffmpeg
    # turns the picture before scaling it, wick after)
    assert d.max() <= 1 and d.mean() < 0.01, (name, d.mean(), d.max())


EXTRAS = ["bframes.mp4", "vfr.mp4", "mpeg4.avi", "mjpeg.mkv", "vp9.webm", "rotated.mp4", "short.mp4"]


@pytest.mark.parametrize("clip", EXTRAS)
def test_uniform_frames_equal_ffmpeg(clips, tmp_path, clip):
    path = clips / "extras" / clip
    if not path.exists():
        pytest.skip(f"{clip} was not written (no encoder)")
    T, S = 8, 96
    s = samples(tmp_path, f'{{ manifest = "{manifest_of(tmp_path, [path])}", max_frames = {T}, image_size = {S}, '
                          f'resize = "exact" }}')
    video, times = s["0.video"], s["0.frame_times"]
    assert video.shape == (T, 3, S, S) and video.dtype == np.uint8
    start, dur, pts = probe(path)
    # the rule, from ffprobe's timestamps: the last frame at or before each uniform time
    want = []
    for k in range(T):
        t = start + (k + 0.5) * dur / T
        before = [p for p in pts if p <= t + 1e-9]
        want.append(before[-1] if before else pts[0])
    np.testing.assert_allclose(times, want, atol=1e-6)
    for k in range(T):
        ref = ffmpeg_frame(path, times[k], f"scale={S}:{S}:flags=bilinear", S, S)
        close(video[k], ref, f"{clip} frame {k}")


@pytest.mark.parametrize("clip", ["vfr.mp4", "bframes.mp4"])
def test_stride_and_random_segment(clips, tmp_path, clip):
    path = clips / "extras" / clip
    start, dur, pts = probe(path)
    man = manifest_of(tmp_path, [path])
    # stride 3 at 10 fps from the start: times k * 0.3, the frame on screen then
    s = samples(tmp_path, f'{{ manifest = "{man}", max_frames = 6, image_size = 64, resize = "exact", '
                          f'sampling = "stride", stride = 3, fps = 10 }}')
    want = []
    for k in range(6):
        t = min(start + k * 0.3, start + dur - 0.5 / 25)
        want.append([p for p in pts if p <= t + 1e-9][-1])
    np.testing.assert_allclose(s["0.frame_times"], want, atol=1e-6)
    # random_segment: one frame inside each of T equal segments, seeded
    opts = f'{{ manifest = "{man}", max_frames = 5, image_size = 64, resize = "exact", sampling = "random_segment" }}'
    a = samples(tmp_path, opts, epoch=0)
    b = samples(tmp_path, opts, epoch=0)
    c = samples(tmp_path, opts, epoch=1)
    np.testing.assert_array_equal(a["0.video"], b["0.video"])
    assert not np.array_equal(a["0.frame_times"], c["0.frame_times"])
    for s_, times in ((a, a["0.frame_times"]), (c, c["0.frame_times"])):
        for k, t in enumerate(times):
            seg0, seg1 = start + k * dur / 5, start + (k + 1) * dur / 5
            # the frame on screen at a time inside the segment: it starts before the segment ends
            assert t < seg1 + 1e-9 and (t >= seg0 - 1e-9 or [p for p in pts if p <= seg0 + 1e-9][-1] == t)
        close(s_["0.video"][2], ffmpeg_frame(path, times[2], "scale=64:64:flags=bilinear", 64, 64), f"{clip} segment 2")


def test_crop_and_resize_modes(clips, tmp_path):
    path = clips / "extras" / "bframes.mp4"  # 160 x 120
    man = manifest_of(tmp_path, [path])
    base = f'manifest = "{man}", max_frames = 3'
    s = samples(tmp_path, f'{{ {base}, image_size = 96, resize = "shorter_side", crop = "center" }}')
    t = s["0.frame_times"]
    for k in range(3):  # shorter side 120 -> 96: the centre 120 x 120, scaled
        close(s["0.video"][k], ffmpeg_frame(path, t[k], "crop=120:120:20:0,scale=96:96:flags=bilinear", 96, 96), "center")
    s = samples(tmp_path, f'{{ {base}, image_size = 80, resize = "letterbox" }}')
    v = s["0.video"]  # 160 x 120 fit into 80 x 80: 80 x 60, black bars of 10 above and below
    assert (v[:, :, :10, :] == 0).all() and (v[:, :, 70:, :] == 0).all()
    close(v[1, :, 10:70, :], ffmpeg_frame(path, s["0.frame_times"][1], "scale=80:60:flags=bilinear", 80, 60), "letterbox")
    s = samples(tmp_path, f'{{ {base}, image_size = 64, resize = "shorter_side", crop = "none" }}')
    assert s["0.video"].shape == (3, 3, 64, 85)
    # random_resized: seeded, varies with the epoch, a part of the frame
    o = f'{{ {base}, image_size = 64, crop = "random_resized", flip = true }}'
    a, b, c = samples(tmp_path, o), samples(tmp_path, o), samples(tmp_path, o, epoch=3)
    np.testing.assert_array_equal(a["0.video"], b["0.video"])
    assert not np.array_equal(a["0.video"], c["0.video"])
    assert a["0.video"].shape == (3, 3, 64, 64)


def test_flip_mirrors(clips, tmp_path):
    path = clips / "extras" / "bframes.mp4"
    man = manifest_of(tmp_path, [path] * 8)
    plain = samples(tmp_path, f'{{ manifest = "{man}", max_frames = 2, image_size = 64, resize = "exact" }}', range(8))
    flip = samples(tmp_path, f'{{ manifest = "{man}", max_frames = 2, image_size = 64, resize = "exact", flip = true }}',
                   range(8))
    mirrored = [np.array_equal(flip[f"{i}.video"], plain[f"{i}.video"][..., ::-1]) for i in range(8)]
    same = [np.array_equal(flip[f"{i}.video"], plain[f"{i}.video"]) for i in range(8)]
    assert all(m or s for m, s in zip(mirrored, same)) and any(mirrored) and any(same)


def test_long_clip_decodes_a_fraction(clips, tmp_path):
    """16 frames of a 60 s clip (1500 frames, a keyframe every 12): seeks to
    the keyframe before each wanted frame and decodes forward from there."""
    path = clips / "extras" / "long.mp4"
    p = run_lua(tmp_path, f"""
local d = wick.data("video_folder", {{ manifest = "{manifest_of(tmp_path, [path])}", max_frames = 16, image_size = 64 }})
wick.save_samples(d, {{0}}, "{tmp_path / 's.safetensors'}")
print(d.frames_decoded, d.frames_returned, d.seeks)
""")
    decoded, returned, seeks = map(int, p.stdout.split())
    assert returned == 16 and seeks >= 15 and decoded <= 16 * 12
    s = load_file(tmp_path / "s.safetensors")
    start, dur, pts = probe(path)
    assert s["0.frame_times"][-1] > 55 and s["0.video"].shape == (16, 3, 64, 64)


def test_folder_per_class_and_manifests(clips, tmp_path):
    p = run_lua(tmp_path, f"""
local v = wick.data("video_folder", {{ root = "{clips / 'videos'}", max_frames = 4, image_size = 32 }})
local m = wick.data("video_folder", {{ manifest = "{clips / 'manifest.csv'}", max_frames = 4, image_size = 32 }})
local j = wick.data("video_folder", {{ manifest = "{clips / 'manifest.jsonl'}", max_frames = 4, image_size = 32 }})
local i = wick.data("image_folder", {{ root = "{clips / 'images'}", image_size = 32 }})
print(v:size(), v.num_classes, v.classes, m:size(), m.num_classes, j:size(), i:size(), i.num_classes)
wick.save_samples(i, {{0, 2}}, "{tmp_path / 'i.safetensors'}")
""")
    v, vc, classes, m, mc, j, i, ic = p.stdout.split()
    assert (v, vc, m, mc, j, ic) == ("6", "3", "6", "3", "6", "3") and int(i) >= 3
    assert classes == "circle,square,triangle"
    s = load_file(tmp_path / "i.safetensors")
    assert s["0.image"].shape == (3, 32, 32) and s["0.image"].dtype == np.uint8


def test_sharding_sees_each_clip_once_per_epoch(clips, tmp_path):
    """Two ranks, the loader's shards: every clip once per epoch, across ranks."""
    out = tmp_path / "w"
    out.mkdir()
    recipe = tmp_path / "shard.lua"
    recipe.write_text(f"""
local wick = require "wick"
local d = wick.data("video_folder", {{ root = "{clips / 'videos'}", max_frames = 2, image_size = 32 }})
local loader = wick.loader(d, {{ micro_batch = 1, accumulate = 1, shuffle = true, seed = 5, workers = 2 }})
for epoch = 0, 1 do
  loader:start_epoch(epoch, 0)
  local k = 0
  while true do
    local w = loader:next()
    if not w then break end
    w:save(string.format("{out}/r%d-e%d-%d.safetensors", wick.rank, epoch, k))
    k = k + 1
  end
end
""")
    p = subprocess.run([WICK, "launch", "--nproc-per-node", "2", recipe], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    for epoch in (0, 1):
        seen = {0: [], 1: []}
        for f in out.glob(f"r*-e{epoch}-*.safetensors"):
            rank = int(f.name[1])
            seen[rank] += [int(x) for k, v in load_file(f).items() if k.endswith(".index") for x in v.ravel()]
        assert sorted(seen[0] + seen[1]) == list(range(6)), seen
        assert len(seen[0]) == len(seen[1]) == 3


def test_all_frames_at_the_stride(clips, tmp_path):
    """max_frames = 0: every stride-th frame of each clip, as many as it holds
    (the frames ffprobe lists, at the clip's rate or resampled to fps); a
    batch pads the shorter clips with black frames (frame_times -1) to the
    longest and frame_mask marks the real ones; the pixels are ffmpeg's."""
    ex = clips / "extras"
    files = [ex / "short.mp4", ex / "bframes.mp4", ex / "vfr.mp4"]
    man = manifest_of(tmp_path, files)
    out = tmp_path / "w.safetensors"
    opts = f'{{ manifest = "{man}", max_frames = 0, sampling = "stride", image_size = 48, resize = "exact" }}'
    run_lua(tmp_path, f'local d = wick.data("video_folder", {opts})\nd:window(0, 3, 3):save("{out}")\n')
    w = load_file(out)
    probes = [probe(f) for f in files]
    counts = [len(pts) for _, _, pts in probes]  # constant-rate clips: every frame
    assert counts[:2] == [3, 50]
    mask = w["0.frame_mask"]
    T = mask.shape[1]
    assert w["0.video"].shape == (3, T, 3, 48, 48) and w["0.frame_times"].shape == (3, T)
    for r in range(2):  # short.mp4 and bframes.mp4: each of their frames, in order
        n = counts[r]
        assert mask[r].tolist() == [1] * n + [0] * (T - n)
        np.testing.assert_allclose(w["0.frame_times"][r, :n], probes[r][2], atol=1e-6)
        assert (w["0.video"][r, n:] == 0).all() and (w["0.frame_times"][r, n:] == -1).all()
    for k in (0, 2):
        close(w["0.video"][0, k], ffmpeg_frame(files[0], w["0.frame_times"][0, k], "scale=48:48:flags=bilinear", 48, 48),
              f"short.mp4 frame {k}")
    close(w["0.video"][1, 37], ffmpeg_frame(files[1], w["0.frame_times"][1, 37], "scale=48:48:flags=bilinear", 48, 48),
          "bframes.mp4 frame 37")
    n = int(mask[2].sum())
    assert 0 < n <= T and T == max(counts[1], n)

    # the variable-rate clip resampled: every 3rd frame at 10 fps, k x 0.3 s up to its end, the frame on screen
    s = samples(tmp_path, f'{{ manifest = "{manifest_of(tmp_path, [files[2]])}", max_frames = 0, image_size = 48, '
                          f'sampling = "stride", stride = 3, fps = 10 }}')
    start, dur, pts = probes[2]
    want = [[p for p in pts if p <= start + k * 0.3 + 1e-9][-1] for k in range(100) if k * 0.3 < dur]
    np.testing.assert_allclose(s["0.frame_times"], want, atol=1e-6)
    # random_start: a seeded start within the first stride, then the same step
    man = manifest_of(tmp_path, files)
    o = f'{{ manifest = "{man}", max_frames = 0, image_size = 32, sampling = "stride", stride = 5, random_start = true }}'
    a, b = samples(tmp_path, o, (1,), epoch=0), samples(tmp_path, o, (1,), epoch=0)
    np.testing.assert_array_equal(a["1.frame_times"], b["1.frame_times"])
    starts = {float(samples(tmp_path, o, (1,), epoch=e)["1.frame_times"][0]) for e in range(4)}
    assert len(starts) > 1 and all(t < 5 / 25 + 1e-9 for t in starts)


def test_all_frames_refusals(clips, tmp_path):
    """max_frames = 0 without stride sampling is refused when the data is
    made; a clip with more than 4096 frames at the stride is named."""
    man = manifest_of(tmp_path, [clips / "extras" / "long.mp4"])
    p = run_lua(tmp_path, f'wick.data("video_folder", {{ manifest = "{man}", max_frames = 0 }})', check=False)
    assert p.returncode != 0 and "max_frames = 0" in p.stderr and 'sampling = "stride"' in p.stderr
    assert 'got sampling = "uniform"' in p.stderr and "Traceback" not in p.stderr
    p = run_lua(tmp_path, f'local d = wick.data("video_folder", {{ manifest = "{man}", max_frames = 0, sampling = "stride", '
                          f'fps = 100, image_size = 16, on_error = "fail" }})\nwick.save_samples(d, {{0}}, "{tmp_path / "x"}")',
                check=False)
    assert p.returncode != 0 and "long.mp4" in p.stderr and "holds 6000 frames at stride 1" in p.stderr, p.stderr
    assert not (tmp_path / "x").exists()
    p = run_lua(tmp_path, f'wick.data("video_folder", {{ manifest = "{man}", max_frames = -1 }})', check=False)
    assert p.returncode != 0 and "max_frames" in p.stderr
