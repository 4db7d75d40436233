#!/usr/bin/env bash
# What each kind of kernel costs in decode as it runs (inside the CUDA graphs, PDL on),
# where no profiler sees into the graphs: for each SHAPE (tests/configs/SHAPE.json; a random
# bf16 checkpoint made by scripts/gpu/hf_reference.py with REF=0 where /tmp has none), compiles
# the bundle, times `engrun bench --num-prompts BATCH --input-len INPUT_LEN --output-len
# OUTPUT_LEN` (defaults 1, 1, 256; the time of a step is the mean decode-only step) as is and then
# with ENGINE_CUDA_SKIP set to each of SKIPS (none by default) (space-separated kernel-name parts; the outputs are
# then wrong, only the step time counts), and writes SHAPE-BIN-costs.txt: the decode step of each run and
# its difference from the full step; with PROFILE=1 also the per-launch profile
# (ENGINE_CUDA_PROFILE=1).
# BINS (default bin-gpu) lists folders of binaries to compare: each compiles its own bundle
# (a bundle carries its CUDA), runs, and removes it; the checkpoint goes after the last (the 64
# GB disk holds a checkpoint and one bundle of a 9B shape). Results under $WORK, packed into
# $OUT/costs$TAG.tgz. QUANT=fp8 compiles with --quant fp8 (the tags get -fp8). A SHAPE ending in
# -lN is tests/configs/SHAPE.json cut to N layers.
set -uo pipefail
work="${WORK:-/tmp/costs}"
mkdir -p "$work"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export ENGINE_CACHE_DIR=/tmp/engine-cache
skips="${SKIPS:-}"
tpot() { python3 -c 'import json,sys; print("%.4f" % json.loads(sys.stdin.read().strip().splitlines()[-1])["decode_step_ms"])'; }
for shape in ${SHAPES:-qwen3-8b}; do
  ck=/tmp/ck-$shape cfg=tests/configs/$shape.json
  if [[ $shape =~ ^(.*)-l([0-9]+)$ ]] && [ ! -f "$cfg" ]; then
    cfg=/tmp/costs-$shape.json
    python3 scripts/gpu/cut_layers.py "tests/configs/${BASH_REMATCH[1]}.json" "${BASH_REMATCH[2]}" "$cfg"
  fi
  [ -f "$ck/config.json" ] || REF=0 python3 scripts/gpu/hf_reference.py "$shape" "$ck" "$cfg" >"$work/$shape-hf.txt" 2>&1
  quant=() qtag=""
  [ -z "${QUANT:-}" ] || quant=(--quant "$QUANT") qtag=-$QUANT
  for bin in ${BINS:-bin-gpu}; do
    tag=$shape$qtag-$(basename "$bin") b=/tmp/ck-$shape$qtag-$(basename "$bin").bundle
    "$bin/engc" compile --checkpoint "$ck" --dtype bf16 "${quant[@]}" -o "$b" >"$work/$tag-compile.txt" 2>&1 || continue
    head -1 "$b/kernels/model.cu" >>"$work/$tag-compile.txt"
    export ENGINE_GEMM_CHOICES=$work/$tag-gemm-choices.txt
    for batch in ${BATCHES:-${BATCH:-1}}; do
      args="--device cuda --num-prompts $batch --input-len ${INPUT_LEN:-1} --output-len ${OUTPUT_LEN:-256} --json"
      out="$work/$tag-costs.txt"
      echo "== batch $batch" >>"$out"
      for rep in 1 2; do
        full=$("$bin/engrun" bench "$b" $args 2>>"$work/$tag-bench.err" | tee -a "$work/$tag-bench.json" | tpot)
        echo "$bin, full step (run $rep): decode step $full ms" | tee -a "$out"
      done
      for s in $skips; do
        # A run without kernels whose outputs others index by (an MoE's routing) may fail.
        if t=$(ENGINE_CUDA_SKIP=$s "$bin/engrun" bench "$b" $args 2>>"$work/$tag-bench.err" | tpot 2>/dev/null); then
          python3 -c "print('$bin, without *%s*: decode step %s ms, the kernels cost %.1f us a step' % ('$s', '$t', 1e3 * ($full - $t)))" | tee -a "$out"
        else
          echo "$bin, without *$s*: the run failed (see $tag-bench.err)" | tee -a "$out"
        fi
      done
      [ -n "${PROFILE:-}" ] && ENGINE_CUDA_PROFILE=1 "$bin/engrun" bench "$b" $args >"$work/$tag-b$batch-profile.txt" 2>&1
    done
    # KEEP=1 leaves the bundle for a later command.
    [ -n "${KEEP:-}" ] || rm -rf "$b"
  done
  [ -n "${KEEP_CK:-}" ] || rm -rf "$ck"
done
[ -n "${OUT:-}" ] && tar czf "$OUT/costs${TAG:-}.tgz" -C "$work" .
