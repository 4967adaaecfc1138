#!/usr/bin/env bash
# Frames per second for 16 uniformly sampled frames resized to 224 x 224 from
# 720p H.264 clips of 10 s and 60 s (wick make-clips writes them), per clip
# with one decoding thread and as a loader epoch with 2 workers: wick against
# PyAV, decord and torchcodec (seek_mode "exact", which scans the whole file
# first, and "approximate", which trusts the container's metadata) doing the
# same work in the same run; "best other" is the fastest of them all.
#   bench/media.sh [clips per length, default 3]
set -euo pipefail
cd "$(dirname "$0")/.."
WICK=${WICK:-build/bin/wick}
PY=${WICK_PYTHON:-${WICK_DEPS:-$HOME/.cache/wick}/venv/bin/python}
N=${1:-3}
DIR=${WICK_BENCH_CLIPS:-${TMPDIR:-/tmp}/wick-bench-clips}
for secs in 10 60; do
  if [ ! -f "$DIR/s$secs/manifest.csv" ]; then
    "$WICK" make-clips "$DIR/s$secs" --classes 1 --per-class "$N" --size 1280x720 --seconds "$secs" --fps 30 \
      --no-extras --no-images >/dev/null
  fi
done
printf '%-28s %10s %10s %10s %10s %10s %10s\n' "test" "wick" "pyav" "decord" "tc exact" "tc approx" "best other"
for secs in 10 60; do
  man=$DIR/s$secs/manifest.csv
  # the epoch: the clips 4 times over (12 samples for 3 clips), so that
  # starting the workers is not most of it
  { head -1 "$man"; for _ in 1 2 3 4; do tail -n +2 "$man"; done; } > "$DIR/s$secs/epoch.csv"
  for mode in clip epoch; do
    m=$man; [ $mode = epoch ] && m=$DIR/s$secs/epoch.csv
    mapfile -t files < <(tail -n +2 "$m" | cut -d, -f1 | sed "s|^|$DIR/s$secs/|")
    declare -A fps=()
    fps[wick]=$("$WICK" run bench/media.lua mode=$mode manifest="$m" | "$PY" -c 'import json,sys; print("%.1f" % json.load(sys.stdin)["frames_per_s"])')
    for lib in pyav decord torchcodec tc_approx; do
      fps[$lib]=$("$PY" bench/media.py $mode $lib "${files[@]}" 2>/dev/null | "$PY" -c 'import json,sys; print("%.1f" % json.load(sys.stdin)["frames_per_s"])' || echo "n/a")
    done
    best=$(printf '%s\n' "${fps[pyav]}" "${fps[decord]}" "${fps[torchcodec]}" "${fps[tc_approx]}" | grep -v n/a | sort -g | tail -1)
    label="$mode, ${secs} s 720p (fps)"
    printf '%-28s %10s %10s %10s %10s %10s %10s\n' "$label" "${fps[wick]}" "${fps[pyav]}" "${fps[decord]}" "${fps[torchcodec]}" \
      "${fps[tc_approx]}" "$best"
    printf '%-28s %10s %10s %10s %10s %10s %10s\n' "  wick / each" "1.00x" \
      "$("$PY" -c "print('%.2fx' % (${fps[wick]} / ${fps[pyav]}))" 2>/dev/null || echo n/a)" \
      "$("$PY" -c "print('%.2fx' % (${fps[wick]} / ${fps[decord]}))" 2>/dev/null || echo n/a)" \
      "$("$PY" -c "print('%.2fx' % (${fps[wick]} / ${fps[torchcodec]}))" 2>/dev/null || echo n/a)" \
      "$("$PY" -c "print('%.2fx' % (${fps[wick]} / ${fps[tc_approx]}))" 2>/dev/null || echo n/a)" \
      "$("$PY" -c "print('%.2fx' % (${fps[wick]} / $best))" 2>/dev/null || echo n/a)"
    unset fps
  done
done
