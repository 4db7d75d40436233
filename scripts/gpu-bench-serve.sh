#!/usr/bin/env bash
# `engrun bench-serve` against `engrun serve` on the GPU beside the offline `engrun bench` of
# the same workload (the nano-vllm one by default: 256 requests, input and output lengths
# uniform in [~100, 1024]), on a random checkpoint of tests/configs/$SHAPE.json (made as
# scripts/gpu-check.sh makes it). Run on the GPU machine with release binaries in $BIN; the
# two JSON results go to $OUT/bench-serve-$SHAPE.jsonl (offline first).
set -uo pipefail
bin="${BIN:-bin-gpu}" shape="${SHAPE:-qwen2.5-0.5b}" n="${N:-256}" len="${LEN:-1024}" ratio="${RATIO:-0.1}"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export ENGINE_CACHE_DIR=/tmp/engine-cache
ck=/tmp/ck-$shape b=/tmp/ck-$shape.bundle out="${OUT:-/tmp}/bench-serve-$shape.jsonl"
[ -f "$ck/config.json" ] || python3 scripts/gpu/hf_reference.py "$shape" "$ck" "tests/configs/$shape.json" >/dev/null 2>&1
# A real Qwen tokenizer ($TOKENIZER: a folder with tokenizer.json), so the served text decodes.
cp "${TOKENIZER:-$bin/qwen-tokenizer}"/tokenizer*.json "$ck/"
[ -d "$b" ] || "$bin/engc" compile --checkpoint "$ck" --dtype bf16 -o "$b" >/dev/null 2>&1 || exit 1
"$bin/engrun" bench "$b" --device cuda --num-prompts "$n" --input-len "$len" --output-len "$len" \
  --random-range-ratio "$ratio" --json 2>/dev/null | tail -1 >"$out"
"$bin/engrun" serve "$b" --device cuda --port 30123 >/tmp/serve.log 2>&1 &
pid=$!
for _ in $(seq 300); do grep -q serving /tmp/serve.log && break; sleep 1; done
vocab=$(python3 -c "import json; print(json.load(open('$ck/config.json'))['vocab_size'])")
"$bin/engrun" bench-serve --base-url http://127.0.0.1:30123 --num-prompts "$n" --random-input-len "$len" \
  --random-output-len "$len" --random-range-ratio "$ratio" --max-concurrency "$n" --random-vocab-size "$vocab" \
  --output-file "$out" --disable-tqdm
kill -TERM "$pid"
wait "$pid"
python3 - "$out" <<'PY'
import json, sys
off, on = [json.loads(l) for l in open(sys.argv[1])]
print(f"offline output {off['output_tok_s']:.0f} tok/s; served {on['output_throughput']:.0f} tok/s "
      f"({on['output_throughput'] / off['output_tok_s']:.2f}x), {on['completed']} completed, {on['failed']} failed")
PY
