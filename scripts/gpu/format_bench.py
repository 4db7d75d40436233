"""Throughput with and without an output format, through `engrun serve` (GPU machine; stdlib
only). Usage: format_bench.py BASE_URL N [MAX_TOKENS]

Sends N concurrent /v1/completions requests of MAX_TOKENS (default 128) tokens each, twice:
unconstrained (ignore_eos) and with SGLang's `regex` "[a-z]{5000}" (never complete, so every
answer also runs to MAX_TOKENS), and prints one JSON line per run: output tokens, seconds,
tokens/s, the ratio constrained / unconstrained, and whether every constrained text is
letters only.
"""
import json
import sys
import threading
import time
import urllib.request

base, n = sys.argv[1], int(sys.argv[2])
max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 128


def one(extra, out, i):
    body = {"prompt": f"Request {i}: write letters.", "max_tokens": max_tokens, "temperature": 1.0, "seed": i, **extra}
    req = urllib.request.Request(base + "/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out[i] = json.load(urllib.request.urlopen(req, timeout=600))


LAST = []


def run(name, extra):
    out = [None] * n
    threads = [threading.Thread(target=one, args=(extra, out, i)) for i in range(n)]
    t = time.time()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dt = time.time() - t
    LAST[:] = out
    tokens = sum(r["usage"]["completion_tokens"] for r in out)
    return {"run": name, "requests": n, "output_tokens": tokens, "seconds": round(dt, 3), "tok_s": round(tokens / dt, 1)}


run("warmup", {"ignore_eos": True})
free = run("unconstrained", {"ignore_eos": True})
print(json.dumps(free))
rx = run("regex", {"regex": "[a-z]{5000}"})
rx["all_match"] = all(all(c.isascii() and c.islower() for c in r["choices"][0]["text"]) for r in LAST)
rx["ratio"] = round(rx["tok_s"] / free["tok_s"], 3)
print(json.dumps(rx))
