#!/usr/bin/env python3
"""Writes the FP8 checkpoint fixtures under tests/fixtures/: one tiny random-weight Qwen3 in each
of the two published safetensors FP8 formats, and Hugging Face transformers' float32 outputs of
the model their FP8 weights dequantize to.

Both are Qwen3ForCausalLM (models/qwen3.yaml): vocabulary 512, hidden 128, intermediate 256,
2 layers, 4 query / 2 KV heads of 32, per-head q/k norms, RoPE base 1e6, untied; the weights
drawn as scripts/make-references.py's `make_model` draws them (bf16 values), then the linears
quantized to FP8 E4M3 (embeddings, norms and the lm_head stay bf16, as in the published
checkpoints):

  tiny-qwen3-fp8-block/    transformers' fine-grained FP8 (`quant_method: fp8`, Qwen/Qwen3-8B-FP8's
                           format): 128x128 blocks, each with an f32 `weight_scale_inv` (the value
                           is code * weight_scale_inv[i // 128][j // 128]), quantized by
                           transformers' own `Fp8Quantize._quantize_one`
                           (integrations/finegrained_fp8.py), which leaves a weight whose rows or
                           columns are not whole blocks as it is: the k_proj and v_proj ([64, 128])
                           stay bf16, as that quantizer leaves them. config.json's
                           quantization_config is `FineGrainedFP8Config(weight_block_size=(128,
                           128)).to_dict()`, what save_pretrained writes for it.
  tiny-qwen3-fp8-channel/  compressed-tensors `float-quantized` (the RedHatAI / neuralmagic
                           `-FP8-dynamic` releases' format): one bf16 `weight_scale` per output
                           channel ([n, 1]: max |row| / 448, as compressed-tensors' min-max
                           observer computes it for a symmetric float8 channel scale), the codes
                           (w / scale) clamped to +-448 and cast to float8_e4m3fn (its
                           `_quantize` for a float type), dynamic per-token activations (no
                           activation scales stored), `ignore: [lm_head]`.

The references (reference.json, reference.safetensors: the layout of make-references.py's
fixtures, with `reference_weights` saying where the dequantized weights came from):
  - block: the checkpoint loaded by transformers itself on the CPU (`from_pretrained(...,
    dtype=torch.float32)`: with no GPU its fine-grained FP8 quantizer dequantizes at load,
    `Fp8Dequantize`, code.float() * scale in float32), checked equal to code.float() * scale;
  - channel: transformers' Qwen3ForCausalLM in float32 with code.float() * weight_scale.float()
    loaded into it (loading compressed-tensors checkpoints needs the `compressed-tensors`
    package, and its forward would quantize the activations too, which the engine does not).

Seeded and deterministic (CPU, eager attention, float32 compute). To regenerate (the virtual
environment of make-references.py):

  ~/.cache/engine/refenv/bin/python scripts/make-fp8-fixtures.py [--out DIR] [NAME...]
"""

import argparse
import importlib.util
import json
import platform
import shutil
from pathlib import Path

import safetensors.torch
import torch
import transformers
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Qwen3Config, Qwen3ForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Quantize

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("make_references", HERE / "make-references.py")
refs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refs)

SEED = 4321
PROMPT = 200
FP8_MAX = 448.0
FIXTURES = ("tiny-qwen3-fp8-block", "tiny-qwen3-fp8-channel")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

CONFIG = dict(
    vocab_size=refs.VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    attention_bias=False,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)

# compressed-tensors' serialized QuantizationArgs (quant_args.py) of the FP8_DYNAMIC preset
# scheme: float8 weights with a static per-channel scale, float8 activations quantized per token
# at run time.
CHANNEL_QUANTIZATION = {
    "config_groups": {
        "group_0": {
            "format": "float-quantized",
            "input_activations": {
                "actorder": None,
                "block_structure": None,
                "dynamic": True,
                "group_size": None,
                "num_bits": 8,
                "observer": None,
                "observer_kwargs": {},
                "scale_dtype": None,
                "strategy": "token",
                "symmetric": True,
                "type": "float",
                "zp_dtype": None,
            },
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": None,
                "num_bits": 8,
                "observer": "memoryless_minmax",
                "observer_kwargs": {},
                "scale_dtype": None,
                "strategy": "channel",
                "symmetric": True,
                "type": "float",
                "zp_dtype": None,
            },
        }
    },
    "format": "float-quantized",
    "global_compression_ratio": None,
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
    "sparsity_config": {},
    "transform_config": {},
    "version": "0.12.2",
}


def is_linear(name):
    return name.startswith("model.layers.") and name.endswith(tuple(f"{l}.weight" for l in LINEARS))


class _Quantizer:
    """What `Fp8Quantize` reads of its HfQuantizer: the quantization config."""

    def __init__(self, config):
        self.quantization_config = config


