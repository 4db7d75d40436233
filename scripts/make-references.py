#!/usr/bin/env python3
"""Writes the long-context, RoPE-scaling and per-architecture fixtures under tests/fixtures/.

Each fixture is a tiny random-weight checkpoint (vocabulary 512, bf16 weights) and Hugging Face
transformers' float32 outputs on one long random prompt. The Llama ones (and tiny-qwen3) have
2 layers, hidden 64, 4 query / 2 KV heads of 32:

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
  tiny-gemma2/         Gemma2ForCausalLM: hidden 64, 4 layers (sliding, full, sliding, full: the
                       config's default `layer_types`), 4 / 2 heads of 32, scores scaled by
                       query_pre_attn_scalar 24 ** -0.5, a 48-token window, attention and final
                       logit softcapping 5 and 8, gelu (tanh) MLP, the four (1 + w) norms of a
                       layer (stored w ~ 0.1 N(0, 1)), embeddings times sqrt(64) and tied to the
                       lm_head, RoPE base 1e4, a 300-token prompt
  tiny-gemma3/         Gemma3ForCausalLM (Gemma3TextConfig): the same sizes, layer_types
                       3 x sliding then full, window 48, per-head q/k norms (1 + w, stored
                       w ~ 0.3 N(0, 1)), RoPE per layer type (sliding: base 1e4; full: base 1e6,
                       linear factor 2), no softcapping, a 300-token prompt
  tiny-mistral/        MistralForCausalLM: hidden 64, 2 layers, 4 / 2 heads of 32 (not 64 / 4),
                       a 48-token window on every layer, untied, RoPE base 1e4, 300 tokens
  tiny-phi3/           Phi3ForCausalLM: hidden 128, 2 layers, 4 / 2 heads of 32 (hidden / heads),
                       fused qkv_proj and gate_up_proj, partial_rotary_factor 0.5 (RoPE on the
                       first 16 of each head's 32), longrope (8 short / 8 long factors, original
                       context 512 < max 2048), untied, a 600-token prompt (the long factors)
  tiny-qwen3-moe/      Qwen3MoeForCausalLM: hidden 64, 3 layers, 4 / 2 heads of 32, per-head q/k
                       norms; layers 0 and 2 sparse (8 experts of 32, top 2 of the softmax,
                       renormalised: norm_topk_prob), layer 1 a dense MLP of 96 (mlp_only_layers
                       [1]), RoPE base 1e6, untied, a 300-token prompt
  tiny-mixtral/        MixtralForCausalLM: hidden 64, 2 layers, 4 / 2 heads of 32, 8 experts of
                       48, top 2 (renormalised), no window, RoPE base 1e6, untied, 300 tokens
  tiny-gpt-oss/        GptOssForCausalLM: hidden 64, 4 layers (sliding, full, sliding, full),
                       window 48, 4 / 2 heads of 32 with q/k/v/o biases and per-head sinks
                       (4 + 2 N(0, 1)), 8 experts of 32 with biases, router with a bias (softmax
                       over the top 2 logits), clamped SwiGLU (limit 7, alpha 1.702; gate_up_proj
                       0.4 N(0, 1), so that 1-5% of the values pass the limit), yarn (base 1.5e5,
                       factor 4, original context 512, beta 32 / 1, not truncated), untied, 300
                       tokens

Files of a fixture: config.json and model.safetensors (as `save_pretrained` writes them), and
  reference.json         prompt ids, the logit positions, the greedy continuation, versions;
                         for tiny-gemma2 and after also `features_move_logits_by`: how far,
                         relative, the logits at the positions move with one feature turned off
                         (the fixture's `features`: the same weights, one config field changed);
                         for the MoE ones `router_margin_min`: the smallest gap between the k-th
                         and (k + 1)-th router logit over the prompt and greedy tokens
  reference.safetensors  float32 `logits` [positions, vocab] at `positions` of the prompt, and
                         `greedy_logits` [steps, vocab]: the logits each greedy token was picked
                         from (row 0 is the prompt's last position)

Seeded and deterministic (CPU, eager attention, float32 compute on the bf16 weights). A
fixture's seed is SEED + 100 * its index in FIXTURES: add new ones at the end. To regenerate
(creates the virtual environment once; torch comes from PyPI):

  python3 -m venv ~/.cache/engine/refenv
  ~/.cache/engine/refenv/bin/pip install torch 'transformers==5.*' safetensors
  ~/.cache/engine/refenv/bin/python scripts/make-references.py [--out DIR] [NAME...]

NAMEs are folder names (default: all of them); DIR defaults to tests/fixtures next to this
script's parent. The fixtures were made with transformers 5.23.0 and torch 2.15.0 (each
reference.json records its versions): write only the ones you add or change, so that the
others stay as they were.
"""

