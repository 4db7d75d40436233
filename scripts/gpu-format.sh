#!/usr/bin/env bash
# Output formats on the GPU, with a verdict: runs on the GPU machine (through the device tool)
# from the repository root, with release binaries in $BIN (default bin-gpu/) and Qwen's real
# tokenizer in $QWEN_TOKENIZER (default $BIN/qwen-tokenizer: copy the folder
# scripts/fetch-qwen-tokenizer.sh prints there), so that every mask covers Qwen's 151k tokens.
# Builds the random Qwen2.5-0.5B checkpoint of scripts/gpu-check.sh (bf16), serves it and runs
# scripts/gpu/format_bench.py at N = 1, 16 and 64 concurrent requests of 128 tokens:
# unconstrained, SGLang's `regex`, SGLang's `json_schema`. Every constrained text must be in its
# format (a failed check otherwise); the throughput ratios go to docs/perf.md. Raw results go to
# $WORK (default /tmp/gpu-format), packed into $OUT/gpu-format$TAG.tgz when $OUT is set.
set -uo pipefail
work="${WORK:-/tmp/gpu-format}"
bin="${BIN:-bin-gpu}"
tok="${QWEN_TOKENIZER:-$bin/qwen-tokenizer}"
rm -rf "$work"
mkdir -p "$work"
checks="$work/checks.jsonl"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export ENGINE_CACHE_DIR=/tmp/engine-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$work/gpu.txt"
shape=qwen2.5-0.5b
ck=/tmp/ck-$shape
if [ ! -f "$ck/config.json" ]; then
  python3 scripts/gpu/hf_reference.py "$shape" "$ck" "tests/configs/$shape.json" >"$work/hf.txt" 2>&1 || {
    tail -5 "$work/hf.txt"
    exit 1
  }
fi
# The checkpoint with Qwen's tokenizer beside it.
qk=$ck-qwen-tokenizer
rm -rf "$qk" "$qk.bundle"
mkdir -p "$qk"
for f in "$ck"/*; do ln -s "$f" "$qk/"; done
rm -f "$qk/tokenizer.json" "$qk/tokenizer_config.json"
cp "$tok/tokenizer.json" "$tok/tokenizer_config.json" "$qk/"
"$bin/engc" compile --checkpoint "$qk" --dtype bf16 -o "$qk.bundle" >"$work/compile.txt" 2>&1 || {
  tail -5 "$work/compile.txt"
  exit 1
}
"$bin/engrun" serve "$qk.bundle" --device cuda --port 30124 >"$work/serve.txt" 2>&1 &
spid=$!
for _ in $(seq 300); do
  grep -q "serving" "$work/serve.txt" || ! kill -0 "$spid" 2>/dev/null && break
  sleep 1
done
for n in 1 16 64; do
  python3 scripts/gpu/format_bench.py http://127.0.0.1:30124/v1 "$n" 128 "$checks" 2>&1 | tee -a "$work/format.txt"
done
kill -TERM "$spid"
wait "$spid"
# The offline benchmark, 64 requests of 128 tokens sampled at temperature 1: unconstrained, then
# every request carrying the JSON schema (no generated token may break it).
io="--num-prompts 64 --input-len 128 --output-len 128 --temperature 1.0 --json"
"$bin/engrun" bench "$qk.bundle" --device cuda $io 2>"$work/bench-free.err" | tail -1 | tee "$work/bench-free.json"
"$bin/engrun" bench "$qk.bundle" --device cuda $io --json-schema scripts/gpu/array-schema.json 2>"$work/bench-schema.err" |
  tail -1 | tee "$work/bench-schema.json"
python3 - "$work" "$checks" <<'PY'
import json, sys
work, checks = sys.argv[1], sys.argv[2]
try:
    free, schema = (json.load(open(f"{work}/bench-{n}.json")) for n in ("free", "schema"))
    bad, ratio = schema["format_violations"], schema["output_tok_s"] / free["output_tok_s"]
except (OSError, ValueError, KeyError) as e:
    bad, ratio = 1, 0.0
    print(f"bench failed: {e}")
print(json.dumps({"bench": "json_schema_b64", "ratio": round(ratio, 3), "format_violations": bad}))
with open(checks, "a") as f:
    f.write(json.dumps({"check": "bench_schema_b64", "value": bad, "limit": 0, "pass": bad == 0,
                        "ratio": round(ratio, 3), "note": "generated tokens that break the schema"}) + "\n")
PY
python3 scripts/gpu/verdict.py "$checks" 4 | tee "$work/verdict.txt"
status=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  cp "$work/verdict.json" "$OUT/verdict-format${TAG:-}.json"
  tar czf "$OUT/gpu-format${TAG:-}.tgz" -C "$work" .
fi
exit "$status"
