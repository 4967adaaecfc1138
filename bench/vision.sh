#!/usr/bin/env bash
# Step time and peak memory of the video classifier (ViT-Tiny-sized frame
# encoder, 4 blocks, 4 clips x 8 frames of 112 x 112, a temporal transformer)
# and the LLaVA-style VLM (CLIP vision tower frozen, MLP projector, a 4-layer
# LLaMA, 4 samples of 64 visual + 47 text tokens), with and without
# activation checkpointing: wick against the same models built from Python
# transformers' modules on the same batches, each row in its own process,
# with the ratios (below 1: wick faster / smaller).
#   bench/vision.sh [path/to/wick] [path/to/python]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wick=${1:-$here/../build/bin/wick}
python=${2:-${WICK_PYTHON:-${WICK_DEPS:-$HOME/.cache/wick}/venv/bin/python}}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
printf "%-14s %10s %10s %8s %12s %12s %10s %8s\n" model "wick ms" "python ms" ratio "wick tensors" "wick RSS" "python RSS" "RSS ratio"
for model in video vlm; do
  "$python" "$here/vision.py" data $model "$tmp/$model.safetensors"
  for ck in false true; do
    read -r w_ms w_tensors w_rss < <("$wick" run "$here/vision.lua" model=$model file="$tmp/$model.safetensors" \
      checkpointing=$ck | sed -n 's/^RESULT //p')
    pyck=""; [ $ck = true ] && pyck=checkpointing
    read -r p_ms p_tensors p_rss < <("$python" "$here/vision.py" train $model "$tmp/$model.safetensors" $pyck 2>/dev/null |
      sed -n 's/^RESULT //p')
    name=$model; [ $ck = true ] && name="$model+ckpt"
    printf "%-14s %10s %10s %7.2fx %10s M %10s M %8s M %7.2fx\n" "$name" "$w_ms" "$p_ms" "$(echo "$w_ms / $p_ms" | bc -l)" \
      "$w_tensors" "$w_rss" "$p_rss" "$(echo "$w_rss / $p_rss" | bc -l)"
    [ "$p_tensors" != n/a ] && echo "               python CUDA max allocated: $p_tensors MiB"
  done
done
echo "ms: median milliseconds per training step (AdamW, fp32) over 10 after the first; tensors: wick's tensor peak; RSS: peak"
echo "resident memory of the process (wick's includes LuaJIT and the plugins, Python's the interpreter and transformers)."
