#!/usr/bin/env python3
"""Writes the long-context, RoPE-scaling and Qwen3 fixtures under tests/fixtures/.

Each fixture is a tiny random-weight Llama (or Qwen3) checkpoint (vocabulary 512, 2 layers,
hidden 64, 4 query / 2 KV heads of 32, bf16 weights) and Hugging Face transformers' float32
outputs on one long random prompt:

  long-plain/          no scaling, a 700-token prompt (past 512 tokens)
  rope-linear/         linear, factor 4
  rope-llama3/         llama3, factor 8, original context 1024 (kept, smoothed and divided bands)
  rope-yarn/           yarn, factor 4, original context 512
  rope-longrope/       longrope, original context 512 < max_position_embeddings 2048: long factors
  rope-longrope-short/ longrope, original context == max_position_embeddings: short factors
  tiny-qwen3/          Qwen3ForCausalLM (models/qwen3.yaml), the same sizes (head_dim 32, not
                       hidden / heads = 16), no q/k/v biases, RMS norms over each head of q and k
                       (`q_norm`, `k_norm`: weights 1 +- 0.3, so that they matter), RoPE base
                       1e6, a 300-token prompt

Files of a fixture: config.json and model.safetensors (as `save_pretrained` writes them), and
  reference.json         prompt ids, the logit positions, the greedy continuation, versions
  reference.safetensors  float32 `logits` [positions, vocab] at `positions` of the prompt, and
                         `greedy_logits` [steps, vocab]: the logits each greedy token was picked
                         from (row 0 is the prompt's last position)

Seeded and deterministic (CPU, eager attention, float32 compute on the bf16 weights). To
regenerate (creates the virtual environment once; torch comes from PyPI):

  python3 -m venv ~/.cache/engine/refenv
  ~/.cache/engine/refenv/bin/pip install torch 'transformers==5.*' safetensors
  ~/.cache/engine/refenv/bin/python scripts/make-references.py [OUT_DIR]

OUT_DIR defaults to tests/fixtures next to this script's parent.
"""

import json
import math
import platform
import shutil
import sys
from pathlib import Path

import safetensors.torch
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

VOCAB = 512
HEAD_DIM = 32
GREEDY_STEPS = 8
SEED = 1234

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=HEAD_DIM,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    attention_bias=False,
    mlp_bias=False,
)


def ramp(lo, hi, n):
    """n factors from lo to hi, geometric, rounded to 4 decimals (as configs write them)."""
    return [round(lo * (hi / lo) ** (i / (n - 1)), 4) for i in range(n)]


# Per-dimension longrope factors, HEAD_DIM / 2 of each: short ones near 1, long ones rising to
# about the extension factor at the low frequencies (the shape of Phi-3's lists).
SHORT = [round(1.0 + 0.05 * math.sin(i), 4) for i in range(HEAD_DIM // 2)]
LONG = ramp(1.0, 6.0, HEAD_DIM // 2)

FIXTURES = {
    "long-plain": dict(prompt=700, rope_theta=10000.0, max_position_embeddings=1024, rope_scaling=None),
    "rope-linear": dict(
        prompt=1536, rope_theta=10000.0, max_position_embeddings=4096, rope_scaling={"rope_type": "linear", "factor": 4.0}
    ),
    "rope-llama3": dict(
        prompt=1536,
        rope_theta=10000.0,
        max_position_embeddings=8192,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ),
    "rope-yarn": dict(
        prompt=1536,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    ),
    "rope-longrope": dict(
        prompt=1536,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": 512,
        },
    ),
    "rope-longrope-short": dict(
        prompt=600,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": SHORT,
            "long_factor": LONG,
            "original_max_position_embeddings": 2048,
        },
    ),
    "tiny-qwen3": dict(arch="qwen3", prompt=300, rope_theta=1000000.0, max_position_embeddings=1024, rope_scaling=None),
}

# The Qwen3 fixture's config: BASE's sizes (head_dim 32 while hidden / heads is 16) without the
# Llama-only `mlp_bias`.
QWEN3 = {k: v for k, v in BASE.items() if k != "mlp_bias"}


def make_config(spec):
    params = {"rope_type": "default", "rope_theta": spec["rope_theta"]}
    if spec["rope_scaling"]:
        params.update(spec["rope_scaling"])
    if spec.get("arch") == "qwen3":
        return Qwen3Config(**QWEN3, max_position_embeddings=spec["max_position_embeddings"], rope_parameters=params)
    return LlamaConfig(**BASE, max_position_embeddings=spec["max_position_embeddings"], rope_parameters=params)


def make_model(config, seed):
    """Random weights, rounded to bf16 and held in float32. q and k are larger than the rest so
    that attention scores (and with them the rotary positions) move the logits clearly. Per-head
    q/k norm weights (Qwen3) spread wider than the other norms', so that they matter."""
    torch.manual_seed(seed)
    cls = Qwen3ForCausalLM if isinstance(config, Qwen3Config) else LlamaForCausalLM
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "q_proj" in name or "k_proj" in name:
                p.copy_(0.15 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model


def logits_of(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def greedy(model, ids, steps):
    """Greedy tokens, each from a full forward of the sequence so far (no cache: one rotary
    table per call, as HF picks it from the call's length), and the logits they came from."""
    seq, tokens, rows = list(ids), [], []
    for _ in range(steps):
        row = logits_of(model, seq)[-1]
        t = int(torch.argmax(row))
        tokens.append(t)
        rows.append(row)
        seq.append(t)
    return tokens, torch.stack(rows)


def write_fixture(out, name, spec, seed):
    config = make_config(spec)
    model = make_model(config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(3, VOCAB, (spec["prompt"],), generator=gen).tolist()
    n = len(prompt)
    positions = sorted(set(range(0, n, 64)) | set(range(n - 8, n)))
    all_logits = logits_of(model, prompt)
    tokens, greedy_logits = greedy(model, prompt, GREEDY_STEPS)
    assert torch.equal(greedy_logits[0], all_logits[-1])

    d = out / name
    shutil.rmtree(d, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(d)
    (d / "generation_config.json").unlink(missing_ok=True)
    model.to(torch.float32)
    safetensors.torch.save_file(
        {"logits": all_logits[positions].contiguous(), "greedy_logits": greedy_logits.contiguous()},
        d / "reference.safetensors",
    )
    # How much the scaling moves the logits: the test tolerance (1e-4 relative) is far below it.
    moved = None
    if spec["rope_scaling"]:
        plain = make_model(make_config({**spec, "rope_scaling": None}), seed)
        diff = (logits_of(plain, prompt)[positions] - all_logits[positions]).abs().max()
        moved = float(diff / all_logits[positions].abs().max())
    meta = {
        "made_by": "scripts/make-references.py",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "seed": seed,
        "prompt": prompt,
        "positions": positions,
        "greedy": tokens,
        "scaling_moves_logits_by": moved,
    }
    lines = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items()]
    (d / "reference.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"{name}: {n} tokens, {len(positions)} logit rows, greedy {tokens}, scaling moves logits by {moved}")


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "tests/fixtures"
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    for i, (name, spec) in enumerate(FIXTURES.items()):
        write_fixture(out, name, spec, SEED + 100 * i)


if __name__ == "__main__":
    main()
