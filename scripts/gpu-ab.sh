#!/usr/bin/env bash
# Runs on the GPU machine. The checkpoint of each shape is /tmp/ck-SHAPE (a random one made by
# scripts/gpu/hf_reference.py with REF=0 where it is missing), or with LAYERS=N /tmp/ck-SHAPE-lN,
# the shape cut to N layers (a 4-layer 7B A/B of three variants, two batch sizes and three
# reps takes about two minutes; the full 7B's checkpoint and two bundles take several):
# A/B of run-time settings. For each shape in SHAPES, compiles a bundle of MODEL (default
# models/qwen2.yaml) once per binary set, then runs the benchmark (INPUT_LEN prompt tokens,
# default 128, OUTPUT_LEN generated, default 128; BENCH_ARGS: more `engrun bench` flags, e.g.
# "--random-range-ratio 0.0977 --max-total-tokens 400000" for the nano-vllm workload) as usual (A) and with
# each environment setting of AB_ENVS (space-separated; B, C, ... e.g.
# AB_ENVS=ENGINE_PDL=0; a setting that changes the schedule's kernels, such as
# ENGINE_NORM_IN_GEMV=0, fails: a bundle's CUDA source must be the one engrun emits;
# BIN=DIR: another binary set; CK=SUFFIX: the checkpoint
# /tmp/ck-SHAPE$SUFFIX, e.g. CK=-fp8 for the FP8 one scripts/gpu/hf_fp8.py makes; Q=fp8: the
# bundle compiled with --quant fp8; several joined by commas, environment settings too, e.g.
# BIN=bin-gpu-new,CK=-fp8 or Q=fp8,ENGINE_PDL=0), at each batch size in BATCHES (default 1), REPS times (default 2),
# variants interleaved (AB_DEFAULT=0 leaves out the default run A, e.g. for an A/B of two FP8
# binaries; the first variant listed then tunes the shared GEMM choices). One line per run in $OUT/ab.txt: shape, setting, batch, TPOT p50, output
# tok/s, and (ENGINE_CUDA_PROFILE=steps, medians over the steps) the GPU time of the graph replay and of sampling, the step's host wall time,
# and the GPU period from one replay's start to the next's (what the GPU spends between steps is the difference).
# $OUT/ab.jsonl: each run's whole JSON report after the same labels.
# $OUT/gemm-SHAPE-BINDIR.txt: the GEMM timings and choices each binary logged at its first load (ours or cuBLASLt;
# and the load's 16-bit copies of an FP8 model's linears, with the time they took);
# $OUT/tune-SHAPE.txt: each run's decode-graph tuning lines (GEMMs: none once the choices are tuned; the
# launches idle in decode steps: kept or left out).
# Every variant runs the GEMM choices the first run timed (ENGINE_GEMM_CHOICES, one file per
# shape): each process times ours against cuBLASLt at load, near ties fall differently, and a
# step's time would follow them. SHARED_GEMM=0 lets each binary time its own (an A/B of GEMMs):
# each binary set then keeps its choices in a cache folder of its own, since binaries whose
# CUDA source is the same would otherwise read each other's choices and cuBLASLt algorithms
# from the machine's cache (runtime's choices file is named by the GPU and the source).
set -euo pipefail
out="${OUT:-/tmp/gpu-out}"
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export ENGINE_CACHE_DIR=/tmp/engine-cache NCCL_NVLS_ENABLE=0
: "${AB_ENVS:?set AB_ENVS, e.g. AB_ENVS=ENGINE_PDL=0}"
# The machine's disk (64 GB) holds the full 7B's checkpoint and two bundles (~38 GB), but not
# beside the cut shapes' of earlier calls (2026-11-28: a compile failed, no space left): below
# 40 GB free, the checkpoints and bundles in /tmp of shapes other than $1 are removed first.
room() {
  local free d
  free=$(df --output=avail -BG /tmp | tail -1 | tr -dc 0-9)
  [ "$free" -ge 40 ] && return
  for d in /tmp/ck-* /tmp/.ck-*; do
    case $d in "$1" | "$1".* | "$1"-fp8*) ;; *) rm -rf "$d" ;; esac
  done
}
for shape in ${SHAPES:-qwen2.5-0.5b}; do
  ck=/tmp/ck-$shape${LAYERS:+-l$LAYERS}
  room "$ck"
  if [ ! -f "$ck/config.json" ]; then
    cfg=tests/configs/$shape.json
    if [ -n "${LAYERS:-}" ]; then
      cfg=/tmp/ab-$shape-l$LAYERS.json
      python3 scripts/gpu/cut_layers.py "tests/configs/$shape.json" "$LAYERS" "$cfg"
    fi
    REF=0 python3 scripts/gpu/hf_reference.py "$shape" "$ck" "$cfg" >"$out/hf-$shape.txt" 2>&1
  fi
  if [ "${SHARED_GEMM:-1}" = 1 ]; then export ENGINE_GEMM_CHOICES=$out/gemm-choices-$shape.txt; fi
  for rep in $(seq "${REPS:-2}"); do
    for n in ${BATCHES:-1}; do
      variants="ENGINE_AB=default $AB_ENVS"
      [ "${AB_DEFAULT:-1}" = 1 ] || variants=$AB_ENVS
      for e in $variants; do
        bin=bin-gpu cks="" quant=() envs=()
        for part in ${e//,/ }; do
          case $part in
            BIN=*) bin=${part#BIN=} ;; CK=*) cks=${part#CK=} ;; Q=*) quant=(--quant "${part#Q=}") ;; *) envs+=("$part") ;;
          esac
        done
        # Each binary runs the bundle its own engc compiled (a bundle carries its CUDA source).
        b=$ck$cks${quant[1]:+-${quant[1]}}.$(basename "$bin").bundle
        [ -d "$b" ] || $bin/engc compile "${MODEL:-models/qwen2.yaml}" --checkpoint "$ck$cks" "${quant[@]}" -o "$b" 2>&1 | tail -1
        [ "${SHARED_GEMM:-1}" = 1 ] || envs=("ENGINE_CACHE_DIR=/tmp/engine-cache-$(basename "$bin")" "${envs[@]}")
        r=$(env "${envs[@]}" ENGINE_CUDA_PROFILE=steps $bin/engrun bench "$b" --device cuda --num-prompts "$n" \
          --input-len "${INPUT_LEN:-128}" --output-len "${OUTPUT_LEN:-128}" ${BENCH_ARGS:-} --json 2>&1)
        j=$(echo "$r" | grep '^{' | tail -1)
        echo "$shape $e b$n rep$rep $j" >> "$out/ab.jsonl"
        # The GEMM timings at load, per shape and row count (ours against cuBLASLt), and the
        # time the 16-bit copies of a small FP8 model's linears took.
        g=$(echo "$r" | grep -E '^(GEMM |16-bit copies)' || true)
        # The first run's: later runs read the choices back ("cached") and time nothing.
        gf="$out/gemm-$shape-$(basename "$bin").txt"
        [ -z "$g" ] || [ -f "$gf" ] || echo "$g" > "$gf"
        # The decode graphs' GEMM tuning (which GEMM each shape runs inside the graph).
        echo "$r" | grep -E '^(GEMMs in the batch|batch-[0-9]+ graph:)' | sed "s/^/$e: /" >> "$out/tune-$shape.txt" || true
        # The GPU period (one replay's start to the next's) where the binary reports it.
        p=$(echo "$r" | grep "CUDA graph steps" | sed -E 's/.*replay ([0-9.]+) us.*sampling ([0-9.]+) us.*, ([0-9.]+) us.step wall[^;]*(; GPU period ([0-9.]+) us)?.*/replay_us \1 sample_us \2 step_wall_us \3 period_us \5/' || true)
        python3 -c "import json,sys; j=json.loads(sys.argv[1]); print('$shape $e b$n rep$rep ttft_ms_p50', round(j['ttft_ms_p50'], 3), 'tpot_ms_p50', round(j['tpot_ms_p50'], 4), 'output_tok_s', round(j['output_tok_s']), 'decode_bw', round(j['decode_bandwidth_fraction'], 3), 'roofline', round(j.get('decode_roofline_fraction', 0), 3), 'step_ms', round(j.get('decode_step_ms', 0), 3), sys.argv[2])" "$j" "$p" | tee -a "$out/ab.txt"
      done
    done
  done
done
