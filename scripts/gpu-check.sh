#!/usr/bin/env bash
# Runs on the GPU machine (through the device tool), from the repository root, with release
# binaries in bin-gpu/ (engc, engrun: build them here with `cargo build --release --bins` and
# copy them). For each shape in SHAPES (default: qwen2.5-0.5b; qwen2.5-7b too with FULL=1):
# builds a random-weight Qwen2 checkpoint with HF transformers, compiles a bundle, and compares
# our CUDA logits with HF's (f32 forward over the same bf16 weights, and HF's bf16 forward):
# batch 1 (40 tokens prefilled, then 24 decode steps) and batch 16 of mixed lengths (24 tokens
# prefilled each, then decode steps as one shrinking batch), and the GPU's sampling kernel
# against the host's rule on the same logits. Then benchmarks (BENCH=0 skips):
# batch-1 decode (with the default device: auto; and without PDL), a 4096-token prefill, batches of 16 and 64, and a second start with a warm
# kernel cache. TPS="1 2" repeats the checks and benchmarks with a --tp 2 bundle on two GPUs
# (compared with HF and with tp=1; batch-1 decode also with NCCL-only collectives; batches 1 and
# 64 also with a replicated lm_head). DTYPES="bf16 f16" repeats everything with bundles compiled
# with --dtype f16 (IEEE halves for weights, linear inputs and the KV cache; result files get a
# -f16 suffix). Results go to $OUT (default /tmp/gpu-out).
set -euo pipefail
out="${OUT:-/tmp/gpu-out}"
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export ENGINE_CACHE_DIR=/tmp/engine-cache NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
shapes="${SHAPES:-qwen2.5-0.5b}"
[ "${FULL:-0}" = 1 ] && shapes="qwen2.5-0.5b qwen2.5-7b"
for shape in $shapes; do
  ck=/tmp/ck-$shape
  if [ ! -f "$ck/hf_logits.safetensors" ]; then
  python3 - "$shape" "$ck" "tests/configs/$shape.json" <<'PY' 2>&1 | tee "$out/$shape-hf.txt"
import json, sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from safetensors.torch import save_file
shape, ck, cfg_path = sys.argv[1:4]
cfg = json.load(open(cfg_path))
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
config = Qwen2Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
# Built in f32 with weights rounded to bf16 values: the f32 reference and the bf16 model hold
# the very same weights.
with torch.device("cuda"):
    model = Qwen2ForCausalLM(config).float()
with torch.no_grad():
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        else:
            p.normal_(0, 0.02)
        p.copy_(p.bfloat16().float())
g = torch.Generator().manual_seed(1)
seqs = [torch.randint(0, config.vocab_size, (64,), generator=g).tolist()]
seqs += [torch.randint(0, config.vocab_size, (40 + 2 * i,), generator=g).tolist() for i in range(16)]
def run(m):
    with torch.no_grad():
        return torch.cat([m(torch.tensor([s]).cuda()).logits[0].float().cpu() for s in seqs])
f32 = run(model)
bf = run(model.to(torch.bfloat16))
model.save_pretrained(ck)
# HF's own f16 forward (the bf16 weights are exact in f16), for comparison with ours.
f16 = run(model.to(torch.float16))
json.dump(seqs, open(f"{ck}/seqs.json", "w"))
save_file({"bf16": bf.contiguous(), "f32": f32.contiguous(), "f16": f16.contiguous()}, f"{ck}/hf_logits.safetensors")
print(f"{shape}: saved a random checkpoint and HF logits of {len(seqs)} sequences")
PY
  fi
  one=$(python3 -c "import json; print(','.join(map(str, json.load(open('$ck/seqs.json'))[0])))")
  many=$(python3 -c "import json; print(';'.join(','.join(map(str, s)) for s in json.load(open('$ck/seqs.json'))[1:]))")
  for dtype in ${DTYPES:-bf16}; do
  for tp in ${TPS:-1}; do
  # Result suffix: -f16 for f16 bundles, then -tpN for tensor-parallel ones.
  dsfx=""
  [ "$dtype" = bf16 ] || dsfx="-$dtype"
  b="$ck$dsfx.bundle" sfx="$dsfx"
  [ "$tp" = 1 ] || { b="$ck$dsfx.tp$tp.bundle"; sfx="$dsfx-tp$tp"; }
  [ -d "$b" ] || bin-gpu/engc compile models/qwen2.yaml --checkpoint "$ck" --dtype "$dtype" --tp "$tp" -o "$b" 2>&1 | tail -2 | tee -a "$out/$shape$sfx-compile.txt"
  rm -rf /tmp/engine-cache
  /usr/bin/time -f "%e s wall" bin-gpu/engrun logits "$b" --device cuda --ids "$one" --prefill 40 -o "$ck/b1$sfx.safetensors" 2>&1 | tee "$out/$shape-b1$sfx.txt"
  /usr/bin/time -f "%e s wall (warm kernel cache)" bin-gpu/engrun logits "$b" --device cuda --ids "$many" --prefill 24 -o "$ck/b16$sfx.safetensors" 2>&1 | tee "$out/$shape-b16$sfx.txt"
  python3 - "$ck" "$shape" "$sfx" "$dsfx" <<'PY' 2>&1 | tee "$out/$shape$sfx-compare.txt"
