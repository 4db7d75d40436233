#!/usr/bin/env bash
# The GPU tier, with a verdict: runs on the GPU machine (through the device tool) from the
# repository root, with release binaries in $BIN (default bin-gpu/: build them here with
# `cargo build --release --bins` and copy engc and engrun there). Exits 0 only when every check
# passes (scripts/gpu/verdict.py prints the table and writes verdict.json).
#
# For each shape in SHAPES (a config in tests/configs/; default qwen2.5-0.5b; FULL=1: qwen2.5-7b
# too) it builds a random-weight checkpoint with HF transformers (the model YAML is the one whose
# architectures name the config's) and HF's logits (scripts/gpu/hf_reference.py),
# then for each dtype in DTYPES (default "bf16 f16"; fp8: the FP8 checkpoint HF's quantizer makes of
# it, E4M3 weights with 128 x 128 block scales, against HF's forward of its dequantized weights;
# fp8c: the same with compressed-tensors per-channel scales) and tp in TPS (default 1, and 2 when the
# machine has two GPUs) compiles a bundle and checks (scripts/gpu/compare.py says the limits):
#   - our CUDA logits against HF's f32 forward, max and rms error and greedy tokens where clear:
#     batch 1 (40 tokens prefilled, 24 decode steps), batch 16 of mixed lengths (24 prefilled,
#     then one shrinking decode batch; and 8 prefilled, 128 rows, on our GEMMs), and a 520-token
#     sequence (512 prefilled, 8 decoded); batch 16 again with each of our wgmma kernel's forms
#     forced (ENGINE_GEMM_FORCE=a8, a8c; FP8 bundles h16 too);
#   - CUDA graphs off (ENGINE_CUDA_GRAPHS=0) and PDL off (ENGINE_PDL=0) equal to the default on
#     batch 16, and our GEMM (ENGINE_CUBLASLT=0) equal to the default on the long prefill;
#   - the GPU sampling kernels against the host's rule on the same logits (greedy through the
#     split argmax, four sampled settings, and both with penalties and logit_bias applied on
#     the device);
#   - the engine (continuous batching, chunked prefill, shared prefixes in the radix cache, paged
#     KV) against each request run alone (`engrun bench --verify-alone`), and again with decode
#     batches of 48 rows over 560-724 keys (decode attention's keys split over blocks) and of
#     256 rows (decode attention's two-warp blocks); and the tokens of seeded sampling with
#     pipelined steps (the next step launched before this one's tokens are on the host) equal
#     to those of the worker that waits for them;
#   - `/v1/embeddings` served from the GPU: the embedding through the lm_head against HF's
#     logits (shapes without a final logit softcap).
# GGUF's blocks on CUDA (GGUF=0 skips): tests/fixtures/tiny-kquant's Q4_K_M-style GGUF (Q4_K
# linears, a Q6_K down projection, a Q5_K table tied to the lm_head) and its Qwen2 twin (hidden 320: Q8_0
# q/k/v with f32 biases, Q5_0, Q5_1 linears, a Q4_0 table, a Q4_1 lm_head, Q5_K down) and Qwen3
# twin (heads of 128 with per-head q/k norms, a Q8_0 table tied to the lm_head), each kept in
# its blocks, its CUDA logits against the CPU backend's on the same bundle (which reads the blocks exactly as
# ir::quant defines them), 16 sequences of 24-60 tokens (24 prefilled: every GEMV, small-batch
# and tiled variant), held to 1.5 x the error of its dequantized twin compiled as bf16 on CUDA.
# SHAPES=' ' (blank) with BENCH=0 runs the GGUF checks alone. SUITE=sampling runs, of each
# shape and dtype, only the sampling kernels against the host's rule and the pipelined seeded
# sampling (with GGUF=0 BENCH=0: a change to kernels/sample.cuh in a few minutes).
# Then (BENCH=0 skips) the benchmarks recorded in docs/perf.md, and `engrun probe` (the copy
# bandwidth and matmul rate the fractions divide by); ENGINE_BENCH=1 adds the nano-vllm workload. Raw results go to $WORK (default
# /tmp/gpu-out); with the device tool's $OUT set they are packed into $OUT/gpu-check$TAG.tgz
# with verdict.json beside it.
set -uo pipefail
work="${WORK:-/tmp/gpu-out}"
bin="${BIN:-bin-gpu}"
rm -rf "$work"
mkdir -p "$work"
checks="$work/checks.jsonl"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export ENGINE_CACHE_DIR=/tmp/engine-cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$work/gpu.txt"
gpus=$(nvidia-smi -L | wc -l)
shapes="${SHAPES:-qwen2.5-0.5b}"
[ "${FULL:-0}" = 1 ] && shapes="qwen2.5-0.5b qwen2.5-7b"
tps="${TPS:-1}"
[ -z "${TPS:-}" ] && [ "$gpus" -ge 2 ] && tps="1 2"
expected=0
cmp() { python3 scripts/gpu/compare.py "$@"; }
# Whether the whole tier runs (SUITE=sampling: only the checks that sample, for a change to
# kernels/sample.cuh).
full() { [ "${SUITE:-all}" = all ]; }
# A command that must succeed: its failure is a failed check, its output a file of $work.
must() {
  local name=$1 log=$2
  shift 2
  if ! "$@" >"$log" 2>&1; then
    echo "{\"check\": \"$name\", \"value\": 1, \"limit\": 0, \"pass\": false, \"note\": \"failed: see $(basename "$log")\"}" >>"$checks"
    echo "FAIL $name: $(tail -3 "$log")"
    return 1
  fi
}
for shape in $shapes; do
  ck=/tmp/ck-$shape
  if [ ! -f "$ck/hf_logits.safetensors" ]; then
    python3 scripts/gpu/hf_reference.py "$shape" "$ck" "tests/configs/$shape.json" 2>&1 | tee "$work/$shape-hf.txt"
  fi
  # A tokenizer (the tiny fixture's, 1000 ids of Qwen's) so that `engrun serve` takes the
  # bundles; every check feeds token ids.
  cp tests/fixtures/tiny-qwen2/tokenizer.json tests/fixtures/tiny-qwen2/tokenizer_config.json "$ck/"
  ids() { python3 -c "import json,sys; s=json.load(open('$ck/seqs.json')); print(';'.join(','.join(map(str, x)) for x in s[$1:$2]))"; }
  one=$(ids 0 1) many=$(ids 1 17) long=$(ids 17 18)
  for dtype in ${DTYPES:-bf16 f16}; do
    # fp8: the FP8 checkpoint HF's fine-grained quantizer makes of this one (scripts/gpu/hf_fp8.py),
    # compiled as it is (E4M3 weights kept) and held to the bf16 limits against HF's forward of
    # its dequantized weights.
    # fp8c: the compressed-tensors per-channel format of the -FP8-dynamic releases (FP8=channel).
    ckd=$ck tdt=$dtype dflag=(--dtype "$dtype")
    if [ "$dtype" = fp8 ] || [ "$dtype" = fp8c ]; then
      ckd=$ck-$dtype tdt=bf16 dflag=()
      mode=block
      [ "$dtype" = fp8 ] || mode=channel
      [ -f "$ckd/hf_logits.safetensors" ] || FP8=$mode python3 scripts/gpu/hf_fp8.py "$ck" "$ckd" 2>&1 | tee "$work/$shape-hf-$dtype.txt"
      cp "$ck/tokenizer.json" "$ck/tokenizer_config.json" "$ckd/"
    fi
    for tp in $tps; do
      # Result suffix: -f16 / -fp8 for those bundles, then -tpN for tensor-parallel ones.
      dsfx=""
      [ "$dtype" = bf16 ] || dsfx="-$dtype"
      b="$ck$dsfx.bundle" sfx="$dsfx"
      [ "$tp" = 1 ] || { b="$ck$dsfx.tp$tp.bundle"; sfx="$dsfx-tp$tp"; }
      [ -d "$b" ] || must compile "$work/$shape$sfx-compile.txt" \
        "$bin/engc" compile --checkpoint "$ckd" "${dflag[@]}" --tp "$tp" -o "$b" || continue
      # Four logits runs against HF (max, rms, greedy each), three settings against the
      # default, seven sampling settings, four engine checks; SUITE=sampling: the seven
      # sampling settings and the pipelined sampled one alone.
      if full; then expected=$((expected + 26)); else expected=$((expected + 8)); fi
      rm -rf /tmp/engine-cache
      logits() { # RUN FILE-SUFFIX IDS PREFILL [ENV...]
        local run=$1 fs=$2 seqs=$3 pre=$4
        shift 4
        must "logits" "$work/$shape-$run$fs.txt" env "$@" /usr/bin/time -f "%e s wall" \
          "$bin/engrun" logits "$b" --device cuda --ids "$seqs" --prefill "$pre" -o "$ckd/$run$fs.safetensors"
      }
      if full; then
      logits b1 "$sfx" "$one" 40 && cmp hf "$checks" "$ckd" "$shape" b1 "$sfx" "$tdt"
      logits b16 "$sfx" "$many" 24 && cmp hf "$checks" "$ckd" "$shape" b16 "$sfx" "$tdt"
      # The same 16 sequences, 8 tokens each in the first step: 128 rows on our small-batch
      # kernel's largest instance.
      logits b16p8 "$sfx" "$many" 8 ENGINE_GEMM_FORCE=ours && cmp hf "$checks" "$ckd" "$shape" b16p8 "$sfx" "$tdt"
      logits long "$sfx" "$long" 512 && cmp hf "$checks" "$ckd" "$shape" long "$sfx" "$tdt"
      # The 16 sequences again with each of our wgmma kernel's forms forced wherever a launch
      # has it (stream-K and with clusters, 8-64 rows: W8A8 for E4M3 bundles, 16-bit for the
      # others), and for E4M3 bundles cuBLASLt on the 16-bit copies a small model gets (a 7B
      # has none, and runs the timing's choices there), so each is checked against HF whatever
      # the timing chose.
      forced="a8 a8c"
      [ "$tdt" != "$dtype" ] && forced="a8 a8c h16"
      for g in $forced; do
        expected=$((expected + 3))
        logits b16 "$sfx-force$g" "$many" 24 ENGINE_GEMM_FORCE=$g && cmp hf "$checks" "$ckd" "$shape" b16 "$sfx-force$g" "$tdt"
      done
      grep -h "cuBLASLt" "$work/$shape-long$sfx.txt" | head -5
      for v in graphs:ENGINE_CUDA_GRAPHS=0:b16:many:24 pdl:ENGINE_PDL=0:b16:many:24 cublaslt:ENGINE_CUBLASLT=0:long:long:512; do
        IFS=: read -r what setting run which pre <<<"$v"
        logits "$run" "$sfx-no$what" "${!which}" "$pre" "$setting" &&
          cmp pair "$checks" "${what}_off$sfx" "$ckd/$run$sfx.safetensors" "$ckd/$run$sfx-no$what.safetensors" "$tdt" "$ckd" "$run"
      done
      fi
      # The sampling kernels against the host's rule, on the same logits and numbers (top-k 1:
      # greedy, the split argmax).
      : >"$work/$shape$sfx-sampling.txt"
      for spec in "--temperature 1.0 --top-k 1" "--temperature 0.7 --top-p 0.9" "--temperature 0.3 --top-p 0.95" \
        "--temperature 1.0 --top-k 50 --min-p 0.05" "--temperature 1.3" \
        "--temperature 0.8 --top-p 0.9 --repetition-penalty 1.3 --frequency-penalty 0.4 --presence-penalty 0.2 --logit-bias 7:-100,11:3" \
        "--temperature 1.0 --top-k 1 --repetition-penalty 1.5 --frequency-penalty 1.0 --logit-bias 11:2"; do
        r=$("$bin/engrun" logits "$b" --device cuda --ids "$many" --prefill 24 $spec -o /tmp/sample-check.safetensors 2>/dev/null | tail -1)
        echo "$spec: $r" >>"$work/$shape$sfx-sampling.txt"
      done
      cmp sampling "$checks" "sampling$sfx" "$work/$shape$sfx-sampling.txt"
      # The engine against each request alone: 24 prompts of 120-600 tokens sharing 64, chunks
      # of 256 tokens, 32 greedy tokens each.
      # FP8 checkpoints run it on our GEMMs alone (W8A16): cuBLASLt's W8A8, chosen per row
      # count, moves logits by what activation quantization costs (checked against HF above),
      # far more than the batching this check is about.
      tol=0.02 lone=()
      [ "$tdt" = f16 ] && tol=0.005
      [ "$tdt" = "$dtype" ] || lone=(env ENGINE_CUBLASLT=0)
      if full; then
      "${lone[@]}" "$bin/engrun" bench "$b" --device cuda --num-prompts 24 --input-len 600 --output-len 32 --random-range-ratio 0.2 \
        --shared-prefix-len 64 --chunked-prefill-size 256 --warmup 0 --verify-alone $tol --json >"$work/$shape$sfx-alone.txt" 2>&1
      cmp alone "$checks" "engine_alone$sfx" "$work/$shape$sfx-alone.txt"
      # Decode steps of 48 rows with 560-724 keys each: decode attention with each row's keys
      # split over blocks and merged (dec_splits), against the lone runs' one-token kernel.
      "${lone[@]}" "$bin/engrun" bench "$b" --device cuda --num-prompts 48 --input-len 700 --output-len 16 --random-range-ratio 0.8 \
        --warmup 0 --verify-alone $tol --json >"$work/$shape$sfx-alone-dec.txt" 2>&1
      cmp alone "$checks" "engine_alone_dec$sfx" "$work/$shape$sfx-alone-dec.txt"
      # Decode steps of 256 rows: more decode attention blocks than fit the GPU at once, so two
      # warps a block (codegen_cuda::dec_warps_rows).
      "${lone[@]}" "$bin/engrun" bench "$b" --device cuda --num-prompts 256 --input-len 300 --output-len 8 --random-range-ratio 0.5 \
        --warmup 0 --verify-alone $tol --json >"$work/$shape$sfx-alone-wide.txt" 2>&1
      cmp alone "$checks" "engine_alone_wide$sfx" "$work/$shape$sfx-alone-wide.txt"
      fi
      # Pipelined steps (each launched before the step before has its tokens on the host, which
      # it takes on the device; its penalties made once they are) against the worker waiting for
      # them: seeded sampling gives every request the same tokens. Our GEMMs forced, so that no
      # timing chooses the kernels.
      for p in 1 0; do
        ENGINE_PIPELINE=$p ENGINE_GEMM_FORCE=ours "${lone[@]}" "$bin/engrun" bench "$b" --device cuda --num-prompts 48 \
          --input-len 200 --output-len 48 --random-range-ratio 0.5 --temperature 0.8 --top-p 0.95 \
          --frequency-penalty 0.3 --seed 5 --warmup 0 \
          --output-tokens "$work/$shape$sfx-pipe$p.json" --json >"$work/$shape$sfx-pipe$p.txt" 2>&1
      done
      cmp same_tokens "$checks" "engine_pipelined_sampled$sfx" "$work/$shape$sfx-pipe1.json" "$work/$shape$sfx-pipe0.json"
      # /v1/embeddings on the GPU, through the lm_head against HF (not under a final softcap,
      # which bends the logits away from W·h).
      if full && ! grep -q '"final_logit_softcapping": *[0-9]' "tests/configs/$shape.json"; then
        expected=$((expected + 1))
        "$bin/engrun" serve "$b" --device cuda --port 30123 >"$work/$shape$sfx-serve.txt" 2>&1 &
        spid=$!
        for _ in $(seq 300); do
          grep -q "serving" "$work/$shape$sfx-serve.txt" || ! kill -0 "$spid" 2>/dev/null && break
          sleep 1
        done
        cmp embed "$checks" "$ckd" "$shape" "$sfx" "$tdt" http://127.0.0.1:30123/v1/embeddings
        kill -TERM "$spid"
        wait "$spid"
      fi
      if [ "${BENCH:-1}" = 1 ]; then
        bench() { # NAME [ENV...] -- ARGS...
          local name=$1
          shift
          local envs=()
          while [ "$1" != -- ]; do envs+=("$1"); shift; done
          shift
          env "${envs[@]}" "$bin/engrun" bench "$b" --device cuda "$@" --json 2>&1 | tail -1 | tee "$work/$shape$sfx-bench-$name.json"
        }
        io="--input-len 128 --output-len 128"
        bench b1 -- --num-prompts 1 $io
        bench b1-nopdl ENGINE_PDL=0 -- --num-prompts 1 $io
        [ "$tp" = 1 ] || bench b1-nccl ENGINE_ALLREDUCE=nccl -- --num-prompts 1 $io
        bench prefill4096 -- --num-prompts 1 --input-len 4096 --output-len 2
        bench prefill4096-ours ENGINE_CUBLASLT=0 -- --num-prompts 1 --input-len 4096 --output-len 2
        bench b16 -- --num-prompts 16 $io
        bench b64 -- --num-prompts 64 $io
        bench b1-top-p -- --num-prompts 1 $io --temperature 0.7 --top-p 0.9
        bench b64-top-p -- --num-prompts 64 $io --temperature 0.7 --top-p 0.9
      fi
    done
  done
