#!/usr/bin/env bash
# Memory of a video LLM step against the frame count (bench/frames.lua), on
# clips of 100 frames that wick makes here.
#   bench/frames.sh [path/to/wick] [key=value ...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wick=$here/../build/bin/wick
if [ $# -gt 0 ] && [ "${1#*=}" = "$1" ]; then wick=$1; shift; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$wick" make-clips "$tmp/clips" --per-class 2 --seconds 4 --fps 25 --size 64x64 --no-extras --no-images >/dev/null
"$wick" run "$here/frames.lua" clips="$tmp/clips" "$@"
echo
"$wick" run "$here/frames.lua" clips="$tmp/clips" tower=trained "$@"
