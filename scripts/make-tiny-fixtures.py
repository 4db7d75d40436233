#!/usr/bin/env python3
"""Writes tests/fixtures/tiny-qwen2/ and tests/fixtures/tiny-llama/: tiny random-weight checkpoints
with a reduced vocabulary (1024), each with a tokenizer cut from a real one, and Hugging Face
transformers' float32 outputs on them.

  tiny-qwen2/  Qwen2ForCausalLM: hidden 64, 2 layers, 2 query / 1 KV head of 32, intermediate
               192, q/k/v biases, tied embeddings, RoPE base 1e6, vocabulary 1024. Tokenizer:
               Qwen's (scripts/fetch-qwen-tokenizer.sh) cut to its first 974 BPE tokens (and the
               merges that make them), then its 26 added tokens renumbered 974..999 (so
               <|endoftext|> 974, <|im_start|> 975, <|im_end|> 976, <|fim_prefix|> 990,
               <|fim_middle|> 991, <|fim_suffix|> 992); the model's vocabulary (1024) is larger
               than the tokenizer's (1000), as Qwen's is (151936 > 151669). tokenizer_config.json
               is Qwen's (chat template, special tokens) with the added ids renumbered.
  tiny-llama/  LlamaForCausalLM: hidden 64, 3 layers, 4 query / 2 KV heads of 16, intermediate
               160, no biases, untied lm_head, RoPE base 1e5, vocabulary 1024. No tokenizer in the
               checkpoint folder (tests pass --tokenizer): tiny-llama/tokenizer/ is SmolLM2's
               (tests/fixtures/smollm2-135m) cut to its first 1024 tokens (its 17 added tokens
               keep their ids 0..16), with SmolLM2's chat template.

A cut tokenizer is the real one at an earlier point of its BPE training: the vocabulary's first
N ids and the merges whose result is among them (merge results follow merge order in both). HF's
`tokenizers` loads each one and the script checks that some texts encode without unknown ids.
`config.json` uses the transformers 4.x keys (`rope_theta` at the top level), as
tests/fixtures/smollm2-135m/config.json uses the 5.x ones: the loader must accept both.

Weights: the embedding N(0, 0.05), norms 1 + N(0, 0.05), the other weights and biases N(0, 0.1)
(tiny-qwen2) or N(0, 0.05) (tiny-llama), rounded to bf16 (stored as bf16). References (float32
compute, eager attention, CPU), in reference/:
  goldens.json        prompts[i].ids (random ids of the tokenizer's BPE range, lengths 1, 5, 17,
                      64), argmax_each_position, greedy_16 (16 greedy tokens, each from a full
                      forward of the sequence so far, eos masked as min_new_tokens does), source
  logits.safetensors  last_logits.{i} [vocab] (last position of prompt i), all_logits.5 [5, vocab]

Seeded and deterministic. Run in the reference environment (see make-references.py):

  ~/.cache/engine/refenv/bin/python scripts/make-tiny-fixtures.py [--out DIR]
"""

import argparse
import json
import platform
import shutil
import subprocess
from pathlib import Path

import safetensors.torch
import tokenizers
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

REPO = Path(__file__).resolve().parent.parent
VOCAB = 1024
QWEN_BPE = 974  # BPE tokens kept; the 26 added tokens follow
LENGTHS = [1, 5, 17, 64]
GREEDY = 16
TEXTS = ["hi", "Hello", "go on", "client 7 says", "The quick brown fox", "What is the capital of France?"]