done
if [ "${GGUF:-1}" = 1 ]; then
  kq=tests/fixtures/tiny-kquant g=/tmp/gguf-check
  mkdir -p "$g"
  seqs=$(python3 -c "import random; r=random.Random(5); print(';'.join(','.join(str(r.randrange(320)) for _ in range(r.randint(24, 60))) for _ in range(16)))")
  lens=$(python3 -c "print(','.join(str(len(s.split(','))) for s in '$seqs'.split(';')))")
  for pair in kquant:dequant qwen2:qwen2-dequant qwen3:qwen3-dequant; do
    m=${pair%%:*} twin=${pair##*:}
    expected=$((expected + 2))
    must "gguf_compile_$m" "$work/gguf-$m-compile.txt" sh -c "'$bin/engc' compile --checkpoint $kq/$m.gguf -o $g/$m.bundle &&
      '$bin/engc' compile --checkpoint $kq/$twin.gguf --dtype bf16 -o $g/$twin.bundle" &&
      must "gguf_logits_$m" "$work/gguf-$m-logits.txt" sh -c "
        '$bin/engrun' logits $g/$m.bundle --device cpu --ids '$seqs' --prefill 24 -o $g/$m-cpu.safetensors &&
        '$bin/engrun' logits $g/$m.bundle --device cuda --ids '$seqs' --prefill 24 -o $g/$m-cuda.safetensors &&
        '$bin/engrun' logits $g/$twin.bundle --device cuda --ids '$seqs' --prefill 24 -o $g/$twin-cuda.safetensors" &&
      cmp gguf "$checks" "gguf_$m" "$g/$m-cpu.safetensors" "$g/$m-cuda.safetensors" "$g/$twin-cuda.safetensors" "$lens" 24
  done
fi
# The nano-vllm workload on the 0.5B shape: 256 requests, input and output lengths uniform in
# [100, 1024], random ids, eos ignored.
if [ "${ENGINE_BENCH:-0}" = 1 ]; then
  "$bin/engrun" bench /tmp/ck-qwen2.5-0.5b.bundle --device cuda --num-prompts 256 --input-len 1024 --output-len 1024 \
    --random-range-ratio 0.0977 --max-total-tokens 400000 --json 2>&1 | tail -1 | tee "$work/nanovllm-overlap.json"
fi
# The hardware limits the fractions in docs/perf.md divide by.
if [ "${BENCH:-1}" = 1 ]; then
  "$bin/engrun" probe --device cuda --json 2>"$work/probe-cuda.err" | tee "$work/probe-cuda.json"
  "$bin/engrun" probe --device cpu --json 2>"$work/probe-cpu.err" | tee "$work/probe-cpu.json"
fi
python3 scripts/gpu/verdict.py "$checks" "$expected" | tee "$work/verdict.txt"
status=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp "$work/verdict.json" "$OUT/verdict${TAG:-}.json"
  tar czf "$OUT/gpu-check${TAG:-}.tgz" -C "$work" .
fi
exit "$status"
