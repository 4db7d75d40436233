"""An FP8 checkpoint made from a bf16 checkpoint, and HF's logits over it (GPU machine).

Usage: hf_fp8.py BF16_CHECKPOINT OUT_DIR

Loads BF16_CHECKPOINT with HF transformers' `FineGrainedFP8Config()` (E4M3 weights, one scale
per 128 x 128 block: `weight_scale_inv`; the lm_head and embeddings stay bf16) and saves it to
OUT_DIR as `save_pretrained` writes it. With FP8=channel in the environment it writes instead
the compressed-tensors per-channel format of the `-FP8-dynamic` releases (the decoder layers'
linears as E4M3 with a bf16 `weight_scale` [n, 1] = max |row| / 448, the config's
`quantization_config` as such a release has it): compressed-tensors' own quantizer is not
installed there, so this script quantizes, by the same rule. With REF=0 in the environment that is all (what the benchmarks
need). Else it also writes OUT_DIR/seqs.json (BF16_CHECKPOINT's, from hf_reference.py) and
OUT_DIR/hf_logits.safetensors over those sequences:
  f32   HF's float32 forward of the checkpoint's weights: every FP8 weight dequantized here as
        code * weight_scale_inv of its block, exactly in f32, into the unquantized model class;
  bf16  the same forward in bf16 (HF's own error in a 16-bit type, as for the bf16 check);
  w8a8  the f32 forward with the input of every FP8 linear quantized to E4M3 as the
        checkpoint's config says (per token and 128 columns for the block-wise format, per token
        for compressed-tensors' dynamic per-token activations) and dequantized: HF's own FP8
        forward (W8A8) emulated in f32, whose error against f32 is what activation quantization
        costs; the engine runs W8A8 where cuBLASLt's FP8 matmul times faster at load;
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
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHANNEL_CONFIG = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
    "config_groups": {"group_0": {
        "targets": ["Linear"], "format": "float-quantized", "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
                    "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True, "group_size": None, "block_structure": None}}},
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weight_files(d):
    """A checkpoint's safetensors files (not the reference logits gpu-check keeps beside them)."""
    return [f for f in os.listdir(d) if f.endswith(".safetensors") and f != "hf_logits.safetensors"]


def channel_checkpoint():
    """The compressed-tensors per-channel FP8 checkpoint of `src` in `out`."""
    os.makedirs(out, exist_ok=True)
    tensors = {}
    for f in weight_files(src):
        with safe_open(f"{src}/{f}", "pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                if ".layers." in k and k.endswith(".weight") and k.split(".")[-2] in LINEARS:
                    w = t.float().to(DEV)
                    scale = (w.abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12).to(torch.bfloat16)
                    tensors[k] = (w / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn).cpu()
                    tensors[k[: -len("weight")] + "weight_scale"] = scale.cpu()
                else:
                    tensors[k] = t
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
    config = json.load(open(f"{src}/config.json"))
    config["quantization_config"] = CHANNEL_CONFIG
    json.dump(config, open(f"{out}/config.json", "w"), indent=2)
    print(f"saved {out}: {json.dumps(CHANNEL_CONFIG)}")


channel = os.environ.get("FP8") == "channel"
if channel:
    channel_checkpoint()
    q = None
else:
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
        return torch.cat([m(torch.tensor([s]).to(DEV)).logits[0].float().cpu() for s in seqs])


def dequantized():
    """The checkpoint's tensors with every FP8 weight as code * its block's scale, in f32."""
    tensors = {}
    for f in weight_files(out):
        with safe_open(f"{out}/{f}", "pt") as st:
            for k in st.keys():
                tensors[k] = st.get_tensor(k)
    state, fp8 = {}, 0
    for k, t in tensors.items():
        if k.endswith(("_scale_inv", "_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = tensors.get(k + "_scale_inv", tensors.get(k + "_scale")).float()
            n, kk = t.shape
            bn, bk = -(-n // s.shape[0]), -(-kk // s.shape[1])
            s = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :kk]
            state[k] = t.float() * s
            fp8 += 1
        else:
            state[k] = t.float()
    return state, fp8


fp8_logits = None
try:
    fp8_logits = None if q is None else run(q)
except ImportError as e:  # its triton kernels come from the `kernels` package, absent offline
    print(f"no HF FP8 forward: {e}")
del q
config = AutoConfig.from_pretrained(src)
with torch.device(DEV):
    model = AutoModelForCausalLM.from_config(config).float()
state, n_fp8 = dequantized()
missing, unexpected = model.load_state_dict(state, strict=False)
# A tied lm_head is absent from the checkpoint; anything else missing is an error.
assert all("lm_head" in m for m in missing) and not unexpected, (missing, unexpected)
if missing:
    model.tie_weights()
f32 = run(model)


def fake_quant(x, group):
    """x's rows as E4M3 codes times one scale per `group` columns (max |x| / 448), in f32."""
    k = x.shape[-1]
    v = x.float().reshape(-1, k // group, group)
    s = v.abs().amax(-1, keepdim=True) / 448.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (v / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s
    return q.reshape(x.shape).to(x.dtype)


fp8_names = {k[: -len(".weight")] for k in state if k.endswith(".weight") and k.rsplit(".", 2)[-2] in LINEARS}
hooks = []
for name, mod in model.named_modules():
    if name in fp8_names:
        group = None if os.environ.get("FP8") == "channel" else 128
        hooks.append(mod.register_forward_pre_hook(
            lambda m, args, g=group: (fake_quant(args[0], g or args[0].shape[-1]),) + args[1:]))
w8a8 = run(model)
for h in hooks:
    h.remove()
print(f"W8A8 (emulated) off by {((w8a8 - f32).abs().max() / f32.abs().max()).item():.4f} of the largest")
bf = run(model.to(torch.bfloat16))
logits = {"f32": f32.contiguous(), "bf16": bf.contiguous(), "w8a8": w8a8.contiguous()}
if fp8_logits is not None:
    logits["fp8"] = fp8_logits.contiguous()
    print(f"HF's FP8 forward off by {((fp8_logits - f32).abs().max() / f32.abs().max()).item():.4f} of the largest")
save_file(logits, f"{out}/hf_logits.safetensors")
print(f"{out}: {n_fp8} FP8 weights; HF logits of {len(seqs)} sequences")
