#!/usr/bin/env bash
# Gradient synchronisation across 2 gloo ranks on this machine: bytes each rank
# sends into collectives and wall time per optimizer step, synchronising every
# micro-batch (DDP without no_sync) against only at the window's boundary
# (wick's default), for accumulate 1, 4 and 16 and two bucket sizes.
#   bench/sync.sh [path/to/wick]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wick=${1:-$here/../build/bin/wick}
run() { "$wick" launch --nproc-per-node 2 "$here/sync.lua" "$@" | sed -n 's/^RESULT //p'; }
printf "decoder_lm 2 blocks, hidden 256 (1.7M parameters), micro-batch 4 x 64 tokens per rank, 2 gloo ranks\n"
printf "%-10s %-9s %16s %16s %9s %12s %12s %9s\n" accumulate bucket "bytes/step mb" "bytes/step win" ratio \
  "ms/step mb" "ms/step win" ratio
for bucket in 25 1; do
  for acc in 1 4 16; do
    read -r b_mb t_mb < <(run acc=$acc bucket_mb=$bucket sync=micro_batch)
    read -r b_w t_w < <(run acc=$acc bucket_mb=$bucket sync=window)
    printf "%-10s %-9s %16s %16s %8.2fx %12s %12s %8.2fx\n" "$acc" "${bucket} MiB" "$b_mb" "$b_w" \
      "$(echo "$b_mb / $b_w" | bc -l)" "$t_mb" "$t_w" "$(echo "$t_mb / $t_w" | bc -l)"
  done
done
echo "mb: sync every micro-batch; win: sync once per window (wick's default). Same weights either way."
