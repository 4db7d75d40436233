"""A random-weight checkpoint of a model shape (any causal LM transformers knows by `model_type`) and HF transformers' logits over it (GPU machine).

Usage: hf_reference.py SHAPE CHECKPOINT_DIR CONFIG_JSON

With REF=0 in the environment only the checkpoint is written (bf16, no reference logits): what
the benchmarks need. The model is then built in bf16 on the GPU, so a shape of up to ~65 GB of
weights fits an H200 (the full Qwen3-30B-A3B: 61 GB).

Builds the model in f32 (a mixture of experts' routers with a wider spread: `is_router`) with weights rounded to bf16 values (so the f32 reference and the bf16
model hold the very same weights), saves it to CHECKPOINT_DIR, and writes there `seqs.json` (the
token sequences: one of 64 tokens, 16 of 40 + 2i tokens, one of 520 tokens) and
`hf_logits.safetensors` with the logits of every position of every sequence, one after the
other, from HF's f32, bf16 and f16 forwards.
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

shape, ck, cfg_path = sys.argv[1:4]
cfg = json.load(open(cfg_path))
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
extra = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
config = AutoConfig.for_model(cfg["model_type"], **extra)
config.architectures = cfg["architectures"]
ref = os.environ.get("REF") != "0"
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if ref else torch.bfloat16)
# Gemma's norms multiply by (1 + w): their stored weights sit near 0, not 1 (a stored 1 would
# double every norm's output, sharpen attention to near one-hot and make the bf16 forward
# chaotic).
center = 0.0 if cfg["model_type"].startswith("gemma") else 1.0


def is_router(name):
    """Qwen3-MoE's `mlp.gate`, Mixtral's `block_sparse_moe.gate`, gpt-oss's `mlp.router`."""
    return name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")) or ".mlp.router." in name

with torch.no_grad():
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(center + 0.1 * torch.randn_like(p))
        elif is_router(name):
            # A mixture of experts' router with a trained router's spread of logits (several
            # units): at 0.02 every token's experts are near ties and weighted alike, so any
            # rounding swaps one of them for a weight of 1/k (HF's own bf16 forward too).
            p.normal_(0, 0.1)
        else:
            p.normal_(0, 0.02)
        p.copy_(p.bfloat16().float())
g = torch.Generator().manual_seed(1)
seqs = [torch.randint(0, config.vocab_size, (64,), generator=g).tolist()]
seqs += [torch.randint(0, config.vocab_size, (40 + 2 * i,), generator=g).tolist() for i in range(16)]
# A prefill long enough for the extend GEMMs of a larger token bucket (cuBLASLt's or ours).
seqs += [torch.randint(0, config.vocab_size, (520,), generator=g).tolist()]


def run(m):
    with torch.no_grad():
        return torch.cat([m(torch.tensor([s]).cuda()).logits[0].float().cpu() for s in seqs])


if not ref:
    model.save_pretrained(ck)
    print(f"{shape}: saved a random checkpoint (no reference logits)")
    sys.exit(0)
f32 = run(model)
bf = run(model.to(torch.bfloat16))
model.save_pretrained(ck)
# HF's own f16 forward (the bf16 weights are exact in f16), for comparison with ours.
f16 = run(model.to(torch.float16))
json.dump(seqs, open(f"{ck}/seqs.json", "w"))
save_file({"bf16": bf.contiguous(), "f32": f32.contiguous(), "f16": f16.contiguous()}, f"{ck}/hf_logits.safetensors")
print(f"{shape}: saved a random checkpoint and HF logits of {len(seqs)} sequences")