import argparse
import copy
import json
import math
import platform
import shutil
from pathlib import Path

import safetensors.torch
import torch
import transformers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

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

# Phi-3's longrope factors for its rotary dimension of 16 (partial_rotary_factor 0.5 of head_dim
# 32): 8 of each, the same shapes as SHORT and LONG.
SHORT8 = [round(1.0 + 0.05 * math.sin(i), 4) for i in range(8)]
LONG8 = ramp(1.0, 6.0, 8)

# The fields the Gemma-2, Gemma-3, Mistral and Phi-3 fixtures share.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=HEAD_DIM,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
)

# Gemma-2 and -3: 4 layers, scores scaled by query_pre_attn_scalar ** -0.5 (24, not head_dim 32),
# a 48-token window on the sliding layers, gelu (tanh) MLP, tied embeddings.
GEMMA = dict(
    COMMON,
    num_hidden_layers=4,
    query_pre_attn_scalar=24,
    sliding_window=48,
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=False,
)

GEMMA2 = dict(
    GEMMA,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=8.0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

GEMMA3_SLIDING_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
GEMMA3 = dict(
    GEMMA,
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    rope_parameters={
        "sliding_attention": GEMMA3_SLIDING_ROPE,
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
    },
)

MISTRAL = dict(
    COMMON,
    num_hidden_layers=2,
    sliding_window=48,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def phi3_rope(partial, short, long):
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": partial,
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": 512,
    }


# Phi-3: head_dim is hidden / heads (128 / 4 = 32), fused qkv_proj and gate_up_proj.
PHI3 = dict(
    {k: v for k, v in COMMON.items() if k != "head_dim"},
    hidden_size=128,
    num_hidden_layers=2,
    max_position_embeddings=2048,
    original_max_position_embeddings=512,
    sliding_window=None,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters=phi3_rope(0.5, SHORT8, LONG8),
)

# The MoE fixtures: 8 experts, 2 per token, 4 / 2 heads of 32, untied.
MOE = dict(COMMON, num_experts_per_tok=2, tie_word_embeddings=False)

# Qwen3-MoE: 3 layers, layer 1 a dense MLP (`mlp_only_layers`, intermediate 96), layers 0 and 2
# sparse (experts of 32), top-k weights renormalised, per-head q/k norms as Qwen3's.
QWEN3_MOE = dict(
    MOE,
    intermediate_size=96,
    num_hidden_layers=3,
    num_experts=8,
    moe_intermediate_size=32,
    mlp_only_layers=[1],
    decoder_sparse_step=1,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    attention_bias=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)

# Mixtral: 2 layers, experts of 48, no window.
MIXTRAL = dict(
    MOE,
    intermediate_size=48,
    num_hidden_layers=2,
    num_local_experts=8,
    sliding_window=None,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)

# gpt-oss: 4 layers (the config's default `layer_types`: sliding, full, sliding, full), a 48-token
# window, experts of 32 with biases and the clamped SwiGLU (swiglu_limit 7, alpha 1.702),
# attention biases and sinks, yarn as the config's default (beta 32 / 1, not truncated) scaled
# down to factor 4 over an original context of 512.
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 512,
}
GPT_OSS = dict(
    MOE,
    intermediate_size=32,
    num_hidden_layers=4,
    num_local_experts=8,
    sliding_window=48,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    attention_bias=True,
    swiglu_limit=7.0,
    rope_parameters=GPT_OSS_YARN,
)

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
    # The fixtures below give their config's fields (`config`) and `features`: config changes that
    # each turn one feature off, to measure how far it moves the logits; `scaling` names the one
    # whose number is also `scaling_moves_logits_by`.
    "tiny-gemma2": dict(
        arch="gemma2",
        prompt=300,
        config=GEMMA2,
        features={
            "attn_logit_softcapping": dict(attn_logit_softcapping=None),
            "final_logit_softcapping": dict(final_logit_softcapping=None),
            # None breaks HF's cache for the sliding layers: a window past every sequence instead.
            "sliding_window": dict(sliding_window=1024),
            "query_pre_attn_scalar": dict(query_pre_attn_scalar=HEAD_DIM),
        },
        scaling=None,
    ),
    "tiny-gemma3": dict(
        arch="gemma3",
        prompt=300,
        config=GEMMA3,
        features={
            "sliding_window": dict(sliding_window=1024),
            "per_layer_type_rope": dict(
                rope_parameters={"sliding_attention": GEMMA3_SLIDING_ROPE, "full_attention": GEMMA3_SLIDING_ROPE}
            ),
            "full_attention_linear_scaling": dict(
                rope_parameters={
                    "sliding_attention": GEMMA3_SLIDING_ROPE,
                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                }
            ),
        },
        scaling="full_attention_linear_scaling",
    ),
    "tiny-mistral": dict(
        arch="mistral", prompt=300, config=MISTRAL, features={"sliding_window": dict(sliding_window=None)}, scaling=None
    ),
    "tiny-phi3": dict(
        arch="phi3",
        prompt=600,
        config=PHI3,
        features={
            "partial_rotary_factor": dict(rope_parameters=phi3_rope(1.0, SHORT, LONG)),
            "longrope": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        },
        scaling="longrope",
    ),
    "tiny-qwen3-moe": dict(
        arch="qwen3_moe",
        prompt=300,
        config=QWEN3_MOE,
        features={
            "norm_topk_prob": dict(norm_topk_prob=False),
            # Layer 1 sparse too: its experts and router are new random weights.
            "mlp_only_layers": dict(mlp_only_layers=[]),
        },
        scaling=None,
    ),
    "tiny-mixtral": dict(
        arch="mixtral", prompt=300, config=MIXTRAL, features={"top_k": dict(num_experts_per_tok=1)}, scaling=None
    ),
    "tiny-gpt-oss": dict(
        arch="gpt_oss",
        prompt=300,
        config=GPT_OSS,
        features={
            "sliding_window": dict(sliding_window=1024),
            "swiglu_limit": dict(swiglu_limit=1e9),
            "yarn": dict(rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
        },
        scaling="yarn",
    ),
}

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "mixtral": (MixtralConfig, MixtralForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
}

