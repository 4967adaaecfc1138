#!/usr/bin/env bash
# Fine-tuning a decoder language model (6 blocks, hidden 512, 256 tokens, 4
# sequences per step, AdamW) fully, with LoRA and with QLoRA: tokens per
# second and peak memory for wick and for Python transformers + PEFT on the
# same model, each row in its own process, with the ratio wick / Python.
#   bench/lm_finetune.sh [path/to/wick] [path/to/python] [device=cpu|cuda] [steps=N] [micro=4] [seq=256]
#     [hidden=512] [inter=1408] [layers=6] [heads=8] [vocab=257] [peak_flops=989e12]
# device=cuda: both sides in bf16 autocast over fp32 weights (wick's
# bf16-mixed, torch.autocast), 12 steps of which the first warms up, each
# step timed to the device's end and tokens/s from the median step; peak: the caching allocator's most allocated
# bytes (wick's run.memory.peak, torch.cuda.max_memory_allocated), reserved:
# its most reserved, device: the process's device memory (context included),
# and the model FLOPs utilisation against peak_flops (989e12: H100 SXM's dense
# bf16), with model FLOPs per target token (N: the weights of the matmuls,
# the blocks' and the head's, the embedding lookup not counted; L layers,
# width d, T tokens a sequence):
#   full: 6 N + 12 L d T;  lora, qlora: 4 N + 6 (adapter weights) + 12 L d T
# (frozen weights: forward and the gradient of their input, not of themselves).
# Each row also prints a line `LM mode=... wick_tps=... python_tps=...`.
# LM_TIMEOUT: seconds one side of a row may take (default 600).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wick=$here/../build/bin/wick
python=${WICK_DEPS:-$HOME/.cache/wick/venv}/bin/python
case ${1:-} in ""|*=*) ;; *) wick=$1; shift ;; esac
case ${1:-} in ""|*=*) ;; *) python=$1; shift ;; esac
device=cpu steps="" micro=4 seq=256 hidden=512 inter=1408 layers=6 heads=8 vocab=257 peak_flops=989e12
for kv in "$@"; do
  case $kv in
    device=*|steps=*|micro=*|seq=*|hidden=*|inter=*|layers=*|heads=*|vocab=*|peak_flops=*) declare "$kv" ;;
    *) echo "lm_finetune.sh: unknown argument '$kv'" >&2; exit 2 ;;
  esac
done
cuda=false
case $device in cuda*) cuda=true ;; esac
[ -z "$steps" ] && { $cuda && steps=12 || steps=6; }
shape=(steps=$steps micro=$micro seq=$seq hidden=$hidden inter=$inter layers=$layers heads=$heads vocab=$vocab)
pyshape=(--steps $steps --micro $micro --seq $seq --hidden $hidden --inter $inter --layers $layers --heads $heads --vocab $vocab)
tmo=${LM_TIMEOUT:-600}

# field KEY LINE: the value of KEY=... in a RESULT line (n/a when absent)
field() { local v; v=$(sed -n "s/.*\b$1=\([^ ]*\).*/\1/p" <<<"$2"); echo "${v:-n/a}"; }
mib() { [[ $1 =~ ^[0-9]+$ ]] && awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }' || echo n/a; }
ratio() { [[ $1 =~ ^[0-9.]+$ && $2 =~ ^[0-9.]+$ ]] && awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "n/a" }' || echo n/a; }
# model FLOPs per target token (see above); $1: mode, $2: trainable weights (lora, qlora: the adapters)
flops_per_token() {
  awk -v m="$1" -v tr="$2" -v L="$layers" -v d="$hidden" -v f="$inter" -v V="$vocab" -v T="$seq" 'BEGIN {
    N = L * (4 * d * d + 3 * d * f) + d * V; att = 12 * L * d * T
    if (m == "full") printf "%.6e", 6 * N + att; else printf "%.6e", 4 * N + 6 * tr + att }'
}
mfu() {  # $1 tokens/s, $2 FLOPs per token
  [[ $1 =~ ^[0-9.]+$ ]] && $cuda && awk -v t="$1" -v f="$2" -v p="$peak_flops" 'BEGIN { printf "%.1f%%", 100 * t * f / p }' || echo n/a
}

