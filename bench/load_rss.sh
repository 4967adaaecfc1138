#!/usr/bin/env bash
# Host memory while loading a bf16 Hugging Face folder into decoder_lm, each
# load in its own process: the resident memory the load added at its peak
# (VmHWM less the resident memory just before), over the folder's size, for a
# full load and for QLoRA (quantized while loading), against the goals
# (full: at most 1.2x the file; qlora: at most the loaded model's size plus
# two of the file's largest tensors) and, given a second wick, against it.
# Then the folder built deferred on 2 ranks (QLoRA, shard = "parameters", one
# step): each rank's resident peak and CPU seconds, each rank making only its
# chunks (a 4-bit layer quantized only where the rank keeps its codes).
#   bench/load_rss.sh [path/to/wick] [path/to/baseline-wick] [shape: qwen0.5b|small]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wick=${1:-$here/../build/bin/wick}
base=${2:-}
shape=${3:-qwen0.5b}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
read -r size < <("$wick" run "$here/load_rss.lua" mode=make dir="$dir/m" shape="$shape" | sed -n 's/^RESULT //p')
# the largest tensor: the embedding, vocab x hidden in bf16
case $shape in qwen0.5b) largest=$((151936 * 896 * 2)) ;; *) largest=$((32000 * 512 * 2)) ;; esac
mib() { echo "scale=1; $1 / 1048576" | bc -l; }
printf "folder: %s MiB (%s), largest tensor %s MiB\n" "$(mib "$size")" "$shape" "$(mib "$largest")"
printf "%-12s %-9s %12s %12s %12s %8s %10s %6s\n" mode wick "peak+ MiB" "after MiB" "goal MiB" "peak/file" "peak/goal" ok
row() {  # binary label mode
  local out peak after held goal ok
  out=$("$1" run "$here/load_rss.lua" mode="$3" dir="$dir/m" 2>/dev/null | sed -n 's/^RESULT //p') || true
  if [ -z "$out" ]; then printf "%-12s %-9s %12s\n" "$3" "$2" "n/a"; return; fi
  read -r peak after held <<<"$out"
  if [ "$3" = full ]; then goal=$(echo "$size * 1.2" | bc -l); else goal=$((held + 2 * largest)); fi
  ok=$(echo "$peak <= $goal" | bc -l); [ "$ok" = 1 ] && ok=yes || ok=NO
  printf "%-12s %-9s %12s %12s %12s %8.2fx %9.2fx %6s\n" "$3" "$2" "$(mib "$peak")" "$(mib "$after")" "$(mib "${goal%.*}")" \
    "$(echo "$peak / $size" | bc -l)" "$(echo "$peak / $goal" | bc -l)" "$ok"
}
for mode in full qlora qlora_after; do
  row "$wick" this "$mode"
  [ -n "$base" ] && row "$base" baseline "$mode"
done
printf "\n%-12s %-9s %6s %12s %8s\n" mode wick rank "peak+ MiB" "cpu s"
drow() {  # binary label
  local out
  out=$(OMP_NUM_THREADS=1 "$1" launch --nproc-per-node 2 "$here/load_rss.lua" mode=deferred dir="$dir/m" out="$dir/run" \
    2>/dev/null | sed -n 's/^\(\[rank [0-9]*\] \)\{0,1\}DEFERRED //p') || true
  rm -rf "$dir/run"
  if [ -z "$out" ]; then printf "%-12s %-9s %6s\n" deferred "$2" "n/a"; return; fi
  echo "$out" | sort -n | while read -r rank peak cpu; do
    printf "%-12s %-9s %6s %12s %8s\n" deferred "$2" "$rank" "$(mib "$peak")" "$cpu"
  done
}
drow "$wick" this
[ -n "$base" ] && drow "$base" baseline
echo "peak+: VmHWM less VmRSS before the load (LibTorch and the plugin already in); after: VmRSS less the same."
echo "goal: full 1.2 x the file; qlora: the loaded model (NF4 linear weights, the rest bf16) + 2 x the largest tensor."