# The Qwen3 fixture's config: BASE's sizes (head_dim 32 while hidden / heads is 16) without the
# Llama-only `mlp_bias`.
QWEN3 = {k: v for k, v in BASE.items() if k != "mlp_bias"}


def make_config(spec, change=None):
    """The fixture's config, with `change` applied: config fields for a fixture with `config`, spec
    fields (`rope_scaling`) for the others."""
    if "config" in spec:
        # A deep copy: the config classes fill in and rewrite the rope_parameters dicts they get.
        fields = copy.deepcopy({**spec["config"], **(change or {})})
        return ARCHS[spec["arch"]][0](**fields)
    spec = {**spec, **(change or {})}
    params = {"rope_type": "default", "rope_theta": spec["rope_theta"]}
    if spec["rope_scaling"]:
        params.update(spec["rope_scaling"])
    if spec.get("arch") == "qwen3":
        return Qwen3Config(**QWEN3, max_position_embeddings=spec["max_position_embeddings"], rope_parameters=params)
    return LlamaConfig(**BASE, max_position_embeddings=spec["max_position_embeddings"], rope_parameters=params)


# MoE routers (Qwen3-MoE's and Mixtral's `mlp.gate`, gpt-oss's `mlp.router` and its bias): wide
# enough that the top-k choice is clear-cut. gpt-oss's attention sinks (one logit per head) and its
# experts' gate_up_proj (wide enough that gate and up values pass swiglu_limit 7).
ROUTER = ("mlp.gate.weight", "mlp.router.weight", "mlp.router.bias")
ROUTER_STD = 0.3
SINK_MEAN = 4.0
SINK_STD = 2.0
GPT_OSS_GATE_UP_STD = 0.4


