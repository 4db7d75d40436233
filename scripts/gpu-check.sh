#!/usr/bin/env bash
# Runs on the GPU machine (through the device tool), from the repository root, with release
# binaries in bin-gpu/ (engc, engrun: build them here with `cargo build --release --bins` and
# copy them). Builds random-weight Qwen2 checkpoints of the Qwen2.5-0.5B (and with FULL=1 the
# 7B) shape with HF transformers, compiles bundles, compares our CUDA logits with HF's (in
# f32 and in bf16), then runs a short benchmark. Results go to $OUT (default /tmp/gpu-out).
set -euo pipefail
out="${OUT:-/tmp/gpu-out}"
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
shapes="qwen2.5-0.5b"
[ "${FULL:-0}" = 1 ] && shapes="qwen2.5-0.5b qwen2.5-7b"
for shape in $shapes; do
  ck=/tmp/ck-$shape
  python3 - "$shape" "$ck" "tests/configs/$shape.json" <<'PY' 2>&1 | tee "$out/$shape-hf.txt"
import json, sys, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from safetensors.torch import save_file
shape, ck, cfg_path = sys.argv[1:4]
cfg = json.load(open(cfg_path))
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
config = Qwen2Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
# Build in f32 with weights rounded to bf16 values: the f32 reference (RoPE frequencies in f32,
# as HF computes them at load) and the bf16 model then hold the very same weights.
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
ids = torch.randint(0, config.vocab_size, (1, 64), generator=g)
with torch.no_grad():
    f32 = model(ids.cuda()).logits[0].float()
    model = model.to(torch.bfloat16)
    bf = model(ids.cuda()).logits[0].float()
model.save_pretrained(ck)
json.dump(ids[0].tolist(), open(f"{ck}/ids.json", "w"))
save_file({"bf16": bf.cpu().contiguous(), "f32": f32.cpu().contiguous()}, f"{ck}/hf_logits.safetensors")
print(f"{shape}: saved random checkpoint and HF logits for 64 tokens")
PY
  bin-gpu/engc compile models/qwen2.yaml --checkpoint "$ck" --dtype bf16 -o "$ck.bundle" 2>&1 | tail -3 | tee -a "$out/$shape-compile.txt"
  ids=$(python3 -c "import json; print(','.join(map(str, json.load(open('$ck/ids.json')))))")
  bin-gpu/engrun logits "$ck.bundle" --device cuda --ids "$ids" -o "$ck/ours.safetensors" 2>&1 | tee "$out/$shape-ours.txt"
  python3 - "$ck" "$shape" <<'PY' 2>&1 | tee "$out/$shape-compare.txt"
import sys
from safetensors.torch import load_file
ck, shape = sys.argv[1:3]
ours = load_file(f"{ck}/ours.safetensors")["logits"]
ref = load_file(f"{ck}/hf_logits.safetensors")
for kind in ("f32", "bf16"):
    r = ref[kind]
    last = (ours[-1] - r[-1]).abs().max() / r[-1].abs().max()
    allp = (ours - r).abs().max() / r.abs().max()
    agree = (ours.argmax(-1) == r.argmax(-1)).float().mean()
    print(f"{shape} vs HF {kind}: last-position rel err {last:.2e}, all positions {allp:.2e}, argmax agreement {agree:.3f}")
PY
  bin-gpu/engrun bench "$ck.bundle" --device cuda --num-prompts 1 --input-len 128 --output-len 32 --json 2>&1 | tail -1 | tee "$out/$shape-bench-b1.json"
  bin-gpu/engrun bench "$ck.bundle" --device cuda --num-prompts 16 --input-len 128 --output-len 32 --json 2>&1 | tail -1 | tee "$out/$shape-bench-b16.json"
done
# The nano-vllm workload on the 0.5B shape (issue "Runtime"): 256 requests, input and output
# lengths uniform in [100, 1024], random ids, eos ignored; with and without overlap, and with a
# shared prefix.
if [ "${ENGINE_BENCH:-0}" = 1 ]; then
  b=/tmp/ck-qwen2.5-0.5b.bundle
  common="--device cuda --num-prompts 256 --input-len 1024 --output-len 1024 --random-range-ratio 0.0977 --max-total-tokens 400000 --json"
  bin-gpu/engrun bench $b $common 2>&1 | tail -1 | tee "$out/nanovllm-overlap.json"
  bin-gpu/engrun bench $b $common --disable-overlap 2>&1 | tail -1 | tee "$out/nanovllm-no-overlap.json"
  bin-gpu/engrun bench $b $common --shared-prefix-len 512 2>&1 | tail -1 | tee "$out/nanovllm-shared512.json"
fi