import json, os, sys, torch
from safetensors.torch import load_file
ck, shape, sfx, dsfx = sys.argv[1:5]
seqs = json.load(open(f"{ck}/seqs.json"))
ref = load_file(f"{ck}/hf_logits.safetensors")
lens = [len(s) for s in seqs]
for run, first, count, pre in (("b1", 0, 1, 40), ("b16", 1, 16, 24)):
    ours = load_file(f"{ck}/{run}{sfx}.safetensors")["logits"]
    start = sum(lens[:first])
    refs = [(f"hf_{k}", ref[k][start:start + ours.shape[0]]) for k in ("f32", "bf16", "f16") if k in ref]
    if sfx != dsfx and os.path.exists(f"{ck}/{run}{dsfx}.safetensors"):
        refs.append(("tp1", load_file(f"{ck}/{run}{dsfx}.safetensors")["logits"]))
    for kind, r in refs:
        last, allp, clear, same, at = 0.0, 0.0, 0, 0, 0
        for n in lens[first:first + count]:
            o, h = ours[at:at + n], r[at:at + n]
            at += n
            last = max(last, ((o[-1] - h[-1]).abs().max() / h[-1].abs().max()).item())
            allp = max(allp, ((o - h).abs().max() / h.abs().max()).item())
            err = (o - h).abs().max(-1).values
            top = h.topk(2, -1).values
            ok = (top[:, 0] - top[:, 1]) > 2 * err
            # decode positions only (after the prefill), as greedy decoding would see them
            ok[:pre] = False
            clear += ok.sum().item()
            same += (ok & (o.argmax(-1) == h.argmax(-1))).sum().item()
        print(json.dumps({"shape": shape, "run": run + sfx, "vs": kind, "last_rel_err": last,
                          "all_rel_err": allp, "greedy_equal": same, "greedy_clear": clear}))
PY
  # The sampling kernels against the host's rule, on the same logits and numbers (top-k 1:
  # greedy, the split argmax).
  for spec in "--temperature 1.0 --top-k 1" "--temperature 0.7 --top-p 0.9" "--temperature 0.3 --top-p 0.95" "--temperature 1.0 --top-k 50 --min-p 0.05" "--temperature 1.3"; do
    r=$(bin-gpu/engrun logits "$b" --device cuda --ids "$many" --prefill 24 $spec -o /tmp/sample-check.safetensors 2>/dev/null | tail -1)
    echo "$spec: $r" | tee -a "$out/$shape$sfx-sampling.txt"
  done
  if [ "${BENCH:-1}" = 1 ]; then
    bin-gpu/engrun bench $b --num-prompts 1 --input-len 128 --output-len 128 --json 2>&1 | tail -1 | tee "$out/$shape$sfx-bench-b1.json"
    # Without programmatic dependent launches (each kernel starts after the previous one ends).
    ENGINE_PDL=0 bin-gpu/engrun bench $b --num-prompts 1 --input-len 128 --output-len 128 --json 2>&1 | tail -1 | tee "$out/$shape$sfx-bench-b1-nopdl.json"
    [ "$tp" = 1 ] || ENGINE_ALLREDUCE=nccl bin-gpu/engrun bench $b --num-prompts 1 --input-len 128 --output-len 128 --json 2>&1 | tail -1 | tee "$out/$shape$sfx-bench-b1-nccl.json"
    bin-gpu/engrun bench $b --device cuda --num-prompts 1 --input-len 4096 --output-len 2 --json 2>&1 | tail -1 | tee "$out/$shape$sfx-bench-prefill4096.json"
    # Our GEMM kernel alone (no cuBLASLt where the start-up timing chose it).
    ENGINE_CUBLASLT=0 bin-gpu/engrun bench $b --device cuda --num-prompts 1 --input-len 4096 --output-len 2 --json 2>&1 | tail -1 | tee "$out/$shape$sfx-bench-prefill4096-ours.json"
    bin-gpu/engrun bench $b --device cuda --num-prompts 16 --input-len 128 --output-len 128 --json 2>&1 | tail -1 | tee "$out/$shape$sfx-bench-b16.json"
    bin-gpu/engrun bench $b --device cuda --num-prompts 64 --input-len 128 --output-len 128 --json 2>&1 | tail -1 | tee "$out/$shape$sfx-bench-b64.json"
    # The other lm_head layout of a tensor-parallel bundle: replicated (the default splits it
    # by vocabulary and gathers the logits).
    if [ "$tp" != 1 ]; then
      rb="$ck$dsfx.tp$tp-replicated.bundle"
      [ -d "$rb" ] || bin-gpu/engc compile models/qwen2.yaml --checkpoint "$ck" --dtype "$dtype" --tp "$tp" --lm-head replicated -o "$rb" 2>&1 | tail -1
      for n in 1 64; do
        bin-gpu/engrun bench $rb --device cuda --num-prompts $n --input-len 128 --output-len 128 --json 2>&1 | tail -1 | tee "$out/$shape$sfx-replicated-bench-b$n.json"
      done
    fi
    # Sampled on the GPU (temperature 0.7, top-p 0.9) instead of greedy.
    for n in 1 64; do
      bin-gpu/engrun bench $b --device cuda --num-prompts $n --input-len 128 --output-len 128 --temperature 0.7 --top-p 0.9 --json 2>&1 | tail -1 | tee "$out/$shape$sfx-bench-b$n-top-p.json"
    done
  fi
  done
  done
done
# The nano-vllm workload on the 0.5B shape (issue "Runtime"): 256 requests, input and output
# lengths uniform in [100, 1024], random ids, eos ignored.
if [ "${ENGINE_BENCH:-0}" = 1 ]; then
  b=/tmp/ck-qwen2.5-0.5b.bundle
  common="--device cuda --num-prompts 256 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 --max-total-tokens 400000 --json"
  bin-gpu/engrun bench $b $common 2>&1 | tail -1 | tee "$out/nanovllm-overlap.json"
fi
