#!/usr/bin/env bash
# Runs on the GPU machine: Nsight Compute's counters for one kernel of a decode benchmark. For
# SHAPE (a config in tests/configs/, default qwen2.5-7b) it builds a random checkpoint of
# LAYERS layers (default 4, as scripts/gpu-gemms.sh), compiles it with QUANT (default fp8; bf16:
# as it is), runs `engrun bench` once at BATCH prompts (default 64) of INPUT_LEN tokens (default
# 128; OUTPUT_LEN generated, default 8) to fix the GEMM choices
# (ENV, e.g. ENGINE_GEMM_FORCE=a8, applies to both runs), then again under ncu for COUNT
# launches (default 2) of the kernels matching KERNEL (a regex, default gemm_skinny_a8) after
# SKIP (default 40) of them: the decode steps' launches, past the load's checks; BUNDLE: that
# bundle instead of the few-layer one. Besides the sections, the warps' stall reasons. Clocks are
# left alone (--clock-control none); the KV pool is kept small (ncu backs up device memory). Output: $OUT/ncu-SHAPE-QUANT.txt (default /tmp/gpu-out).
# SASS=1 also writes the per-instruction counters (executed instructions, warp stall samples by
# reason) of the last profiled launch: $OUT/ncu-SHAPE-QUANT-sass.csv.
source scripts/gpu/few-layer.sh
shape="${SHAPE:-qwen2.5-7b}" q="${QUANT:-fp8}"
b="${BUNDLE:-$(few_layer_bundle "$shape" "$q")}"
export ENGINE_GEMM_CHOICES=/tmp/ncu-choices-$shape-$q.txt
run=("$bin/engrun" bench "$b" --device cuda --num-prompts "${BATCH:-64}" --input-len "${INPUT_LEN:-128}" --output-len "${OUTPUT_LEN:-8}" --mem-fraction 0.05 --json)
env ${ENV:-ENGINE_NCU=1} "${run[@]}" 2>&1 | grep -E '^GEMM|^\{' > "$out/ncu-$shape-$q.txt"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
env ${ENV:-ENGINE_NCU=1} "$ncu" --clock-control none --kernel-name "regex:${KERNEL:-gemm_skinny_a8}" \
  --launch-skip "${SKIP:-40}" --launch-count "${COUNT:-2}" --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  ${SASS:+--section SourceCounters --export "$out/ncu-$shape-$q" --force-overwrite} \
  "${run[@]}" >> "$out/ncu-$shape-$q.txt" 2>&1 || true
if [ -n "${SASS:-}" ]; then
  "$ncu" --import "$out/ncu-$shape-$q.ncu-rep" --page details >> "$out/ncu-$shape-$q.txt" 2>&1 || true
  "$ncu" --import "$out/ncu-$shape-$q.ncu-rep" --page source --print-source sass --csv > "$out/ncu-$shape-$q-sass.csv" 2>&1 || true
  rm -f "$out/ncu-$shape-$q.ncu-rep"
fi
grep -E "gemm|attention|Duration|Throughput|Bandwidth|stalled|Occupancy|Registers|Warp Cycles|Issued|Active Cycles" "$out/ncu-$shape-$q.txt" |
  awk '!/stalled/ || $NF + 0 >= 0.05' | head -80