def cut_tokenizer(src, keep, renumber_added):
    """The tokenizer.json `src` with ids < keep and the merges that make them; added tokens at
    or above `keep` are renumbered from `keep` on when `renumber_added`. Returns (json, id map
    of the added tokens)."""
    t = json.loads(Path(src).read_text())
    vocab = {s: i for s, i in t["model"]["vocab"].items() if i < keep}
    merges = []
    for m in t["model"]["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a + b in vocab:
            assert vocab[a] < vocab[a + b] and vocab[b] < vocab[a + b], m
            merges.append(m)
    t["model"]["vocab"] = vocab
    t["model"]["merges"] = merges
    remap = {}
    added = []
    for a in t["added_tokens"]:
        if a["id"] >= keep:
            assert renumber_added, a
            remap[a["id"]] = keep + len(remap)
            a = dict(a, id=remap[a["id"]])
        added.append(a)
    t["added_tokens"] = added
    return t, remap


def write_tokenizer(out, t, config, check_texts):
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(t, ensure_ascii=False, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in check_texts:
        enc = tok.encode(text, add_special_tokens=False)
        assert tok.decode(enc.ids, skip_special_tokens=False) == text, text
    return tok


def qwen_tokenizer(out):
    src = subprocess.run(
        ["bash", str(REPO / "scripts/fetch-qwen-tokenizer.sh")], check=True, capture_output=True, text=True
    ).stdout.strip()
    t, remap = cut_tokenizer(Path(src) / "tokenizer.json", QWEN_BPE, True)
    config = json.loads((Path(src) / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(remap[int(k)]): v for k, v in config["added_tokens_decoder"].items()}
    tok = write_tokenizer(out, t, config, TEXTS + ["数学很有趣 🤖🚀 é à ü"])
    assert tok.get_vocab_size() == QWEN_BPE + 26
    return remap


def llama_tokenizer(out):
    src = REPO / "tests/fixtures/smollm2-135m"
    t, _ = cut_tokenizer(src / "tokenizer.json", VOCAB, False)
    config = json.loads((src / "tokenizer_config.json").read_text())
    write_tokenizer(out, t, config, TEXTS)
    shutil.copy(src / "chat_template.jinja", out / "chat_template.jinja")


def random_model(cls, config, seed, scale):
    """Norms 1 + N(0, 0.05), the embedding N(0, 0.05), the other weights and biases N(0, scale),
    rounded to bf16 and held in float32."""
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                v = 1.0 + 0.05 * torch.randn_like(p)
            elif "embed_tokens" in name:
                v = 0.05 * torch.randn_like(p)
            else:
                v = scale * torch.randn_like(p)
            p.copy_(v.to(torch.bfloat16).to(torch.float32))
    return model


def references(model, out, eos, low, high, seed):
    gen = torch.Generator().manual_seed(seed)
    prompts, logits = [], {}
    with torch.no_grad():
        for i, n in enumerate(LENGTHS):
            ids = torch.randint(low, high, (n,), generator=gen).tolist()
            all_logits = model(torch.tensor([ids])).logits[0].float()
            seq, greedy = list(ids), []
            row = all_logits[-1]
            for _ in range(GREEDY):
                masked = row.clone()
                masked[eos] = float("-inf")
                t = int(torch.argmax(masked))
                greedy.append(t)
                seq.append(t)
                row = model(torch.tensor([seq])).logits[0, -1].float()
            prompts.append(
                {"ids": ids, "argmax_each_position": all_logits.argmax(-1).tolist(), "greedy_16": greedy}
            )
            logits[f"last_logits.{i}"] = all_logits[-1].clone()
            if n == 5:
                logits["all_logits.5"] = all_logits.clone()
    (out / "reference").mkdir(parents=True, exist_ok=True)
    source = (
        f"scripts/make-tiny-fixtures.py: transformers {transformers.__version__}, torch {torch.__version__},"
        f" python {platform.python_version()}, float32"
    )
    lines = [json.dumps(p) for p in prompts]
    (out / "reference/goldens.json").write_text(
        '{"prompts": [\n' + ",\n".join(lines) + "\n],\n" + f'"source": {json.dumps(source)}' + "}\n"
    )
    safetensors.torch.save_file(logits, out / "reference/logits.safetensors")
    print(f"{out.name}: {[len(p['ids']) for p in prompts]}-token prompts, greedy {[p['greedy_16'][:4] for p in prompts]}")


def write_checkpoint(out, cls, hf_fields, file_config, seed, scale):
    config = cls.config_class(**hf_fields)
    model = random_model(cls, config, seed, scale)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    safetensors.torch.save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(file_config, indent=2) + "\n")
    # What the file says is what HF ran.
    again = cls.config_class(**{k: v for k, v in file_config.items() if k not in ("architectures", "torch_dtype")})
    for k in ("vocab_size", "hidden_size", "num_key_value_heads", "tie_word_embeddings", "rms_norm_eps"):
        assert getattr(again, k) == getattr(config, k), k
    assert again.rope_parameters["rope_theta"] == config.rope_parameters["rope_theta"]
    return model


def main():
    parser = argparse.ArgumentParser(description="Writes tiny-qwen2 and tiny-llama (see the docstring).")
    parser.add_argument("--out", type=Path, default=REPO / "tests/fixtures")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    out = args.out / "tiny-qwen2"
    shutil.rmtree(out, ignore_errors=True)
    remap = qwen_tokenizer(out)
    bos, eos = remap[151643], remap[151645]
    qwen = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
    }
    fields = {k: v for k, v in qwen.items() if k not in ("architectures", "torch_dtype", "rope_theta")}
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": qwen["rope_theta"]}
    # With tied embeddings and layers as small as the embedding, the residual stream keeps each
    # token's own embedding on top: greedy text repeats one token and a repetition penalty of
    # 1.3 does not change it (the server tests need settings that give different texts).
    model = write_checkpoint(out, Qwen2ForCausalLM, fields, qwen, 2024, 0.1)
    references(model, out, [eos], 0, QWEN_BPE, 2025)

    out = args.out / "tiny-llama"
    shutil.rmtree(out, ignore_errors=True)
    llama_tokenizer(out / "tokenizer")
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-05,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
    }
    fields = {k: v for k, v in llama.items() if k not in ("architectures", "torch_dtype", "rope_theta")}
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": llama["rope_theta"]}
    model = write_checkpoint(out, LlamaForCausalLM, fields, llama, 3024, 0.05)
    references(model, out, [2], 17, VOCAB, 3025)


if __name__ == "__main__":
    main()
