#!/usr/bin/env bash
# Sharding across gloo ranks on this machine: per-rank peak bytes held by
# tensors (weights, gradients, optimizer state, activations), bytes each rank
# sends per optimizer step and time per step, for shard = optimizer,
# gradients and parameters against none, at 2 and 3 ranks, in one run. The
# largest rank's figures; "state" is gradients + optimizer (what ZeRO-1 and 2
# divide), "w+g+o" weights + gradients + optimizer (what ZeRO-3 divides).
# "state" counts the fp32 master copies too with precision=bf16-true masters=true.
# "run peak": the rank's peak over the whole run, its start (the model moved
# and divided) and end (gathered back) included, which the steps' peak is not.
#   bench/shard.sh [path/to/wick] [key=value ...]   (steps=, layers=, hidden=, optim=, precision=, masters=)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wick=$here/../build/bin/wick
if [ $# -gt 0 ] && [ "${1#*=}" = "$1" ]; then wick=$1; shift; fi
mib() { echo "scale=1; $1 / 1048576" | bc; }
precision=fp32; masters=""
for kv in "$@"; do case $kv in precision=*) precision=${kv#precision=} ;; masters=true) masters=", fp32 masters" ;; esac; done
printf "decoder_lm 6 blocks, hidden 512 (19.2M parameters), micro-batch 2 x 256 tokens x accumulate 2 per rank, AdamW, %s%s, cpu\n" \
  "$precision" "$masters"
printf "%-6s %-10s %10s %9s %9s %9s %9s %9s %8s %9s %8s %12s %8s %9s %8s %10s %9s\n" ranks shard "peak MiB" weights masters grads \
  optim "state" ratio "w+g+o" ratio "sent/step MB" ratio "ms/step" ratio "loss" "run peak"
for n in 2 3; do
  base_state=""; base_all=""; base_sent=""; base_ms=""
  for shard in none optimizer gradients parameters; do
    out=$("$wick" launch --nproc-per-node "$n" "$here/shard.lua" shard=$shard "$@" | sed -n 's/^\(\[rank [0-9]*\] \)\{0,1\}RESULT //p')
    # the rank with the largest gradients + optimizer state + masters
    read -r _ peak w g o _ sent ms loss m rp _ < <(echo "$out" | awk '{print $0, $4 + $5 + $10}' | sort -k12 -n | tail -1)
    state=$((g + o + m)); all=$((w + g + o))
    base_state=${base_state:-$state}; base_all=${base_all:-$all}; base_sent=${base_sent:-$sent}; base_ms=${base_ms:-$ms}
    printf "%-6s %-10s %10s %9s %9s %9s %9s %9s %7.3fx %9s %7.3fx %12s %7.3fx %9s %7.2fx %10s %9s\n" "$n" "$shard" "$(mib "$peak")" \
      "$(mib "$w")" "$(mib "$m")" "$(mib "$g")" "$(mib "$o")" "$(mib "$state")" "$(echo "$state / $base_state" | bc -l)" \
      "$(mib "$all")" "$(echo "$all / $base_all" | bc -l)" \
      "$(echo "scale=2; $sent / 1000000" | bc)" "$(echo "$sent / $base_sent" | bc -l)" "$ms" \
      "$(echo "$ms / $base_ms" | bc -l)" "$loss" "$(mib "$rp")"
  done
done
echo "peak, weights (masters included), masters, grads, optim: MiB held by tensors at the step's peak on the rank holding the most state (CPU"
echo "figures: a CUDA run adds the context and the allocator's cache). sent: bytes per step as ring algorithms send them."
