#!/usr/bin/env bash
# The seeds' workloads at their real shapes: makes the media once (still
# images, resized by the data sets to 224 and 336 px, and 4-second clips at
# 25 fps: 100 frames), then bench/seeds.lua measures each seed's optimizer
# step, with every tower at k layers and each at 2k (k=2 unless k= says), extrapolated per layer
# (full=004 also at full depth; check=000 checks the extrapolation in fp32).
#   bench/seeds.sh [seeds=000,001,002,003,004] [full=004] [check=000] [k=2]
# WICK names the wick to run (default: this tree's build/bin/wick).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wick=${WICK:-$here/../build/bin/wick}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# 72 still images (a window of 2 x 16 for seed 002, twice), 144 clips of 100 frames
"$wick" make-clips "$dir/clips" --classes 6 --per-class 24 --size 64x48 --seconds 4 --fps 25 --no-extras >/dev/null
"$wick" run "$here/seeds.lua" clips="$dir/clips" "$@"
