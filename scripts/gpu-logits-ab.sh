#!/usr/bin/env bash
# Runs on the GPU machine: the CUDA logits of two binary sets on the same checkpoint, side by
# side, for a kernel change that should not change results beyond the order of sums (the
# verdict against HF is scripts/gpu-check.sh's; this is the quick look before it). For each
# checkpoint of CKS (default /tmp/ck-qwen2.5-0.5b, as scripts/gpu-ab.sh leaves them) and each
# quantization of QUANTS (default "none fp8"), each binary set of BINS (default "bin-gpu-base
# bin-gpu") compiles its bundle (or reuses the one gpu-ab.sh compiled) and runs `engrun logits
# --device cuda` on 1, 2 and 8 sequences of 12 tokens, 4 prefilled and the rest decoded a token
# a step (decode steps of 1, 2 and 8 rows). Prints, per run, the largest logit difference of
# each later binary set against the first, the logits' largest magnitude, and how many positions'
# argmax differ; $OUT/logits-ab.txt keeps the lines.
# With ENGINE_GEMM_CHOICES (one choices file for every binary), the first binary set runs the
# three sequences' counts once before the compared runs, output unused: the 8-sequence run
# times the 8-row GEMMs again inside its decode graph ("GEMMs in the batch-8 graph") and
# rewrites their choices, which the 4-token prefills of the 1- and 2-sequence runs also use, so
# without it the later binaries would read choices the first one's runs did not have (on
# 2026-11-29, 0.02 apart at 1 and 2 sequences between two binaries equal to the bit).
set -euo pipefail
out="${OUT:-/tmp/gpu-out}"
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export ENGINE_CACHE_DIR=/tmp/engine-cache
read -r -a bins <<<"${BINS:-bin-gpu-base bin-gpu}"
seqs() { python3 -c "import random; r = random.Random(7); print(';'.join(','.join(str(r.randrange(1, 1000)) for _ in range(12)) for _ in range($1)))"; }
for ck in ${CKS:-/tmp/ck-qwen2.5-0.5b}; do
  for q in ${QUANTS:-none fp8}; do
    quant=()
    [ "$q" = none ] || quant=(--quant "$q")
    files=()
    warm=${ENGINE_GEMM_CHOICES:+1}
    for bin in "${bins[@]}"; do
      b=$ck${quant[1]:+-${quant[1]}}.$(basename "$bin").bundle
      [ -d "$b" ] || $bin/engc compile "${MODEL:-models/qwen2.yaml}" --checkpoint "$ck" "${quant[@]}" -o "$b" 2>&1 | tail -1
      for n in 1 2 8; do
        [ -z "$warm" ] || "$bin/engrun" logits "$b" --device cuda --ids "$(seqs "$n")" --prefill 4 -o /tmp/logits-ab-warm.safetensors >/dev/null
      done
      warm=
      for n in 1 2 8; do
        f=/tmp/logits-ab-$(basename "$ck")-$q-$(basename "$bin")-$n.safetensors
        "$bin/engrun" logits "$b" --device cuda --ids "$(seqs "$n")" --prefill 4 -o "$f" >/dev/null
        files+=("$f")
      done
    done
    python3 - "$(basename "$ck") $q" "${files[@]}" <<'PY' | tee -a "$out/logits-ab.txt"
import sys
from safetensors.numpy import load_file
label, files = sys.argv[1], sys.argv[2:]
runs = len(files) // 3
for i, n in enumerate((1, 2, 8)):
    a = load_file(files[i])["logits"]
    for r in range(1, runs):
        b = load_file(files[3 * r + i])["logits"]
        d = abs(a - b).max()
        flips = int((a.argmax(-1) != b.argmax(-1)).sum())
        print(f"{label} rows {n} run {r}: max |diff| {d:.5f}, max |logit| {abs(a).max():.3f}, argmax differs at {flips} of {len(a)}")
PY
  done
done
