"""The side-by-side table of scripts/compare-llamacpp.sh for one shape (GPU machine).

Usage: compare_table.py SHAPE WORK_DIR

Reads WORK_DIR/SHAPE-llama-bench.txt (llama-bench -o md: pp4096 and tg128 rows),
WORK_DIR/SHAPE-llama-batched.txt (llama-batched-bench: | PP | TG | B | N_KV | T_PP s | S_PP t/s |
T_TG s | S_TG t/s | T s | S t/s |) and WORK_DIR/SHAPE-ours.jsonl (engrun bench --json lines with
a "batch" key: a batch size, or "pp4096") and prints a markdown table: per batch, output tok/s
(llama.cpp: B*128/T) and decode-only tok/s (llama.cpp: S_TG; ours: decode_tok_s) with the
ratios ours / llama.cpp; then prefill of 4096 tokens and batch-1 decode from llama-bench.
"""
import json
import re
import sys

shape, work = sys.argv[1:3]


def rows(path):
    """The numeric rows of a markdown table, as lists of cells."""
    out = []
    for line in open(path, errors="replace"):
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        out.append(cells)
    return out


batched = {}
for cells in rows(f"{work}/{shape}-llama-batched.txt"):
    if len(cells) == 10 and cells[2].isdigit():
        pp, tg, b = int(cells[0]), int(cells[1]), int(cells[2])
        batched[b] = {"out": b * tg / float(cells[8]), "s_tg": float(cells[7])}
bench = {}
for cells in rows(f"{work}/{shape}-llama-bench.txt"):
    for c in cells:
        m = re.fullmatch(r"(pp|tg)(\d+)", c)
        if m:
            bench[c] = float(cells[-1].split("±")[0])
ours = {}
for line in open(f"{work}/{shape}-ours.jsonl"):
    line = line.strip()
    if line.startswith("{"):
        j = json.loads(line)
        ours[j["batch"]] = j


def ratio(a, b):
    return f"{a / b:.2f}" if a and b else "-"


def num(x):
    return f"{x:,.0f}" if x else "-"


print(f"### {shape}\n")
print("| B | ours output tok/s | llama.cpp output tok/s | ratio | ours decode tok/s | llama.cpp S_TG | ratio |")
print("|---|---|---|---|---|---|---|")
for b in sorted(set(batched) | {k for k in ours if isinstance(k, int)}):
    o, l = ours.get(b, {}), batched.get(b, {})
    oo, lo, od, ld = o.get("output_tok_s"), l.get("out"), o.get("decode_tok_s"), l.get("s_tg")
    print(f"| {b} | {num(oo)} | {num(lo)} | {ratio(oo, lo)} | {num(od)} | {num(ld)} | {ratio(od, ld)} |")
pp = ours.get("pp4096", {}).get("prefill_tok_s")
print(f"| prefill 4096 | {num(pp)} | {num(bench.get('pp4096'))} | {ratio(pp, bench.get('pp4096'))} | | | |")
b1 = ours.get(1, {}).get("decode_tok_s")
print(f"| tg128 (batch 1) | | | | {num(b1)} | {num(bench.get('tg128'))} | {ratio(b1, bench.get('tg128'))} |")
