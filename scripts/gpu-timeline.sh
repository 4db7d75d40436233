#!/usr/bin/env bash
# Runs on the GPU machine: where a decode graph's step goes, kernel by kernel, inside the graph
# (each kernel's GPU start and end as CUPTI records them, so programmatic-launch overlap and the
# gaps between kernels show; ENGINE_CUDA_PROFILE times launches one by one, outside graphs).
# Builds scripts/gpu/timeline.c (a CUPTI injection library) against the machine's toolkit, then
# for SHAPE (a config in tests/configs/, default qwen2.5-7b) cut to LAYERS layers (default 4),
# compiled as QUANT (default bf16; fp8: --quant fp8), runs `engrun bench` once per batch size of
# BATCHES (default "64 128"; INPUT_LEN 128, OUTPUT_LEN 64 tokens a request) with the library
# injected, and summarizes the decode graph replayed most (scripts/gpu/timeline.py): the step's
# span against its kernels' own time, per kernel name the time and the gaps before, the first
# NODES kernels in order. ENV: more environment for the runs (e.g. ENGINE_GEMM_TUNE=0).
# Output: $OUT/timeline-SHAPE-QUANT-bB.txt (default /tmp/gpu-out).
source scripts/gpu/few-layer.sh
shape="${SHAPE:-qwen2.5-7b}" q="${QUANT:-bf16}"
found() { find /usr/local/cuda/ /usr/local/cuda-*/ -name "$1" 2>/dev/null | head -1 || true; }
inc=$(dirname "$(found cupti.h)")
lib=$(dirname "$(found 'libcupti.so*')")
[ -f "$inc/cupti.h" ] && [ -d "$lib" ] || { echo "error: no CUPTI (cupti.h, libcupti.so) under /usr/local/cuda*" >&2; exit 1; }
so=/tmp/libtimeline.so
cc -O2 -shared -fPIC -I"$inc" -I/usr/local/cuda/include scripts/gpu/timeline.c -L"$lib" -lcupti \
  -Wl,-rpath,"$lib" -o "$so"
b=$(few_layer_bundle "$shape" "$q")
export ENGINE_GEMM_CHOICES=/tmp/timeline-choices-$shape-$q.txt
for n in ${BATCHES:-64 128}; do
  t=/tmp/timeline-$shape-$q-b$n.raw
  env ${ENV:-} CUDA_INJECTION64_PATH="$so" TIMELINE_OUT="$t" "$bin/engrun" bench "$b" --device cuda \
    --num-prompts "$n" --input-len "${INPUT_LEN:-128}" --output-len "${OUTPUT_LEN:-64}" --json \
    > "/tmp/timeline-bench-b$n.txt" 2>&1 || { tail -5 "/tmp/timeline-bench-b$n.txt" >&2; continue; }
  { echo "$shape x${LAYERS:-4} $q batch $n ($(wc -l < "$t") kernel records)"
    python3 scripts/gpu/timeline.py "$t" "${NODES:-40}" 2>&1 || true; } > "$out/timeline-$shape-$q-b$n.txt"
done
