#!/usr/bin/env bash
# What each kind of kernel costs in batch-1 decode as it runs (inside the CUDA graphs, PDL on),
# where no profiler sees into the graphs: for each SHAPE (tests/configs/SHAPE.json; a random
# bf16 checkpoint made by scripts/gpu/hf_reference.py with REF=0 where /tmp has none), compiles
# the bundle, times `engrun bench --num-prompts 1 --input-len 1 --output-len 256` as is and then
# with ENGINE_CUDA_SKIP set to each of SKIPS (space-separated kernel-name parts; the outputs are
# then wrong, only the TPOT counts), and writes SHAPE-costs.txt: the TPOT p50 of each run and
# its difference from the full step. Also the per-launch profile (ENGINE_CUDA_PROFILE=1).
# Checkpoints and bundles are removed after use unless KEEP=1 (the 64 GB disk holds about two
# 8B bundles). Results under $WORK, packed into $OUT/costs$TAG.tgz.
set -uo pipefail
bin="${BIN:-bin-gpu}"
work="${WORK:-/tmp/costs}"
mkdir -p "$work"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export ENGINE_CACHE_DIR=/tmp/engine-cache
skips="${SKIPS:-rms_norm attention gemv_glu gemv_k}"
tpot() { python3 -c 'import json,sys; print("%.4f" % json.loads(sys.stdin.read().strip().splitlines()[-1])["tpot_ms_p50"])'; }
for shape in ${SHAPES:-qwen3-8b}; do
  ck=/tmp/ck-$shape b=/tmp/ck-$shape.bundle
  [ -f "$ck/config.json" ] || [ -d "$b" ] || REF=0 python3 scripts/gpu/hf_reference.py "$shape" "$ck" "tests/configs/$shape.json" >"$work/$shape-hf.txt" 2>&1
  [ -d "$b" ] || "$bin/engc" compile --checkpoint "$ck" --dtype bf16 -o "$b" >"$work/$shape-compile.txt" 2>&1 || continue
  [ "${KEEP:-0}" = 1 ] || rm -rf "$ck"
  args="--device cuda --num-prompts 1 --input-len 1 --output-len ${OUTPUT_LEN:-256} --json"
  out="$work/$shape-costs.txt"
  for rep in 1 2; do
    full=$("$bin/engrun" bench "$b" $args 2>>"$work/$shape-bench.err" | tee -a "$work/$shape-bench.json" | tpot)
    echo "full step (run $rep): TPOT p50 $full ms" | tee -a "$out"
  done
  for s in $skips; do
    t=$(ENGINE_CUDA_SKIP=$s "$bin/engrun" bench "$b" $args 2>>"$work/$shape-bench.err" | tpot)
    python3 -c "print('without *%s*: TPOT p50 %s ms, the kernels cost %.1f us a step' % ('$s', '$t', 1e3 * ($full - $t)))" | tee -a "$out"
  done
  ENGINE_CUDA_PROFILE=1 "$bin/engrun" bench "$b" $args >"$work/$shape-profile.txt" 2>&1
  [ "${KEEP:-0}" = 1 ] || rm -rf "$b"
done
[ -n "${OUT:-}" ] && tar czf "$OUT/costs${TAG:-}.tgz" -C "$work" .
