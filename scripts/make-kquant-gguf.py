#!/usr/bin/env python3
"""Writes tests/fixtures/tiny-kquant/: a tiny 1-layer llama GGUF whose weights are GGUF k-quants,
its dequantized twin, and llama.cpp's dequantization of sample super-blocks, all made with
llama.cpp's own Python package (gguf-py: `gguf.GGUFWriter`, `gguf.quants.dequantize`).

  kquant.gguf   architecture "llama": hidden 256, 1 layer, 4 query / 2 KV heads of 64,
                intermediate 512, vocabulary 320, RoPE base 10000, rms eps 1e-5, context 2048;
                no tokenizer metadata (the tests feed token ids). Weights as a Q4_K_M file
                stores them: q/k/v/o, gate, up in Q4_K, down in Q6_K; the embedding
                (token_embd, tied to the lm_head: no output.weight) in Q5_K; the three norms
                F32 (1 + 0.1 N(0, 1)). A quantized tensor's bytes are random (numpy seed 0)
                except its f16 super-block scales, set to normal values that keep activations
                finite: Q4_K / Q5_K `d` and `dmin` log-uniform in [1e-3, 1e-2], Q6_K `d` in
                [1e-4, 1e-3] (its i8 sub-block scales reach 127 where the others' reach 63).
  dequant.gguf  the same model, every tensor F32: gguf-py's `gguf.quants.dequantize` of the same
                bytes (the norms as they are).
  reference/dequant_samples.json
                per type (`q4_k`, `q5_k`, `q6_k`): `hex`, the raw bytes of two super-blocks (the
                first of the fixture's tensor of that type, then one whose every byte is random,
                f16 scales included, drawn until they are finite: negative, subnormal or large
                scales), and gguf-py's 512 dequantized values, as `values` (floats) and `bits`
                (the float32 bit patterns, 8 hex digits each, the exact values), plus `source`;
                `q5_0` and `q5_1` the same of eight random blocks (256 values).

Seeded and deterministic. Run with llama.cpp's gguf-py on the path (numpy is in the reference
environment of make-references.py):

  PYTHONPATH=/path/to/llama.cpp/gguf-py ~/.cache/engine/refenv/bin/python scripts/make-kquant-gguf.py [--out DIR]
"""

import argparse
import json
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as Q

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 256, 4, 2, 64, 512, 320

# The f16 scales of each type: (byte offset, low, high) of every scale to set.
SCALES = {
    Q.Q4_K: [(0, 1e-3, 1e-2), (2, 1e-3, 1e-2)],
    Q.Q5_K: [(0, 1e-3, 1e-2), (2, 1e-3, 1e-2)],
    Q.Q6_K: [(208, 1e-4, 1e-3)],
    Q.Q8_0: [(0, 1e-4, 1e-3)],
    Q.Q4_0: [(0, 1e-3, 1e-2)],
    Q.Q4_1: [(0, 1e-3, 1e-2), (2, 1e-3, 1e-2)],
    Q.Q5_0: [(0, 1e-3, 1e-2)],
    Q.Q5_1: [(0, 1e-3, 1e-2), (2, 1e-3, 1e-2)],
}


def blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random super-blocks of `qtype` for a [rows, cols] tensor, as [rows, row bytes] uint8."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at, lo, hi in SCALES[qtype]:
        s = np.exp(rng.uniform(np.log(lo), np.log(hi), size=n)).astype(np.float16)
        b[:, at:at + 2] = s.view(np.uint8).reshape(n, 2)
    return b.reshape(rows, cols // block * size)


def random_block(rng: np.random.Generator, qtype: Q) -> np.ndarray:
    """One super-block of random bytes whose dequantized values are all finite."""
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    while True:
        b = rng.integers(0, 256, size=(1, size), dtype=np.uint8)
        if np.isfinite(gguf.quants.dequantize(b, qtype)).all():
            return b


def gguf_version() -> str:
    """gguf-py's version, from the pyproject.toml beside the package (it is used from a checkout)."""
    toml = Path(gguf.__file__).resolve().parent.parent / "pyproject.toml"
    lines = toml.read_text().splitlines() if toml.is_file() else []
    return next((l.split('"')[1] for l in lines if l.startswith("version")), "(unknown version)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests/fixtures/tiny-kquant"))
    out = Path(ap.parse_args().out)
    (out / "reference").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)

    # (GGUF name, HF-order shape [rows, cols], type); GGUF stores rows of `cols`.
    spec = [
        ("token_embd.weight", (VOCAB, HIDDEN), Q.Q5_K),
        ("blk.0.attn_norm.weight", (HIDDEN,), Q.F32),
        ("blk.0.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), Q.Q4_K),
        ("blk.0.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_K),
        ("blk.0.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_K),
        ("blk.0.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), Q.Q4_K),
        ("blk.0.ffn_norm.weight", (HIDDEN,), Q.F32),
        ("blk.0.ffn_gate.weight", (FFN, HIDDEN), Q.Q4_K),
        ("blk.0.ffn_up.weight", (FFN, HIDDEN), Q.Q4_K),
        ("blk.0.ffn_down.weight", (HIDDEN, FFN), Q.Q6_K),
        ("output_norm.weight", (HIDDEN,), Q.F32),
    ]
    tensors = random_tensors(rng, spec)

    write_pair(out, "llama", tensors, ("kquant.gguf", "dequant.gguf"))
    write_samples(out, rng, tensors)
    # The Qwen2 twin (its own generator, so the files above stay as they were): hidden 320, rows
    # that are not whole super-blocks of 256, in the types llama.cpp's k-quant mixes fall back to
    # there (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1; Q5_K where the rows are 512), and f32 q/k/v biases as
    # GGUF files store them.
    rng = np.random.default_rng(1)
    h2, d2 = 320, 80
    qwen2 = [
        ("token_embd.weight", (VOCAB, h2), Q.Q4_0),
        ("blk.0.attn_norm.weight", (h2,), Q.F32),
        ("blk.0.attn_q.weight", (HEADS * d2, h2), Q.Q8_0),
        ("blk.0.attn_q.bias", (HEADS * d2,), Q.F32),
        ("blk.0.attn_k.weight", (KV_HEADS * d2, h2), Q.Q8_0),
        ("blk.0.attn_k.bias", (KV_HEADS * d2,), Q.F32),
        ("blk.0.attn_v.weight", (KV_HEADS * d2, h2), Q.Q8_0),
        ("blk.0.attn_v.bias", (KV_HEADS * d2,), Q.F32),
        ("blk.0.attn_output.weight", (h2, HEADS * d2), Q.Q5_1),
        ("blk.0.ffn_norm.weight", (h2,), Q.F32),
        ("blk.0.ffn_gate.weight", (FFN, h2), Q.Q5_0),
        ("blk.0.ffn_up.weight", (FFN, h2), Q.Q5_0),
        ("blk.0.ffn_down.weight", (h2, FFN), Q.Q5_K),
        ("output_norm.weight", (h2,), Q.F32),
        ("output.weight", (VOCAB, h2), Q.Q4_1),
    ]
    write_pair(out, "qwen2", random_tensors(rng, qwen2), ("qwen2.gguf", "qwen2-dequant.gguf"), head_dim=d2, hidden=h2)
    # The Qwen3 twin: heads of 128 (not hidden / heads: the key length says so), per-head q/k
    # norms, a Q8_0 table tied to the lm_head.
    rng = np.random.default_rng(2)
    d3 = 128
    qwen3 = [
        ("token_embd.weight", (VOCAB, HIDDEN), Q.Q8_0),
        ("blk.0.attn_norm.weight", (HIDDEN,), Q.F32),
        ("blk.0.attn_q.weight", (HEADS * d3, HIDDEN), Q.Q4_K),
        ("blk.0.attn_k.weight", (KV_HEADS * d3, HIDDEN), Q.Q4_K),
        ("blk.0.attn_v.weight", (KV_HEADS * d3, HIDDEN), Q.Q4_K),
        ("blk.0.attn_q_norm.weight", (d3,), Q.F32),
        ("blk.0.attn_k_norm.weight", (d3,), Q.F32),
        ("blk.0.attn_output.weight", (HIDDEN, HEADS * d3), Q.Q5_K),
        ("blk.0.ffn_norm.weight", (HIDDEN,), Q.F32),
        ("blk.0.ffn_gate.weight", (FFN, HIDDEN), Q.Q6_K),
        ("blk.0.ffn_up.weight", (FFN, HIDDEN), Q.Q6_K),
        ("blk.0.ffn_down.weight", (HIDDEN, FFN), Q.Q4_0),
        ("output_norm.weight", (HIDDEN,), Q.F32),
    ]
    write_pair(out, "qwen3", random_tensors(rng, qwen3), ("qwen3.gguf", "qwen3-dequant.gguf"), head_dim=d3)
    for p in sorted(out.rglob("*")):
        if p.is_file():
            print(f"{p.relative_to(out)}: {p.stat().st_size} bytes")


def random_tensors(rng: np.random.Generator, spec: list) -> list:
    """(name, type, data) of each (GGUF name, HF-order shape, type): norms near 1, biases near 0,
    random blocks with sane scales."""
    tensors = []
    for name, shape, qtype in spec:
        if name.endswith(".bias"):
            tensors.append((name, qtype, (0.1 * rng.standard_normal(shape)).astype(np.float32)))
        elif qtype == Q.F32:
            tensors.append((name, qtype, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)))
        else:
            tensors.append((name, qtype, blocks(rng, qtype, *shape)))
    return tensors


def write_pair(out: Path, arch: str, tensors: list, names: tuple, head_dim: int = HEAD_DIM, hidden: int = HIDDEN) -> None:
    """The model of `arch` kept in its blocks (names[0]) and dequantized by gguf-py (names[1])."""

    def write(path: Path, dequantized: bool) -> None:
        w = gguf.GGUFWriter(str(path), arch)
        w.add_block_count(1)
        w.add_context_length(2048)
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(FFN)
        w.add_head_count(HEADS)
        w.add_head_count_kv(KV_HEADS)
        w.add_rope_dimension_count(head_dim)
        if head_dim != hidden // HEADS:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(VOCAB)
        for name, qtype, data in tensors:
            if qtype == Q.F32:
                w.add_tensor(name, data)
            elif dequantized:
                w.add_tensor(name, gguf.quants.dequantize(data, qtype).astype(np.float32))
            else:
                w.add_tensor(name, data, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write(out / names[0], dequantized=False)
    write(out / names[1], dequantized=True)


def write_samples(out: Path, rng: np.random.Generator, tensors: list) -> None:
    """gguf-py's dequantization of two super-blocks of each k-quant (one of `tensors`'), and of
    eight random blocks of Q5_0 and of Q5_1."""
    samples = {"source": f"gguf-py {gguf_version()} gguf.quants.dequantize (numpy {np.__version__}), "
                         "scripts/make-kquant-gguf.py"}
    for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        _, size = gguf.GGML_QUANT_SIZES[qtype]
        first = next(d for _, t, d in tensors if t == qtype).reshape(-1, size)[:1]
        raw = np.concatenate([first, random_block(rng, qtype)])
        values = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(-1)
        samples[qtype.name.lower()] = {
            "hex": raw.tobytes().hex(),
            "values": [float(v) for v in values],
            "bits": "".join(f"{b:08x}" for b in values.view(np.uint32)),
        }
    for qtype in (Q.Q5_0, Q.Q5_1):
        raw = np.concatenate([random_block(rng, qtype) for _ in range(8)])
        values = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(-1)
        samples[qtype.name.lower()] = {
            "hex": raw.tobytes().hex(),
            "values": [float(v) for v in values],
            "bits": "".join(f"{b:08x}" for b in values.view(np.uint32)),
        }
    (out / "reference/dequant_samples.json").write_text(json.dumps(samples, indent=1) + "\n")


if __name__ == "__main__":
    main()
