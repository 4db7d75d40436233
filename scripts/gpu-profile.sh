#!/usr/bin/env bash
# Runs on the GPU machine after scripts/gpu-check.sh built the bundle of SHAPE (default
# qwen2.5-0.5b): per-kernel GPU time (ENGINE_CUDA_PROFILE=1: every launch timed with events,
# CUDA graphs off) for batch-1 decode, a 4096-token prefill and batch-16 decode.
set -euo pipefail
out="${OUT:-/tmp/gpu-out}"
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export ENGINE_CACHE_DIR=/tmp/engine-cache
shape="${SHAPE:-qwen2.5-0.5b}"
b=/tmp/ck-$shape.bundle
for w in "1 128 64" "1 4096 1" "16 128 64"; do
  set -- $w
  ENGINE_CUDA_PROFILE=1 bin-gpu/engrun bench $b --device cuda --num-prompts $1 --input-len $2 --output-len $3 --json \
    > /dev/null 2> "$out/$shape-profile-$1x$2.txt" || true
  head -14 "$out/$shape-profile-$1x$2.txt" | grep -v "^loaded\|^uploaded\|^CUDA kernels for" || true
done