def make_model(config, seed):
    """Random weights, rounded to bf16 and held in float32. q and k are larger than the rest so
    that attention scores (and with them the rotary positions) move the logits clearly (Phi-3's
    fused qkv_proj: its q and k rows). Per-head q/k norm weights (Qwen3, Gemma-3) spread wider
    than the other norms', so that they matter. Gemma's norms multiply by (1 + weight): their
    weights are stored around 0, the others' around 1. MoE routers, gpt-oss's sinks and expert
    gate_up_proj: see ROUTER above."""
    torch.manual_seed(seed)
    cls = next(m for c, m in ARCHS.values() if type(config) is c)
    # MoE models: the experts' plain loop (the modeling file's own forward), not grouped_mm.
    moe = dict(experts_implementation="eager") if hasattr(config, "num_experts_per_tok") else {}
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32, **moe)
    model.eval()
    one = 0.0 if isinstance(config, (Gemma2Config, Gemma3TextConfig)) else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ROUTER):
                p.copy_(ROUTER_STD * torch.randn_like(p))
            elif name.endswith("self_attn.sinks"):
                p.copy_(SINK_MEAN + SINK_STD * torch.randn_like(p))
            elif isinstance(config, GptOssConfig) and name.endswith("experts.gate_up_proj"):
                p.copy_(GPT_OSS_GATE_UP_STD * torch.randn_like(p))
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(one + 0.3 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(one + 0.1 * torch.randn_like(p))
            elif "q_proj" in name or "k_proj" in name:
                p.copy_(0.15 * torch.randn_like(p))
            elif name.endswith("qkv_proj.weight"):
                # Phi-3's rows: the q heads, the k heads, the v heads (head_dim is hidden / heads).
                head_dim = config.hidden_size // config.num_attention_heads
                scale = torch.full((p.shape[0], 1), 0.08)
                scale[: (config.num_attention_heads + config.num_key_value_heads) * head_dim] = 0.15
                p.copy_(scale * torch.randn_like(p))
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


def router_margin(model, ids):
    """The smallest gap, over the tokens of `ids` and the MoE layers, between the k-th and the
    (k + 1)-th largest router logit (`None` without a router): how far the top-k choice is from a
    tie. Qwen3-MoE and Mixtral pick from the softmax of the logits, which keeps their order."""
    gaps = []

    def hook(module, inputs, output):
        top = output[0].float().topk(module.top_k + 1, dim=-1).values
        gaps.append(float((top[:, -2] - top[:, -1]).min()))

    routers = [m for n, m in model.named_modules() if n.endswith(("mlp.gate", "mlp.router"))]
    handles = [m.register_forward_hook(hook) for m in routers]
    try:
        logits_of(model, ids)
    finally:
        for h in handles:
            h.remove()
    return min(gaps) if gaps else None


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
    # Before the bf16 round trip of save_pretrained below, which also rounds the rotary tables.
    router_gap = router_margin(model, prompt + tokens[:-1])

    d = out / name
    shutil.rmtree(d, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(d)
    (d / "generation_config.json").unlink(missing_ok=True)
    model.to(torch.float32)
    safetensors.torch.save_file(
        {"logits": all_logits[positions].contiguous(), "greedy_logits": greedy_logits.contiguous()},
        d / "reference.safetensors",
    )

    def moved_by(change):
        """How far, relative, the logits at `positions` move with the config changed and the same
        weights (a change that adds weights, as Qwen3-MoE's `mlp_only_layers` does, keeps the new
        model's random ones for those)."""
        other = make_model(make_config(spec, change), seed)
        theirs = other.state_dict()
        other.load_state_dict({k: v for k, v in model.state_dict().items() if k in theirs}, strict=False)
        diff = (logits_of(other, prompt)[positions] - all_logits[positions]).abs().max()
        return float(diff / all_logits[positions].abs().max())

    # How much the scaling moves the logits: the test tolerance (1e-4 relative) is far below it.
    moved = None
    features = None
    if "features" in spec:
        features = {f: moved_by(change) for f, change in spec["features"].items()}
        moved = features[spec["scaling"]] if spec["scaling"] else None
    elif spec["rope_scaling"]:
        moved = moved_by({"rope_scaling": None})
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
    if features is not None:
        meta["features_move_logits_by"] = features
    if router_gap is not None:
        meta["router_margin_min"] = router_gap
    lines = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items()]
    (d / "reference.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")
    top2 = greedy_logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    relative = margin / greedy_logits.abs().amax(dim=-1)
    print(
        f"{name}: {n} tokens, {len(positions)} logit rows, greedy {tokens} (top-2 margin min {float(margin.min()):.4g},"
        f" relative {float(relative.min()):.4g}), scaling moves logits by {moved}"
        + (f", features {features}" if features is not None else "")
        + (f", router margin min {router_gap:.4g}" if router_gap is not None else "")
    )


def main():
    default_out = Path(__file__).resolve().parent.parent / "tests/fixtures"
    parser = argparse.ArgumentParser(description="Writes the HF reference fixtures (see the docstring).")
    parser.add_argument("--out", type=Path, default=default_out, help=f"output folder (default {default_out})")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"fixtures to write (default all): {', '.join(FIXTURES)}")
    args = parser.parse_args()
    unknown = [n for n in args.names if n not in FIXTURES]
    if unknown:
        parser.error(f"unknown fixture(s) {', '.join(unknown)}; known: {', '.join(FIXTURES)}")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    # Each fixture's seed follows from its place in FIXTURES, whichever are written.
    for i, (name, spec) in enumerate(FIXTURES.items()):
        if not args.names or name in args.names:
            write_fixture(args.out, name, spec, SEED + 100 * i)


if __name__ == "__main__":
    main()
