#!/usr/bin/env bash
# The seeds' workloads at their real shapes: makes the media once (still
# images, resized by the data sets to 224 and 336 px, and 4-second clips at
# 25 fps: 100 frames), then bench/seeds.lua measures each seed's optimizer
# step, with every tower at k layers and each at 2k (k=2 unless k= says), extrapolated per layer
# (full=004 also at full depth; check=000 checks the extrapolation in fp32).
# device=cuda runs them on the GPU (5 steps a run: the media for 5 windows of
# seed 002's 2 x 16 images), with the allocator's reserve, the process's
# device memory and seconds per step beside the peak.
#   bench/seeds.sh [seeds=000,001,002,003,004] [full=004] [check=000] [k=2] [device=cpu|cuda]
# WICK names the wick to run (default: this tree's build/bin/wick); SEEDS_MEDIA
# a folder to keep the media in (made there when it has none; default: a
# temporary folder, removed at the end).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wick=${WICK:-$here/../build/bin/wick}
per_class=24  # 72 still images (a window of 2 x 16 for seed 002, twice), 144 clips of 100 frames
for arg in "$@"; do
  case $arg in device=cuda*) per_class=56 ;; esac  # 168 images (5 windows of 32 and more), 336 clips
done
if [ -n "${SEEDS_MEDIA:-}" ]; then
  dir=$SEEDS_MEDIA
  mkdir -p "$dir"
else
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
fi
if [ ! -f "$dir/clips/manifest.csv" ] || [ ! -f "$dir/clips/images/manifest.csv" ]; then
  rm -rf "$dir/clips"
  "$wick" make-clips "$dir/clips" --classes 6 --per-class $per_class --size 64x48 --seconds 4 --fps 25 --no-extras >/dev/null
fi
"$wick" run "$here/seeds.lua" clips="$dir/clips" "$@"
