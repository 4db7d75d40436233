"""Throughput with and without an output format, through `engrun serve` (GPU machine; stdlib
only). Usage: format_bench.py BASE_URL N [MAX_TOKENS [CHECKS]]

Sends N concurrent /v1/completions requests of MAX_TOKENS (default 128) tokens each, three
times: unconstrained (ignore_eos), with SGLang's `regex` "[a-z]{5000}", and with SGLang's
`json_schema` of an array of at least 200 objects `{"id": 0-99, "ok": bool}` (neither ever
completes, so every answer runs to MAX_TOKENS), and prints one JSON line per run: output tokens,
seconds, tokens/s, the ratio constrained / unconstrained, and whether every constrained text is
in its format (letters only; a prefix of such an array). With CHECKS, appends one check line
(scripts/gpu/verdict.py) counting the texts out of their format.
"""
import json
import re
import sys
import threading
import time
import urllib.request

base, n = sys.argv[1], int(sys.argv[2])
max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 128
checks = sys.argv[4] if len(sys.argv) > 4 else None

# scripts/gpu/array-schema.json: an array of at least 200 {"id": 0-99, "ok": bool} (also what
# scripts/gpu-format.sh gives `engrun bench --json-schema`).
SCHEMA = json.load(open(__file__.rsplit("/", 1)[0] + "/array-schema.json"))
# Every item as the server writes JSON (", " and ": ", no other whitespace).
ITEMS = [f'{{"id": {i}, "ok": {b}}}' for i in range(100) for b in ("true", "false")]
ITEM_RX = re.compile(r'\{"id": (0|[1-9][0-9]?), "ok": (true|false)\}')


def array_prefix(text):
    """Whether `text` is a prefix of a JSON array of ITEM objects in the server's layout."""
    if not text.startswith("["):
        return text == ""
    rest = text[1:]
    while True:
        m = ITEM_RX.match(rest)
        if not m or not rest[m.end():].startswith(", "):
            break
        rest = rest[m.end() + 2:]
    return any((item + ", ").startswith(rest) for item in ITEMS)


def one(extra, out, i):
    body = {"prompt": f"Request {i}: write letters.", "max_tokens": max_tokens, "temperature": 1.0, "seed": i, **extra}
    req = urllib.request.Request(base + "/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out[i] = json.load(urllib.request.urlopen(req, timeout=600))


def run(name, extra):
    out = [None] * n
    threads = [threading.Thread(target=one, args=(extra, out, i)) for i in range(n)]
    t = time.time()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dt = time.time() - t
    tokens = sum(r["usage"]["completion_tokens"] for r in out)
    texts = [r["choices"][0]["text"] for r in out]
    return {"run": name, "requests": n, "output_tokens": tokens, "seconds": round(dt, 3),
            "tok_s": round(tokens / dt, 1)}, texts


run("warmup", {"ignore_eos": True})
free, _ = run("unconstrained", {"ignore_eos": True})
print(json.dumps(free))
bad = 0
for name, extra, ok in [("regex", {"regex": "[a-z]{5000}"}, lambda t: t.isascii() and t.isalpha() and t.islower()),
                        ("json_schema", {"json_schema": json.dumps(SCHEMA)}, array_prefix)]:
    r, texts = run(name, extra)
    wrong = [t for t in texts if not ok(t)]
    bad += len(wrong)
    r["all_match"] = not wrong
    r["ratio"] = round(r["tok_s"] / free["tok_s"], 3)
    r["example"] = texts[0][:80]
    print(json.dumps(r))
    for t in wrong[:3]:
        print(f"  out of format: {t!r}", file=sys.stderr)
if checks:
    with open(checks, "a") as f:
        f.write(json.dumps({"check": f"formats_n{n}", "value": bad, "limit": 0, "pass": bad == 0,
                            "note": "texts out of their format"}) + "\n")
