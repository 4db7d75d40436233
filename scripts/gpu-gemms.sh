#!/usr/bin/env bash
# Runs on the GPU machine: the load's GEMM timings of a model shape's linears, in a minute. For
# each shape in SHAPES (a config in tests/configs/, default qwen2.5-7b) it builds a random
# checkpoint of LAYERS layers (default 4: every linear shape of the model, a fraction of the
# bytes), compiles it once per entry of QUANTS (default "bf16 fp8": the checkpoint as it is, and
# `--quant fp8`), loads each bundle with `engrun bench` (a short batch of BATCH requests, default
# 64) and keeps the `GEMM ...` lines the load logs: per linear shape and token bucket, ours /
# L cuBLASLt / A ours W8A8 / T ours tiled in microseconds, the one that runs marked. Fresh choices and cuBLASLt
# algorithms every time (ENGINE_GEMM_CHOICES names a new file; the kernel cache is kept). Output: $OUT/gemms-SHAPE-QUANT.txt (default /tmp/gpu-out),
# and the bench's JSON line after the GEMM lines.
source scripts/gpu/few-layer.sh
for shape in ${SHAPES:-qwen2.5-7b}; do
  for q in ${QUANTS:-bf16 fp8}; do
    b=$(few_layer_bundle "$shape" "$q")
    ENGINE_GEMM_CHOICES=$(mktemp -u) "$bin/engrun" bench "$b" --device cuda --num-prompts "${BATCH:-64}" \
      --input-len 128 --output-len 16 --json 2>&1 | grep -E '^GEMM|^\{' | tee "$out/gemms-$shape-$q.txt"
  done
done
