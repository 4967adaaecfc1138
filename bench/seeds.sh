#!/usr/bin/env bash
# The seeds' workloads at their real shapes: makes the media once (still
# images, resized by the data sets to 224 and 336 px, and 4-second clips at
# 25 fps: 100 frames), then bench/seeds.lua measures each seed's optimizer
# step, per depth unit and extrapolated (full=000,004 also at full depth).
#   bench/seeds.sh [seeds=000,001,002,003,004] [full=000,004]
# WICK names the wick to run (default: this tree's build/bin/wick).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wick=${WICK:-$here/../build/bin/wick}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$wick" make-clips "$dir/clips" --per-class 8 --seconds 4 --fps 25 --no-extras >/dev/null
"$wick" run "$here/seeds.lua" clips="$dir/clips" "$@"
