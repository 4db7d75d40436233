#!/usr/bin/env bash
# Benchmarks of the MoE bundles scripts/gpu-check.sh leaves in /tmp (made here as it makes them
# where it has not run: a random checkpoint of tests/configs/SHAPE.json by
# scripts/gpu/hf_reference.py, compiled bf16): batch-1 decode, batch 64 and a 4096-token
# prefill, with
# `engrun bench --json` (its decode_bandwidth_fraction counts the chosen experts' bytes);
# results under $WORK (default /tmp/moe-bench), packed into $OUT/moe-bench$TAG.tgz.
set -uo pipefail
bin="${BIN:-bin-gpu}"
work="${WORK:-/tmp/moe-bench}"
mkdir -p "$work"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export ENGINE_CACHE_DIR=/tmp/engine-cache
for shape in ${SHAPES:-qwen3-30b-a3b-l4 gpt-oss-20b-l4}; do
  ck=/tmp/ck-$shape b=/tmp/ck-$shape.bundle
  [ -f "$ck/config.json" ] || python3 scripts/gpu/hf_reference.py "$shape" "$ck" "tests/configs/$shape.json" >"$work/$shape-hf.txt" 2>&1
  [ -d "$b" ] || "$bin/engc" compile --checkpoint "$ck" --dtype bf16 -o "$b" >"$work/$shape-compile.txt" 2>&1 || continue
  for run in "b1:--num-prompts 1 --input-len 128 --output-len 128" \
    "b64:--num-prompts 64 --input-len 128 --output-len 128" \
    "prefill4096:--num-prompts 1 --input-len 4096 --output-len 2"; do
    name=${run%%:*} args=${run#*:}
    "$bin/engrun" bench "$b" --device cuda $args --json 2>"$work/$shape-$name.err" | tail -1 | tee "$work/$shape-$name.json"
  done
  # Decode alone (a one-token prompt): the per-kernel times of batch-1 steps.
  ENGINE_CUDA_PROFILE=1 "$bin/engrun" bench "$b" --device cuda --num-prompts 1 --input-len 1 --output-len 128 \
    >"$work/$shape-profile.txt" 2>&1
done
[ -n "${OUT:-}" ] && tar czf "$OUT/moe-bench${TAG:-}.tgz" -C "$work" .
