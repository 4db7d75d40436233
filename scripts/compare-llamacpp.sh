#!/usr/bin/env bash
# Ours and llama.cpp side by side on the GPU machine, on the same random checkpoints, in one run
# (issue 20 item 4; issue 21's MoE comparison). For each SHAPE of SHAPES (tests/configs/
# SHAPE.json): a random bf16 checkpoint (scripts/gpu/hf_reference.py with REF=0) with Qwen's
# real tokenizer (TOKENIZER, default bin-gpu/qwen-tokenizer, made by
# scripts/fetch-qwen-tokenizer.sh), converted to GGUF bf16 by llama.cpp's own converter; then
#   llama.cpp: llama-bench pp4096 / tg128 and llama-batched-bench 128 in / 128 out at BATCHES
#              (flash attention on, all layers on the GPU; ../shared/peers/llamacpp.sh);
#   ours:      engrun bench --num-prompts B --input-len 128 --output-len 128 at BATCHES, and
#              --num-prompts 1 --input-len 4096 --output-len 1 for the prefill.
# Writes $OUT/compare-SHAPE.md (the table: output tok/s = B*128/T for llama.cpp, ours'
# output_tok_s; decode-only tok/s = S_TG and ours' decode_tok_s) and packs the raw logs into
# $OUT/compare-raw$TAG.tgz. LCPP: a carried copy of ../shared/peers (llamacpp.sh and the
# llama.cpp sources), default peers-gpu; llama.cpp is built once per machine (~4 min).
# QUANT=TYPE (a llama-quantize type: Q4_K_M, Q6_K, Q8_0, ...): both engines run the GGUF that
# llama.cpp's quantizer makes of the bf16 one, ours compiled from that file with its blocks
# kept (docs/runtime.md, "GGUF blocks on the GPU"); the files and the table are named SHAPE-TYPE.
# STAGES (default "lcpp ours"): `lcpp` builds llama.cpp, makes the checkpoint and runs llama.cpp
# on it; `ours` runs ours on the checkpoint and writes the table. A 7B does not fit one call's
# ten minutes: run STAGES=lcpp, then STAGES=ours in the next call while the machine is still
# held (its /tmp keeps the build, the checkpoint and llama.cpp's logs; WORK, default
# /tmp/compare, must be the same). CKROOT (default /tmp) holds the checkpoint, its GGUF and our
# bundle: /dev/shm on the two-GPU machine for the full Qwen3-30B-A3B (61 GB each; the GGUF is
# removed before our bundle is compiled, so 122 GB at most).
set -uo pipefail
bin="${BIN:-bin-gpu}"
lcpp="${LCPP:-peers-gpu}"
tok="${TOKENIZER:-bin-gpu/qwen-tokenizer}"
out="${OUT:-/tmp/gpu-out}"
work="${WORK:-/tmp/compare}"
batches="${BATCHES:-1 16 32 64 128}"
mkdir -p "$out" "$work"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export ENGINE_CACHE_DIR=/tmp/engine-cache
stages="${STAGES:-lcpp ours}"
has() { case " $stages " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if has lcpp && [ ! -x /tmp/lcpp/lcpp/build/bin/llama-bench ]; then
  bash "$lcpp/llamacpp.sh" build >"$work/lcpp-build.txt" 2>&1
fi
lb=/tmp/lcpp/lcpp/build/bin
quant="${QUANT:-}"
# The vendored tree has no llama-quantize tool: scripts/gpu/llama_quantize.c calls the library
# function that tool calls (llama_model_quantize, llama.cpp's own mixes).
if has lcpp && [ -n "$quant" ] && [ ! -x $lb/llama-quantize ]; then
  so=$(find /tmp/lcpp/lcpp/build -name 'libllama.so' | head -1)
  [ -n "$so" ] || { echo "error: no libllama.so under /tmp/lcpp/lcpp/build (see $work/lcpp-build.txt)" >&2; exit 1; }
  lib=$(dirname "$so")
  cc -O2 -I/tmp/lcpp/lcpp/include -I/tmp/lcpp/lcpp/ggml/include scripts/gpu/llama_quantize.c \
    -L"$lib" -lllama -Wl,-rpath,"$lib" -o $lb/llama-quantize >>"$work/lcpp-build.txt" 2>&1 ||
    { echo "error: building scripts/gpu/llama_quantize.c failed (see $work/lcpp-build.txt)" >&2; exit 1; }
fi
for shape in ${SHAPES:-qwen2.5-0.5b}; do
  ck=${CKROOT:-/tmp}/cmp-$shape
  name=$shape${quant:+-$quant}
  gguf=$ck.gguf
  [ -z "$quant" ] || gguf=$ck-$quant.gguf
  if has lcpp; then
    [ -f "$ck/config.json" ] || REF=0 python3 scripts/gpu/hf_reference.py "$shape" "$ck" "tests/configs/$shape.json" \
      >"$work/$shape-hf.txt" 2>&1
    cp "$tok"/tokenizer*.json "$ck/"
    bash "$lcpp/llamacpp.sh" gguf "$ck" "$ck.gguf" >"$work/$shape-gguf.txt" 2>&1
    cp /tmp/lcpp-conv.log "$work/$shape-gguf-convert.log" 2>/dev/null
    [ -z "$quant" ] || $lb/llama-quantize "$ck.gguf" "$gguf" "$quant" >"$work/$name-quantize.txt" 2>&1
    npl=$(echo "$batches" | tr ' ' ',')
    $lb/llama-bench -m "$gguf" -ngl 99 -fa 1 -p 4096 -n 128 -r 3 -o md >"$work/$name-llama-bench.txt" 2>&1
    $lb/llama-batched-bench -m "$gguf" -ngl 99 -fa on -c 40000 -b 4096 -ub 512 -npp 128 -ntg 128 -npl "$npl" \
      >"$work/$name-llama-batched.txt" 2>&1
    # Ours compiles a quantized checkpoint from the GGUF itself: kept for the `ours` stage.
    [ -z "$quant" ] && rm -f "$gguf"
    rm -f "$ck.gguf"
  fi
  has ours || continue
  if [ -n "$quant" ]; then
    "$bin/engc" compile --checkpoint "$gguf" -o "$ck.bundle" >"$work/$name-compile.txt" 2>&1
  else
    "$bin/engc" compile --checkpoint "$ck" --dtype bf16 -o "$ck.bundle" >"$work/$name-compile.txt" 2>&1
  fi
  rm -f "$gguf"
  : >"$work/$name-ours.jsonl"
  for b in $batches; do
    "$bin/engrun" bench "$ck.bundle" --device cuda --num-prompts "$b" --input-len 128 --output-len 128 --json \
      2>>"$work/$name-ours.err" | tail -1 | sed "s/^{/{\"batch\":$b,/" >>"$work/$name-ours.jsonl"
  done
  "$bin/engrun" bench "$ck.bundle" --device cuda --num-prompts 1 --input-len 4096 --output-len 1 --json \
    2>>"$work/$name-ours.err" | tail -1 | sed 's/^{/{"batch":"pp4096",/' >>"$work/$name-ours.jsonl"
  rm -rf "$ck.bundle" "$ck"
  python3 scripts/gpu/compare_table.py "$name" "$work" | tee "$out/compare-$name.md"
done
tar czf "$out/compare-raw${TAG:-}.tgz" -C "$work" .
