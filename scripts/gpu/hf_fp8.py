"""An FP8 checkpoint made by HF transformers' fine-grained FP8 quantizer from a bf16 checkpoint,
and HF's logits over it (GPU machine).

Usage: hf_fp8.py BF16_CHECKPOINT OUT_DIR

Loads BF16_CHECKPOINT with `FineGrainedFP8Config()` (E4M3 weights, one scale per 128 x 128
block: `weight_scale_inv`; the lm_head and embeddings stay bf16) and saves it to OUT_DIR as
`save_pretrained` writes it. With REF=0 in the environment that is all (what the benchmarks
need). Else it also writes OUT_DIR/seqs.json (BF16_CHECKPOINT's, from hf_reference.py) and
OUT_DIR/hf_logits.safetensors over those sequences:
  f32   HF's float32 forward of the checkpoint's weights: every FP8 weight dequantized here as
        code * weight_scale_inv of its block, exactly in f32, into the unquantized model class;
  bf16  the same forward in bf16 (HF's own error in a 16-bit type, as for the bf16 check);
  fp8   HF's own FP8 forward (its W8A8 kernels, activations quantized per group of 128), where
        its triton kernels load (the `kernels` package): for information, the engine reads FP8
        weights with 16-bit activations.
"""
import json
import os
import shutil
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config

src, out = sys.argv[1:3]
torch.backends.cuda.matmul.allow_tf32 = False
q = AutoModelForCausalLM.from_pretrained(src, quantization_config=FineGrainedFP8Config(), dtype=torch.bfloat16,
                                         device_map="cuda")
q.save_pretrained(out)
print(f"saved {out}: {json.dumps(q.config.quantization_config.to_dict())}")
if os.environ.get("REF") == "0":
    sys.exit(0)
shutil.copy(f"{src}/seqs.json", f"{out}/seqs.json")
seqs = json.load(open(f"{out}/seqs.json"))


def run(m):
    with torch.no_grad():
        return torch.cat([m(torch.tensor([s]).cuda()).logits[0].float().cpu() for s in seqs])


def dequantized():
    """The checkpoint's tensors with every FP8 weight as code * its block's scale, in f32."""
    tensors = {}
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    for f in files:
        with safe_open(f"{out}/{f}", "pt") as st:
            for k in st.keys():
                tensors[k] = st.get_tensor(k)
    state, fp8 = {}, 0
    for k, t in tensors.items():
        if k.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = tensors[k + "_scale_inv"].float()
            n, kk = t.shape
            bn, bk = -(-n // s.shape[0]), -(-kk // s.shape[1])
            s = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :kk]
            state[k] = t.float() * s
            fp8 += 1
        else:
            state[k] = t.float()
    return state, fp8


try:
    fp8_logits = run(q)
except ImportError as e:  # its triton kernels come from the `kernels` package, absent offline
    print(f"no HF FP8 forward: {e}")
    fp8_logits = None
del q
config = AutoConfig.from_pretrained(src)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config).float()
state, n_fp8 = dequantized()
missing, unexpected = model.load_state_dict(state, strict=False)
# A tied lm_head is absent from the checkpoint; anything else missing is an error.
assert all("lm_head" in m for m in missing) and not unexpected, (missing, unexpected)
if missing:
    model.tie_weights()
f32 = run(model)
bf = run(model.to(torch.bfloat16))
logits = {"f32": f32.contiguous(), "bf16": bf.contiguous()}
if fp8_logits is not None:
    logits["fp8"] = fp8_logits.contiguous()
    print(f"HF's FP8 forward off by {((fp8_logits - f32).abs().max() / f32.abs().max()).item():.4f} of the largest")
save_file(logits, f"{out}/hf_logits.safetensors")
print(f"{out}: {n_fp8} FP8 weights; HF logits of {len(seqs)} sequences")
