#!/usr/bin/env bash
# Runs on the GPU machine: the load's GEMM timings of a model shape's linears, in a minute. For
# each shape in SHAPES (a config in tests/configs/, default qwen2.5-7b) it builds a random
# checkpoint of LAYERS layers (default 4: every linear shape of the model, a fraction of the
# bytes), compiles it once per entry of QUANTS (default "bf16 fp8": the checkpoint as it is, and
# `--quant fp8`), loads each bundle with `engrun bench` (a short batch of BATCH requests, default
# 64) and keeps the `GEMM ...` lines the load logs: per linear shape and token bucket, ours /
# cuBLASLt [/ ours W8A8] in microseconds, the one that runs marked. Fresh choices and cuBLASLt
# algorithms every time (ENGINE_GEMM_CHOICES names a new file; the kernel cache is kept). Output: $OUT/gemms-SHAPE-QUANT.txt (default /tmp/gpu-out),
# and the bench's JSON line after the GEMM lines.
set -euo pipefail
out="${OUT:-/tmp/gpu-out}"
mkdir -p "$out"
bin="${BIN:-bin-gpu}"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0 ENGINE_CACHE_DIR=/tmp/engine-cache
for shape in ${SHAPES:-qwen2.5-7b}; do
  cfg=/tmp/gemms-$shape.json
  ck=/tmp/gemms-ck-$shape
  python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["num_hidden_layers"] = int(sys.argv[2]); json.dump(c, open(sys.argv[3], "w"))' \
    "tests/configs/$shape.json" "${LAYERS:-4}" "$cfg"
  [ -f "$ck/config.json" ] || REF=0 python3 scripts/gpu/hf_reference.py "$shape" "$ck" "$cfg" >/dev/null
  model=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["model_type"])' "$cfg")
  for q in ${QUANTS:-bf16 fp8}; do
    flag=()
    [ "$q" = bf16 ] || flag=(--quant "$q")
    b=/tmp/gemms-$shape-$q.bundle
    [ -d "$b" ] || "$bin/engc" compile "models/$model.yaml" --checkpoint "$ck" "${flag[@]}" -o "$b" >/dev/null
    ENGINE_GEMM_CHOICES=$(mktemp -u) "$bin/engrun" bench "$b" --device cuda --num-prompts "${BATCH:-64}" \
      --input-len 128 --output-len 16 --json 2>&1 | grep -E '^GEMM|^\{' | tee "$out/gemms-$shape-$q.txt"
  done
done
