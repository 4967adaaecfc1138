"""Python decoders doing what bench/media.lua times in wick: 16 frames at
uniform times (the frame on screen at (k + 0.5) * duration / 16), resized to
224 x 224 (bilinear), as uint8 RGB; per clip with one decoding thread, and a
loader epoch over all clips with 2 worker processes (torch DataLoader).
Prints one JSON line per (library, test)."""
import json
import math
import sys
import time

import numpy as np
import torch

T, S = 16, 224


def times_of(duration):
    return [(k + 0.5) * duration / T for k in range(T)]


def pyav(path):
    """Seek to the keyframe before each time unless it is close ahead, decode
    forward to the first frame past it, keep the one before."""
    import av
    with av.open(path) as c:
        st = c.streams.video[0]
        st.thread_type = "NONE"
        st.thread_count = 1
        tb = float(st.time_base)
        dur = float(st.duration * st.time_base) if st.duration else c.duration / 1e6
        out, held, pending, frames = [], None, None, None
        for t in times_of(dur):
            target = int(t / tb)
            last = pending if pending is not None else held
            if frames is None or last is None or last.pts > target or (target - last.pts) * tb > 1.0:
                c.seek(target, stream=st, backward=True, any_frame=False)
                frames, held, pending = c.decode(st), None, None
            while True:
                f = pending if pending is not None else next(frames, None)
                pending = None
                if f is None or f.pts > target:
                    pending = f
                    break
                held = f
            pick = held if held is not None else pending
            out.append(pick.reformat(width=S, height=S, format="rgb24", interpolation="BILINEAR").to_ndarray())
        return np.stack(out).transpose(0, 3, 1, 2)


def decord_(path):
    import decord
    vr = decord.VideoReader(path, width=S, height=S, num_threads=1)
    fps = vr.get_avg_fps()
    n = len(vr)
    idx = [min(n - 1, int(math.floor(t * fps))) for t in times_of(n / fps)]
    return vr.get_batch(idx).asnumpy().transpose(0, 3, 1, 2)


def torchcodec_(path, seek_mode="exact"):
    """seek_mode "exact" scans the whole file first to index every frame;
    "approximate" trusts the container's metadata (what a user picks for
    speed, and the analogue of wick reading the MP4 index)."""
    from torchcodec.decoders import VideoDecoder
    from torchcodec.transforms import Resize
    d = VideoDecoder(path, num_ffmpeg_threads=1, seek_mode=seek_mode, transforms=[Resize(size=(S, S))])
    dur = d.metadata.duration_seconds
    return d.get_frames_played_at(times_of(dur)).data.numpy()


def torchcodec_approx(path):
    return torchcodec_(path, seek_mode="approximate")


LIBS = {"pyav": pyav, "decord": decord_, "torchcodec": torchcodec_, "tc_approx": torchcodec_approx}


class Clips(torch.utils.data.Dataset):
    def __init__(self, fn, paths):
        self.fn, self.paths = fn, paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return torch.from_numpy(np.ascontiguousarray(self.fn(self.paths[i])))


def main():
    mode, lib, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    fn = LIBS[lib]
    if mode == "clip":
        fn(paths[0])  # warm up: imports, first open
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for p in paths:
                v = fn(p)
                assert v.shape == (T, 3, S, S), v.shape
            best = min(best, time.perf_counter() - t0)
        print(json.dumps({"lib": lib, "frames_per_s": T * len(paths) / best}))
    else:
        dl = torch.utils.data.DataLoader(Clips(fn, paths), batch_size=1, num_workers=2, prefetch_factor=2)
        t0 = time.perf_counter()
        n = sum(b.shape[0] for b in dl)
        dt = time.perf_counter() - t0
        print(json.dumps({"lib": lib, "frames_per_s": T * n / dt}))


if __name__ == "__main__":
    main()
