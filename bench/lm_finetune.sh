#!/usr/bin/env bash
# Fine-tuning a decoder language model (6 blocks, hidden 512, 256 tokens, 4
# sequences per step, AdamW) fully, with LoRA and with QLoRA: tokens per
# second and peak memory for wick and for Python transformers + PEFT on the
# same model, each row in its own process, with the ratio wick / Python.
#   bench/lm_finetune.sh [path/to/wick] [path/to/python]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wick=${1:-$here/../build/bin/wick}
python=${2:-${WICK_DEPS:-$HOME/.cache/wick/venv}/bin/python}
printf "%-6s %14s %14s %9s %16s %14s %14s %9s\n" mode "wick tok/s" "python tok/s" ratio "wick tensors MiB" \
  "wick RSS MiB" "python RSS MiB" "RSS ratio"
for mode in full lora qlora; do
  read -r w_tps w_tensors w_rss < <("$wick" run "$here/lm_finetune.lua" mode=$mode | sed -n 's/^RESULT //p')
  read -r p_tps _ p_rss < <(OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)} "$python" "$here/lm_finetune.py" $mode 2>/dev/null | sed -n 's/^RESULT //p')
  ratio=n/a; rss_ratio=n/a
  [ "$p_tps" != n/a ] && ratio=$(printf "%.2fx" "$(echo "$w_tps / $p_tps" | bc -l)")
  [ "$p_rss" != n/a ] && rss_ratio=$(printf "%.2fx" "$(echo "$w_rss / $p_rss" | bc -l)")
  printf "%-6s %14s %14s %9s %16s %14s %14s %9s\n" $mode "$w_tps" "$p_tps" "$ratio" "$w_tensors" "$w_rss" "$p_rss" "$rss_ratio"
done
echo "tok/s: target tokens per second after the first step; RSS: peak resident memory of the process."
echo "Python's QLoRA needs bitsandbytes' CUDA kernels: n/a without a GPU."
