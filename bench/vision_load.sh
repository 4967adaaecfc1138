#!/usr/bin/env bash
# Loading a vision encoder's Hugging Face folder (CLIP ViT-L/14's tower, 303 M
# parameters, 606 MB in bf16) into the `vit` plugin, each load in its own
# process, OMP_NUM_THREADS=1: wall and CPU seconds, and the resident memory
# the load added at its peak and after it, with the tensors the model holds;
# given a second wick, the same for it, and the ratios.
#   bench/vision_load.sh [path/to/wick] [path/to/baseline-wick] [runs (3)]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wick=${1:-$here/../build/bin/wick}
base=${2:-}
runs=${3:-3}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export OMP_NUM_THREADS=1
"$wick" run "$here/vision_load.lua" mode=make dir="$dir/m" >/dev/null
mib() { echo "scale=1; $1 / 1048576" | bc -l; }
printf "folder: %s MiB\n" "$(mib "$(stat -c %s "$dir/m/model.safetensors")")"
printf "%-9s %4s %8s %8s %12s %12s %12s\n" wick run "wall s" "cpu s" "peak+ MiB" "after MiB" "tensors MiB"
declare -A best
row() {  # binary label
  local i t0 t1 out cpu peak after tensors wall
  for i in $(seq 1 "$runs"); do
    t0=$(date +%s.%N)
    out=$("$1" run "$here/vision_load.lua" mode=load dir="$dir/m" | sed -n 's/^RESULT //p')
    t1=$(date +%s.%N)
    read -r cpu peak after tensors <<<"$out"
    wall=$(echo "$t1 - $t0" | bc -l)
    printf "%-9s %4s %8.2f %8s %12s %12s %12s\n" "$2" "$i" "$wall" "$cpu" "$(mib "$peak")" "$(mib "$after")" "$(mib "$tensors")"
    if [ -z "${best[$2]:-}" ] || [ "$(echo "$wall < ${best[$2]%% *}" | bc -l)" = 1 ]; then best[$2]="$wall $peak"; fi
  done
}
row "$wick" this
if [ -n "$base" ]; then
  row "$base" baseline
  read -r tw tp <<<"${best[this]}"
  read -r bw bp <<<"${best[baseline]}"
  printf "best wall this/baseline %.2fx, its peak+ %.2fx\n" "$(echo "$tw / $bw" | bc -l)" "$(echo "$tp / $bp" | bc -l)"
fi
echo "wall: the whole process (start, the baseline model, the load); cpu s and peak+/after: the load alone."
