"""Broken media under both error policies: each bad file is named (once) and
skipped, or ends the run with its name; nothing crashes or hangs."""
import os
import struct
import subprocess
import zlib

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import WICK


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    subprocess.run([WICK, "make-clips", d / "clips", "--classes", "1", "--per-class", "1", "--seconds", "1",
                    "--no-images"], check=True, capture_output=True, timeout=300)
    good = d / "clips" / "extras" / "bframes.mp4"
    files = {}
    files["good"] = good
    (d / "empty.mp4").write_bytes(b"")
    files["empty"] = d / "empty.mp4"
    data = good.read_bytes()
    # MP4 keeps its index (moov) at the end: cut, nothing is readable
    (d / "truncated.mp4").write_bytes(data[: len(data) // 3])
    files["truncated"] = d / "truncated.mp4"
    rng = np.random.default_rng(0)
    (d / "random.mp4").write_bytes(rng.integers(0, 256, 50000, dtype=np.uint8).tobytes())
    files["random"] = d / "random.mp4"
    # an AVI whose header promises 50 frames, cut after about 20 of them
    avi = (d / "clips" / "extras" / "mpeg4.avi").read_bytes()
    (d / "overclaim.avi").write_bytes(avi[: int(len(avi) * 0.4)])
    files["overclaim"] = d / "overclaim.avi"
    subprocess.run(["ffmpeg", "-v", "error", "-f", "lavfi", "-i", "sine=duration=1", "-y", d / "audio.mp4"], check=True)
    files["audio"] = d / "audio.mp4"

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 16000, 16000, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"\x00" * 100)) + chunk(b"IEND", b"")
    (d / "huge.png").write_bytes(png)
    files["huge"] = d / "huge.png"
    files["missing"] = d / "no-such-file.mp4"
    return d, files


def run(tmp_path, body):
    r = tmp_path / "r.lua"
    r.write_text('local wick = require "wick"\n' + body)
    return subprocess.run([WICK, "run", r], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["empty", "truncated", "random", "overclaim", "audio", "huge", "missing"])
def test_each_bad_file(bad, tmp_path, name):
    d, files = bad
    path = files[name]
    plugin = "image_folder" if name == "huge" else "video_folder"
    key = "image" if name == "huge" else "video"
    man = tmp_path / "m.csv"
    man.write_text(f"path,label\n{path},1\n{files['good']},0\n")
    extra = "" if plugin == "image_folder" else ", max_frames = 8"
    # skip: the bad file is named once, counted, and replaced by the next sample
    p = run(tmp_path, f"""
local d = wick.data("{plugin}", {{ manifest = "{man}", image_size = 32{extra} }})
wick.save_samples(d, {{0, 0, 1}}, "{tmp_path / 's.safetensors'}")
print("skipped=" .. d.skipped_files)
""")
    assert p.returncode == 0, p.stderr
    if name == "overclaim":
        # what the file holds decodes: frames up to the cut, the last one repeated
        s = load_file(tmp_path / "s.safetensors")
        assert "skipped=0" in p.stdout, p.stderr
        assert s["0.label"] == 1 and s["0.video"].shape == (8, 3, 32, 32)
        assert s["0.frame_times"][-1] < 1.0
        return
    assert "skipped=1" in p.stdout
    assert p.stderr.count(str(path)) == 1, p.stderr  # named once, though read twice
    assert p.stderr.count("\n") == 1, p.stderr  # and nothing else: FFmpeg's own log stays quiet
    s = load_file(tmp_path / "s.safetensors")
    assert s["0.label"] == 0 and s["1.label"] == 0  # the good file stands in
    # fail: the run ends with the file's name
    p = run(tmp_path, f"""
local d = wick.data("{plugin}", {{ manifest = "{man}", image_size = 32, on_error = "fail"{extra} }})
wick.save_samples(d, {{0}}, "{tmp_path / 's.safetensors'}")
""")
    assert p.returncode == 1 and str(path) in p.stderr and "wick: error:" in p.stderr
    if name == "huge":
        assert "16000x16000" in p.stderr and "max_pixels" in p.stderr
    if name == "audio":
        assert "no video stream" in p.stderr


def test_time_limit(bad, tmp_path):
    d, files = bad
    man = tmp_path / "m.csv"
    man.write_text(f"path,label\n{d / 'clips' / 'extras' / 'long.mp4'},0\n")
    p = run(tmp_path, f"""
local d = wick.data("video_folder", {{ manifest = "{man}", max_frames = 64, image_size = 32, time_limit = 0.001, on_error = "fail" }})
wick.save_samples(d, {{0}}, "{tmp_path / 's.safetensors'}")
""")
    assert p.returncode == 1 and "time limit" in p.stderr and "long.mp4" in p.stderr


def test_all_bad_is_an_error_not_a_hang(bad, tmp_path):
    d, files = bad
    man = tmp_path / "m.csv"
    man.write_text("path,label\n" + "".join(f"{files[n]},0\n" for n in ("empty", "random", "missing")))
    p = run(tmp_path, f"""
local d = wick.data("video_folder", {{ manifest = "{man}", max_frames = 4, image_size = 32 }})
wick.save_samples(d, {{1}}, "{tmp_path / 's.safetensors'}")
""")
    assert p.returncode == 1 and "no file could be decoded" in p.stderr


def test_manifest_errors(tmp_path):
    (tmp_path / "m.csv").write_text("file,label\nx.mp4,0\n")
    p = run(tmp_path, f'wick.data("video_folder", {{ manifest = "{tmp_path / "m.csv"}" }})')
    assert p.returncode == 1 and "needs a 'path' column" in p.stderr and "m.csv:1" in p.stderr
    (tmp_path / "m.jsonl").write_text('{"path": "a.mp4"}\nnot json\n')
    p = run(tmp_path, f'wick.data("video_folder", {{ manifest = "{tmp_path / "m.jsonl"}" }})')
    assert p.returncode == 1 and "m.jsonl:2: not JSON" in p.stderr
    p = run(tmp_path, f'wick.data("video_folder", {{ root = "{tmp_path}" }})')
    assert p.returncode == 1 and "no clips found" in p.stderr
    p = run(tmp_path, 'wick.data("video_folder", { })')
    assert p.returncode == 1 and "either root" in p.stderr
