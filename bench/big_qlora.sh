#!/usr/bin/env bash
# Models bigger than one card (issue 38's measurement): LLaMA-2-13B and -70B
# QLoRA r8 at their real widths, on one rank (shard = "none") and on 2 gloo
# ranks with shard = "parameters" (the NF4 base divided too), at k and 2k
# layers, each figure extrapolated per layer to the full depth (40 and 80
# layers), as bench/seeds.sh does. For the rank holding the most: the step's
# peak (bytes held by tensors) with its weights, the bytes held once the model
# is built (whole, on every rank), and the peaks while the run starts (the
# model divided) and ends (gathered back). A start or end peak is the larger of
# its per-layer extrapolation and the model as built: at a few layers the
# division's peak comes where the embeddings are divided, at the full depth
# where it begins, with the whole model held. Goals: 13B under 8 GiB a rank (a pair of 8 GB cards), 70B under 24 GiB
# (Answer.AI's FSDP + QLoRA on two 24 GB cards).
# shard "deferred": "parameters" with the model built deferred (deferred =
# true): no weights until the trainer divides it, each rank making its chunks,
# and the run ending in a file (return_weights = "file": the weights written
# a unit at a time by rank 0, never gathered back whole).
# The divided rows need k of 4 or more: a rank holds two or three units
# gathered at once (the first block's, kept to its backward's end, and the
# next one prefetched), which fewer layers would extrapolate as every layer's.
#   bench/big_qlora.sh [path/to/wick] [models=13b,70b] [k=4] [seq=512] [setups=none,parameters,deferred]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wick=$here/../build/bin/wick
if [ $# -gt 0 ] && [ "${1#*=}" = "$1" ]; then wick=$1; shift; fi
models=13b,70b; k=4; seq=512; setups=none,parameters,deferred
for kv in "$@"; do
  case $kv in models=*) models=${kv#models=} ;; k=*) k=${kv#k=} ;; seq=*) seq=${kv#seq=} ;;
    setups=*) setups=${kv#setups=} ;;
    *) echo "big_qlora.sh: unknown argument $kv (models=, k=, seq=, setups=)" >&2; exit 2 ;; esac
done
gib() { echo "scale=2; $1 / 1073741824" | bc; }
# value at `full` layers from the values at k and 2k
extra() { echo "$1 + ($3 - $k) * ($2 - $1) / $k" | bc; }
max() { if [ "$1" -ge "$2" ]; then echo "$1"; else echo "$2"; fi; }
printf "LLaMA-2 QLoRA r8 (all linear layers), NF4 base, 8-bit AdamW, bf16-mixed, checkpointing, micro-batch 1 x %s tokens, cpu\n" "$seq"
printf "%-5s %-6s %-12s %10s %10s %10s %10s %10s %10s %8s\n" model ranks shard "step GiB" weights "built GiB" "start GiB" "end GiB" "run GiB" "s/step"
for model in ${models//,/ }; do
  full=40; goal=8; [ "$model" = 70b ] && { full=80; goal=24; }
  for shard in ${setups//,/ }; do
    n=2; [ "$shard" = none ] && n=1
    opts=(shard=$shard); tmp=""
    if [ "$shard" = deferred ]; then tmp=$(mktemp -d); opts=(shard=parameters deferred=true "out=$tmp/run"); fi
    declare -A v=()
    for layers in $k $((2 * k)); do
      if [ "$n" = 1 ]; then
        out=$("$wick" run "$here/big_qlora.lua" model=$model layers=$layers seq=$seq "${opts[@]}")
      else
        out=$("$wick" launch --nproc-per-node "$n" "$here/big_qlora.lua" model=$model layers=$layers seq=$seq "${opts[@]}")
      fi
      # the rank with the highest run peak
      read -r _ _ peak w _ _ _ start end run secs built < <(echo "$out" | sed -n 's/^\(\[rank [0-9]*\] \)\{0,1\}RESULT //p' |
        sort -k9 -n | tail -1 | sed 's/^/x /')
      v[$layers]="$peak $w $start $end $run $secs $built"
      [ -n "$tmp" ] && rm -rf "$tmp/run"
    done
    [ -n "$tmp" ] && rm -rf "$tmp"
    read -r p1 w1 s1 e1 r1 t1 b1 <<<"${v[$k]}"
    read -r p2 w2 s2 e2 r2 t2 b2 <<<"${v[$((2 * k))]}"
    built=$(extra "$b1" "$b2" $full); step=$(extra "$p1" "$p2" $full)
    start=$(max "$(extra "$s1" "$s2" $full)" "$built"); end=$(max "$(extra "$e1" "$e2" $full)" "$built")
    printf "%-5s %-6s %-12s %10s %10s %10s %10s %10s %10s %8s\n" "$model" "$n" "$shard" "$(gib "$step")" \
      "$(gib "$(extra "$w1" "$w2" $full)")" "$(gib "$built")" "$(gib "$start")" "$(gib "$end")" \
      "$(gib "$(max "$(max "$step" "$start")" "$end")")" "$(echo "scale=1; $t1 + ($full - $k) * ($t2 - $t1) / $k" | bc)"
    unset v
  done
  echo "  goal for $model on 2 ranks: under $goal GiB each"
done
echo "Figures at $full layers are extrapolated per layer from $k and $((2 * k)); CPU figures (bytes held by tensors):"
echo "a GPU adds the CUDA context and the allocator's cache. built: the model as the recipe built it (whole on every"
echo "rank; deferred: hollow); start: dividing it (deferred: each rank making its chunks); end: the weights gathered"
echo "back whole, as wick.train returns them (deferred: written to out/model.safetensors a unit at a time)."
