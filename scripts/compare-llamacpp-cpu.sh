#!/usr/bin/env bash
# Ours against llama.cpp's CPU build on the same GGUF, same machine, same thread count, one after
# the other: llama-bench -t T -p 128 -n 64 (pp128, tg64, 3 reps) and `engrun bench --num-prompts 1
# --input-len 128 --output-len 64` (--warmup 1, REPS runs) on the bundle compiled from that file
# kept in its blocks and, as the baseline, dequantized to f32 (`--dtype f32`).
# Prints a markdown table of prefill and decode tok/s and our fraction of llama.cpp's.
#
# Usage: scripts/compare-llamacpp-cpu.sh [GGUF] [THREADS]
#   GGUF     default: SmolLM2-135M-Instruct Q4_1 (scripts/fetch-smollm2.sh); a random Qwen2.5
#            shape: scripts/make-random-gguf.py writes it F16, scripts/gpu/llama_quantize.c
#            (linked against the CPU build's libllama) makes llama.cpp's Q4_K_M of it
#   THREADS  default: every core; ours runs pinned to cores 0..THREADS-1 (the CPU backend uses
#            every core it may run on)
# Needs: target/release/engc and engrun (cargo build --release), and llama.cpp's CPU build
# (../shared/peers/llamacpp.sh build-cpu, or LLAMA_BIN=<dir with llama-bench>). REPS (default 3).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
gguf=${1:-$("$here/scripts/fetch-smollm2.sh")}
threads=${2:-$(nproc)}
reps=${REPS:-3}
lbin=${LLAMA_BIN:-/tmp/lcpp/lcpp/build-cpu/bin}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ -x "$lbin/llama-bench" ] || { echo "no llama-bench in $lbin: run ../shared/peers/llamacpp.sh build-cpu" >&2; exit 2; }

lcpp=$(cd "$lbin" && LD_LIBRARY_PATH=. ./llama-bench -m "$gguf" -t "$threads" -p 128 -n 64 -r 3 -o json 2>/dev/null)
read -r l_pp l_tg < <(python3 -c '
import json, sys
rows = json.loads(sys.argv[1])
pick = lambda p, g: next(r["avg_ts"] for r in rows if r["n_prompt"] == p and r["n_gen"] == g)
print(pick(128, 0), pick(0, 64))' "$lcpp")

ours() { # bundle -> "prefill decode" (medians of REPS runs)
  for _ in $(seq "$reps"); do
    taskset -c "0-$((threads - 1))" "$here/target/release/engrun" bench "$1" --device cpu --num-prompts 1 \
      --input-len 128 --output-len 64 --warmup 1 --json 2>/dev/null | tail -1
  done | python3 -c '
import json, statistics, sys
runs = [json.loads(l) for l in sys.stdin if l.strip()]
med = lambda k: statistics.median(r[k] for r in runs)
print(med("prefill_tok_s"), med("decode_tok_s"))'
}

echo "| bundle | weights MB | prefill tok/s | decode tok/s | prefill vs llama.cpp | decode vs llama.cpp |"
echo "|---|---|---|---|---|---|"
printf '| llama.cpp (%s, -t %s) | %.1f | %.1f | %.1f | 1 | 1 |\n' "$(basename "$gguf")" "$threads" \
  "$(($(stat -c %s "$gguf") / 1000000))" "$l_pp" "$l_tg"
for mode in blocks f32; do
  dtype=()
  [ "$mode" = f32 ] && dtype=(--dtype f32)
  "$here/target/release/engc" compile --checkpoint "$gguf" "${dtype[@]}" -o "$work/$mode.bundle" >/dev/null 2>&1
  mb=$(du -sm "$work/$mode.bundle/weights" | cut -f1)
  read -r pp tg < <(ours "$work/$mode.bundle")
  python3 -c 'import sys; m, mb, pp, tg, lpp, ltg = sys.argv[1:]; print(f"| ours, {m} | {mb} | {float(pp):.1f} | {float(tg):.1f} | {float(pp)/float(lpp):.2f} | {float(tg)/float(ltg):.2f} |")' \
    "$mode" "$mb" "$pp" "$tg" "$l_pp" "$l_tg"
done
