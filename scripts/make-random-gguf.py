#!/usr/bin/env python3
"""Writes a random-weight Qwen2 GGUF of a config's shape (tests/configs/*.json), F16, with
llama.cpp's own Python package (gguf-py's `GGUFWriter`), for side-by-side runs with llama.cpp
where no torch is installed (scripts/compare-llamacpp-cpu.sh takes the file, or the one
llama.cpp's quantizer makes of it: scripts/gpu/llama_quantize.c).

The weights are N(0, 0.02) (biases N(0, 0.02), norms 1), numpy seed 0; the file has no vocabulary
(`tokenizer.ggml.model` = `no_vocab` and the vocabulary size: llama.cpp adds dummy tokens, the
engine compiles it without a tokenizer), so the runs feed token ids. The tensor names and keys
are those llama.cpp's converter writes for Qwen2ForCausalLM (tied embedding: no output.weight).

  PYTHONPATH=/path/to/llama.cpp/gguf-py python3 scripts/make-random-gguf.py tests/configs/qwen2.5-0.5b.json OUT.gguf
"""

import json
import sys

import numpy as np

import gguf


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: make-random-gguf.py CONFIG.json OUT.gguf")
    cfg = json.load(open(sys.argv[1]))
    if cfg.get("model_type") != "qwen2" or not cfg.get("tie_word_embeddings", False):
        sys.exit(f"{sys.argv[1]}: only tied-embedding qwen2 configs are written")
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    d = h // heads
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16)

    w = gguf.GGUFWriter(sys.argv[2], "qwen2")
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(v)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("no_vocab")
    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", normal(v, h))
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones(h))
        for name, rows in (("attn_q", heads * d), ("attn_k", kv * d), ("attn_v", kv * d)):
            w.add_tensor(b + name + ".weight", normal(rows, h))
            w.add_tensor(b + name + ".bias", normal(rows).astype(np.float32))
        w.add_tensor(b + "attn_output.weight", normal(h, heads * d))
        w.add_tensor(b + "ffn_norm.weight", ones(h))
        w.add_tensor(b + "ffn_gate.weight", normal(f, h))
        w.add_tensor(b + "ffn_up.weight", normal(f, h))
        w.add_tensor(b + "ffn_down.weight", normal(h, f))
    w.add_tensor("output_norm.weight", ones(h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
