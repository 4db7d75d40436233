#!/usr/bin/env bash
# Benchmarks of the MoE bundles scripts/gpu-check.sh leaves in /tmp (made here as it makes them
# where it has not run: a random checkpoint of tests/configs/SHAPE.json by
# scripts/gpu/hf_reference.py, compiled bf16): decode at batch 1, 16 and 64 and a 4096-token
# prefill, with
# `engrun bench --json` (its decode_bandwidth_fraction counts the chosen experts' bytes);
# results under $WORK (default /tmp/moe-bench), packed into $OUT/moe-bench$TAG.tgz.
# BINS="bin-gpu-old bin-gpu" runs each folder's binaries on its own bundle, one after the other
# (results named SHAPE-FOLDER-RUN); the default is BIN (bin-gpu) alone, named SHAPE-RUN. RUNS
# picks among b1 b16 b64 b128 prefill4096 profile (default all but b128).
# A checkpoint made here has no reference logits (REF=0: built in bf16 on the GPU). CKROOT puts
# it and its bundles elsewhere than /tmp, e.g. the full Qwen3-30B-A3B (61 GB,
# `SHAPES=qwen3-30b-a3b`, one binary): CKROOT=/dev/shm on the two-GPU machine (256 GB of memory;
# its /tmp disk had 64 GB free), so the checkpoint and its bundle
# (another 61 GB) both fit.
set -uo pipefail
bins="${BINS:-${BIN:-bin-gpu}}"
runs="${RUNS:-b1 b16 b64 prefill4096 profile}"
work="${WORK:-/tmp/moe-bench}"
mkdir -p "$work"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export ENGINE_CACHE_DIR=/tmp/engine-cache
for shape in ${SHAPES:-qwen3-30b-a3b-l4 gpt-oss-20b-l4}; do
  ck=${CKROOT:-/tmp}/ck-$shape
  [ -f "$ck/config.json" ] || REF=0 python3 scripts/gpu/hf_reference.py "$shape" "$ck" "tests/configs/$shape.json" >"$work/$shape-hf.txt" 2>&1
  for bin in $bins; do
    tag=$([ -n "${BINS:-}" ] && echo "-$(basename "$bin")")
    b=${CKROOT:-/tmp}/ck-$shape$tag.bundle
    [ -d "$b" ] || "$bin/engc" compile --checkpoint "$ck" --dtype bf16 -o "$b" >"$work/$shape$tag-compile.txt" 2>&1 || continue
    for run in "b1:--num-prompts 1 --input-len 128 --output-len 128" \
      "b16:--num-prompts 16 --input-len 128 --output-len 128" \
      "b64:--num-prompts 64 --input-len 128 --output-len 128" \
      "b128:--num-prompts 128 --input-len 128 --output-len 128" \
      "prefill4096:--num-prompts 1 --input-len 4096 --output-len 2"; do
      name=${run%%:*} args=${run#*:}
      [[ " $runs " == *" $name "* ]] || continue
      "$bin/engrun" bench "$b" --device cuda $args --json 2>"$work/$shape$tag-$name.err" | tail -1 |
        tee "$work/$shape$tag-$name.json"
    done
    # Decode alone (a one-token prompt): the per-kernel times of batch-1 and batch-64 steps.
    for n in 1 64; do
      [[ " $runs " == *" profile "* ]] || continue
      ENGINE_CUDA_PROFILE=1 "$bin/engrun" bench "$b" --device cuda --num-prompts $n --input-len 1 --output-len 64 \
        >"$work/$shape$tag-profile-b$n.txt" 2>&1
    done
  done
done
[ -n "${OUT:-}" ] && tar czf "$OUT/moe-bench${TAG:-}.tgz" -C "$work" .