def quantize_block(state):
    """transformers' fine-grained FP8 quantization of every linear (`Fp8Quantize._quantize_one`,
    integrations/finegrained_fp8.py: per 128x128 block, scale = 448 / amax, the codes
    clamp(w * scale, -448, 448).to(float8_e4m3fn), weight_scale_inv = 1 / scale in float32; a
    weight that is not whole blocks comes back as it was)."""
    config = FineGrainedFP8Config(weight_block_size=(128, 128))
    op = Fp8Quantize(_Quantizer(config))
    out = {}
    for name, w in state.items():
        out.update(op._quantize_one(name, w) if is_linear(name) else {name: w})
    return out, config.to_dict()


def quantize_channel(state):
    """compressed-tensors' symmetric float8 per-channel quantization: scale = max |row| / 448
    (float32, then stored in the weights' bf16), codes = clamp(w / scale, -448, 448) cast to
    float8_e4m3fn."""
    out = {}
    for name, w in state.items():
        if not is_linear(name):
            out[name] = w
            continue
        w = w.float()
        amax = w.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(torch.bfloat16)
        out[name] = (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out[name + "_scale"] = scale
    return out, CHANNEL_QUANTIZATION


def dequantized(tensors, suffix):
    """Every FP8 weight as code.float() * scale.float() (its block of the scale grid), the rest as
    float32."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(suffix):
            continue
        if t.dtype != torch.float8_e4m3fn:
            out[name] = t.float()
            continue
        s = tensors[name + suffix].float()
        rows, cols = t.shape
        bm, bn = -(-rows // s.shape[0]), -(-cols // s.shape[1])
        grid = s.repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
        out[name] = t.float() * grid
    return out


def write_fixture(out, name, seed):
    config = Qwen3Config(**CONFIG)
    model = refs.make_model(config, seed)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    block = name.endswith("block")
    tensors, quantization = quantize_block(state) if block else quantize_channel(state)
    suffix = "_scale_inv" if block else "_scale"
    fp8 = sorted(k for k, v in tensors.items() if v.dtype == torch.float8_e4m3fn)
    assert fp8, "no weight was quantized"

    d = out / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    config.architectures = ["Qwen3ForCausalLM"]
    config.dtype = torch.bfloat16
    config.quantization_config = quantization
    config.save_pretrained(d)
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors",
                                metadata={"format": "pt"})

    want = dequantized(tensors, suffix)
    if block:
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        got = ref.state_dict()
        for k, v in want.items():
            assert torch.equal(got[k], v), f"transformers dequantized {k} otherwise"
        how = "transformers' from_pretrained on the CPU (Fp8Dequantize: code.float() * weight_scale_inv)"
    else:
        ref = Qwen3ForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
        ref.load_state_dict(want, strict=True)
        how = "code.float() * weight_scale.float() loaded into transformers' Qwen3ForCausalLM (float32)"
    ref.eval()

    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(3, refs.VOCAB, (PROMPT,), generator=gen).tolist()
    positions = sorted(set(range(0, PROMPT, 64)) | set(range(PROMPT - 8, PROMPT)))
    all_logits = refs.logits_of(ref, prompt)
    # How far the FP8 quantization moved the logits from the bf16 model's: far above the tests'
    # 1e-4, so that reading the weights without their scales, or any other weights, shows.
    bf16 = refs.logits_of(model, prompt)[positions]
    moved = float((bf16 - all_logits[positions]).abs().max() / all_logits[positions].abs().max())
    tokens, greedy_logits = refs.greedy(ref, prompt, refs.GREEDY_STEPS)
    assert torch.equal(greedy_logits[0], all_logits[-1])
    safetensors.torch.save_file(
        {"logits": all_logits[positions].contiguous(), "greedy_logits": greedy_logits.contiguous()},
        d / "reference.safetensors",
    )
    meta = {
        "made_by": "scripts/make-fp8-fixtures.py",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "seed": seed,
        "reference_weights": how,
        "fp8_weights": fp8,
        "quantization_moves_logits_by": moved,
        "prompt": prompt,
        "positions": positions,
        "greedy": tokens,
    }
    lines = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items()]
    (d / "reference.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")
    size = sum(f.stat().st_size for f in d.iterdir())
    top2 = greedy_logits.topk(2, dim=-1).values
    margin = float(((top2[:, 0] - top2[:, 1]) / greedy_logits.abs().amax(dim=-1)).min())
    print(f"{name}: {len(fp8)} FP8 weights, greedy {tokens} (relative top-2 margin min {margin:.3g}), "
          f"quantization moves the logits by {moved:.3g}, {size} bytes")


def main():
    default_out = HERE.parent / "tests/fixtures"
    parser = argparse.ArgumentParser(description="Writes the FP8 checkpoint fixtures (see the docstring).")
    parser.add_argument("--out", type=Path, default=default_out, help=f"output folder (default {default_out})")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"fixtures to write (default all): {', '.join(FIXTURES)}")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in FIXTURES]
    if unknown:
        parser.error(f"unknown fixture(s) {', '.join(unknown)}; known: {', '.join(FIXTURES)}")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    for i, name in enumerate(FIXTURES):
        if not args.names or name in args.names:
            write_fixture(args.out, name, SEED + 100 * i)


if __name__ == "__main__":
    main()
