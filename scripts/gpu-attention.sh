#!/usr/bin/env bash
# Runs on the GPU machine: decode attention at long contexts, kernel by kernel, binaries side by
# side in one run. For each shape in SHAPES (default "qwen2.5-0.5b qwen2.5-7b", LAYERS layers of
# a random checkpoint, default 4: scripts/gpu/few-layer.sh), each workload of WORK (default
# "64x1024 256x800": requests x prompt tokens, OUTPUT_LEN generated, default 32) and each binary
# set of BINS (default "bin-gpu-old bin-gpu"), `engrun bench` runs twice:
#   - ENGINE_CUDA_PROFILE=1 (every launch timed alone, graphs off): the attention kernels of
#     decode steps, with the KV bytes a call must read and the rate (GB/s) that makes;
#   - ENGINE_CUDA_PROFILE=steps (graphs and PDL on): the decode step.
# Output: $OUT/attention.txt (default /tmp/gpu-out), the raw runs beside it.
source scripts/gpu/few-layer.sh
for shape in ${SHAPES:-qwen2.5-0.5b qwen2.5-7b}; do
  for w in ${WORK:-64x1024 256x800}; do
    n=${w%x*} len=${w#*x}
    for bin in ${BINS:-bin-gpu-old bin-gpu}; do
      b=$(few_layer_bundle "$shape" bf16)
      run="$shape-$(basename "$bin")-$w"
      bench=("$bin/engrun" bench "$b" --device cuda --num-prompts "$n" --input-len "$len" --output-len "${OUTPUT_LEN:-32}" --json)
      ENGINE_CUDA_PROFILE=1 "${bench[@]}" >"$out/$run-profile.json" 2>"$out/$run-profile.txt" || echo "FAIL $run profile"
      ENGINE_CUDA_PROFILE=steps "${bench[@]}" >"$out/$run-steps.json" 2>"$out/$run-steps.txt" || echo "FAIL $run steps"
      step=$(python3 -c 'import json, sys; j = json.loads(open(sys.argv[1]).read().splitlines()[-1]); print(round(j["decode_step_ms"], 3), "ms step,", round(j["output_tok_s"]), "output tok/s")' "$out/$run-steps.json" 2>/dev/null || echo "no report")
      {
        echo "== $run: $step"
        grep -E 'attention_(dec|gqa|h)' "$out/$run-profile.txt" | grep -v 'prefill step' || true
      } | tee -a "$out/attention.txt"
    done
  done
done