echo "lm_finetune on $device: hidden $hidden, $layers layers, MLP $inter, vocab $vocab, $micro x $seq tokens a step, $steps steps"
printf "%-6s %12s %12s %7s | %11s %11s %7s | %11s %11s | %11s %11s | %11s %11s | %7s %7s\n" mode "wick tok/s" "py tok/s" ratio \
  "wick peak" "py peak" ratio "wick resv" "py resv" "wick dev" "py dev" "wick RSS" "py RSS" "wick MFU" "py MFU"
for mode in full lora qlora; do
  w=$(timeout "$tmo" "$wick" run "$here/lm_finetune.lua" mode=$mode device=$device "${shape[@]}" 2>&1)
  w_line=$(grep '^RESULT ' <<<"$w" | tail -1)
  [ -z "$w_line" ] && echo "wick $mode: no result: $(tail -3 <<<"$w" | tr '\n' ' ')" >&2
  p=$(OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)} timeout "$tmo" "$python" "$here/lm_finetune.py" $mode --device $device "${pyshape[@]}" 2>&1)
  p_line=$(grep '^RESULT ' <<<"$p" | tail -1)
  [ -z "$p_line" ] && echo "python $mode: no result: $(tail -3 <<<"$p" | tr '\n' ' ')" >&2
  w_tps=$(field tps "$w_line"); p_tps=$(field tps "$p_line")
  w_peak=$(field peak "$w_line"); p_peak=$(field peak "$p_line")
  fw=$(flops_per_token $mode "$(field trainable "$w_line")"); fp=$(flops_per_token $mode "$(field trainable "$p_line")")
  printf "%-6s %12s %12s %7s | %11s %11s %7s | %11s %11s | %11s %11s | %11s %11s | %7s %7s\n" $mode "$w_tps" "$p_tps" \
    "$(ratio "$w_tps" "$p_tps")" "$(mib "$w_peak")" "$(mib "$p_peak")" "$(ratio "$w_peak" "$p_peak")" \
    "$(mib "$(field reserved "$w_line")")" "$(mib "$(field reserved "$p_line")")" \
    "$(mib "$(field device "$w_line")")" "$(mib "$(field device "$p_line")")" \
    "$(mib "$(field rss "$w_line")")" "$(mib "$(field rss "$p_line")")" "$(mfu "$w_tps" "$fw")" "$(mfu "$p_tps" "$fp")"
  reason=$(sed -n 's/.*reason="\([^"]*\)".*/\1/p' <<<"$p_line")
  [ -n "$reason" ] && echo "  python $mode: n/a: $reason"
  echo "LM mode=$mode device=$device wick_tps=$w_tps python_tps=$p_tps wick_peak=$w_peak python_peak=$p_peak" \
    "wick_reserved=$(field reserved "$w_line") python_reserved=$(field reserved "$p_line")" \
    "wick_device=$(field device "$w_line") python_device=$(field device "$p_line")" \
    "wick_mfu=$(mfu "$w_tps" "$fw") python_mfu=$(mfu "$p_tps" "$fp") flops_per_token=$fw"
done
echo "tok/s: target tokens per second after the first step; MiB; peak: bytes held by tensors at the most (wick on the"
echo "CPU: its counting allocator; Python on the CPU: n/a); resv: the CUDA allocator's most reserved; dev: the process's"
echo "device memory; RSS: peak resident memory of the process. MFU (cuda): model FLOPs per token x tok/s / $peak_flops,"
echo "FLOPs per token: full 6N + 12LdT, lora and qlora 4N + 6(adapters) + 12LdT (N: the matmuls' weights)."
echo "Python's QLoRA needs bitsandbytes' CUDA kernels: n/a without them."
