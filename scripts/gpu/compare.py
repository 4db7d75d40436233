"""Comparisons of the GPU check (scripts/gpu-check.sh), each appended to a checks file as one JSON
line with its value, its limit and `pass`; scripts/gpu/verdict.py reads them all.

  compare.py hf CHECKS CK SHAPE RUN SFX DTYPE      our logits of RUN (b1, b16, b16p8, long) vs HF's
  compare.py pair CHECKS NAME A B DTYPE CK RUN      two of our logits files of RUN
  compare.py sampling CHECKS NAME FILE             `engrun logits` sampling reports, one per line
  compare.py alone CHECKS NAME FILE                `engrun bench --verify-alone` JSON
  compare.py same_tokens CHECKS NAME A B           two `engrun bench --output-tokens` files: every
                                                   request's tokens equal
  compare.py embed CHECKS CK SHAPE SFX DTYPE URL   /v1/embeddings of b1's sequence (last-token
                                                   pooling) through the lm_head vs HF's logits
  compare.py gguf CHECKS NAME CPU CUDA TWIN LENS PRE   CUDA logits of a bundle kept in GGUF blocks
                                                   vs the CPU backend's (which reads the blocks as
                                                   ir::quant defines them), held to 1.5 x the error
                                                   of TWIN (its dequantized weights as a bf16
                                                   bundle, on CUDA) + the bf16 allowance

Errors are relative to the reference's largest magnitude, per sequence, the worst sequence
reported: `max` = max |ours - ref| / max |ref|, `rms` = rms(ours - ref) / rms(ref). Against HF's f32
forward a 16-bit bundle may be off by a fraction of what HF's own forward in that 16-bit type is
off (it rounds every activation; ours rounds only linear inputs and the KV cache): the limit is
0.8 x HF's own error + an allowance (bf16 5e-3, f16 1e-3). Two of our runs that differ only in how
kernels are launched (CUDA graphs, PDL) or which GEMM runs (cuBLASLt) may differ by the
allowance. An FP8 checkpoint's reference also holds `w8a8` (hf_fp8.py: the f32 forward with every
FP8 linear's input quantized as HF's own FP8 forward does): the engine runs W8A8 where cuBLASLt
times faster, so both limits grow by that forward's own error against f32. Greedy tokens are compared where the reference's top-2 margin exceeds twice the row's
error, at decode positions.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file

ALLOWANCE = {"bf16": 5e-3, "f16": 1e-3}
HF_OWN = {"bf16": "bf16", "f16": "f16"}
# Sequences of each run in seqs.json (first index, count) and tokens prefilled before decoding.
RUNS = {"b1": (0, 1, 40), "b16": (1, 16, 24), "b16p8": (1, 16, 8), "long": (17, 1, 512)}


def emit(checks, **line):
    line["pass"] = bool(line["value"] <= line["limit"]) if "limit" in line else bool(line["pass"])
    with open(checks, "a") as f:
        f.write(json.dumps(line) + "\n")
    print(("PASS " if line["pass"] else "FAIL ") + json.dumps(line))


def errors(ours, ref, lens, pre):
    """Worst per-sequence max and rms relative errors, and greedy agreement where clear."""
    worst_max, worst_rms, clear, same, at = 0.0, 0.0, 0, 0, 0
    for n in lens:
        o, h = ours[at:at + n], ref[at:at + n]
        at += n
        d = o - h
        worst_max = max(worst_max, (d.abs().max() / h.abs().max()).item())
        worst_rms = max(worst_rms, (d.pow(2).mean().sqrt() / h.pow(2).mean().sqrt()).item())
        err = d.abs().max(-1).values
        top = h.topk(2, -1).values
        ok = (top[:, 0] - top[:, 1]) > 2 * err
        ok[:pre] = False
        clear += ok.sum().item()
        same += (ok & (o.argmax(-1) == h.argmax(-1))).sum().item()
    return worst_max, worst_rms, clear, same


def rows(ck, run):
    seqs = json.load(open(f"{ck}/seqs.json"))
    lens = [len(s) for s in seqs]
    first, count, pre = RUNS[run]
    return sum(lens[:first]), lens[first:first + count], pre


def hf(checks, ck, shape, run, sfx, dtype):
    start, lens, pre = rows(ck, run)
    ref = load_file(f"{ck}/hf_logits.safetensors")
    ours = load_file(f"{ck}/{run}{sfx}.safetensors")["logits"]
    total = sum(lens)
    if ours.shape[0] != total:
        emit(checks, check="rows", shape=shape, run=run + sfx, value=1, limit=0, rows=ours.shape[0], want=total)
        return
    f32 = ref["f32"][start:start + total]
    own_max, own_rms, _, _ = errors(ref[HF_OWN[dtype]][start:start + total], f32, lens, pre)
    w8_max, w8_rms = w8a8_own(ref, start, total, lens, pre)
    got_max, got_rms, clear, same = errors(ours, f32, lens, pre)
    base = dict(shape=shape, run=run + sfx, vs="hf_f32", hf_own_max=own_max, hf_own_rms=own_rms, w8a8_max=w8_max)
    emit(checks, check="logits_max", value=got_max, limit=0.8 * own_max + w8_max + ALLOWANCE[dtype], **base)
    emit(checks, check="logits_rms", value=got_rms, limit=0.8 * own_rms + w8_rms + ALLOWANCE[dtype], **base)
    emit(checks, check="greedy", value=clear - same, limit=0, greedy_equal=same, greedy_clear=clear, **base)


def w8a8_own(ref, start, total, lens, pre):
    """Max and rms error against f32 of HF's W8A8 forward (emulated) of an FP8 checkpoint's run;
    0 without one."""
    if "w8a8" not in ref:
        return 0.0, 0.0
    m, r, _, _ = errors(ref["w8a8"][start:start + total], ref["f32"][start:start + total], lens, pre)
    return m, r


def pair(checks, name, a, b, dtype, ck, run):
    _, lens, _ = rows(ck, run)
    x, y = load_file(a)["logits"], load_file(b)["logits"]
    if x.shape != y.shape or x.shape[0] != sum(lens):
        emit(checks, check=name, value=1, limit=0, a=a, b=b, note=f"shapes {list(x.shape)} {list(y.shape)}")
        return
    got_max, got_rms, clear, same = errors(y, x, lens, 0)
    start = rows(ck, run)[0]
    ref = load_file(f"{ck}/hf_logits.safetensors") if os.path.exists(f"{ck}/hf_logits.safetensors") else {}
    w8_max, _ = w8a8_own(ref, start, sum(lens), lens, 0)
    emit(checks, check=name, run=run, value=got_max, limit=ALLOWANCE[dtype] + w8_max, rms=got_rms, a=os.path.basename(a),
         b=os.path.basename(b), greedy_equal=same, greedy_clear=clear)


def sampling(checks, name, path):
    for line in open(path):
        spec, _, report = line.partition(": ")
        try:
            r = json.loads(report)
        except ValueError:
            emit(checks, check=name, spec=spec, value=1, limit=0, note=f"no report: {line.strip()}")
            continue
        ok = r.get("on_device") is True and r.get("device_equal_host") == r.get("sampled_rows") and r["sampled_rows"] > 0
        emit(checks, check=name, spec=spec, value=0 if ok else 1, limit=0, **r)


def alone(checks, name, path):
    text = open(path).read().strip().splitlines()
    js = [json.loads(l) for l in text if l.startswith("{")]
    r = js[-1]["alone"] if js and js[-1].get("alone") else None
    if r is None:
        emit(checks, check=name, value=1, limit=0, note="no report: " + (text[-1] if text else "empty"))
        return
    emit(checks, check=name, value=r["clear_mismatches"], limit=0, tokens=r["tokens"], equal=r["equal"],
         near_ties=r["near_ties"], worst_margin=r["worst_margin"], tol=r["tol"], first_clear=r["first_clear"])


def same_tokens(checks, name, a, b):
    try:
        ta, tb = (json.load(open(p)) for p in (a, b))
    except (OSError, ValueError) as e:
        emit(checks, check=name, value=1, limit=0, note=f"no tokens: {e}")
        return
    if not ta or len(ta) != len(tb):
        emit(checks, check=name, value=1, limit=0, note=f"{len(ta)} and {len(tb)} requests")
        return
    differ = [i for i, (x, y) in enumerate(zip(ta, tb)) if x != y]
    first = differ[0] if differ else None
    # The first token that differs in the first request that does (or where one ends first).
    at = None
    if first is not None:
        x, y = ta[first], tb[first]
        at = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    emit(checks, check=name, value=len(differ), limit=0, requests=len(ta), tokens=sum(map(len, ta)),
         first_request=first, first_token=at)


def lm_head(ck):
    """The checkpoint's lm_head (or the embedding it is tied to), from any of its shards."""
    import glob
    from safetensors import safe_open
    for path in sorted(glob.glob(f"{ck}/*.safetensors")):
        with safe_open(path, "pt", device="cuda") as f:
            for name in ("lm_head.weight", "model.embed_tokens.weight"):
                if name in f.keys():
                    return f.get_tensor(name).float()
    raise SystemExit(f"no lm_head in {ck}")


def embed(checks, ck, shape, sfx, dtype, url):
    """The served embedding e of sequence 0 (last pooling, unit norm) satisfies W·e = logits / |h|:
    W·e, scaled by its best factor, must match HF's f32 logits at the last position as closely as
    our logits do (the same limit as the logits check, widened by HF's W8A8 error for FP8)."""
    import urllib.request
    seq = json.load(open(f"{ck}/seqs.json"))[0]
    req = urllib.request.Request(url, data=json.dumps({"input": seq}).encode(), headers={"Content-Type": "application/json"})
    try:
        e = torch.tensor(json.load(urllib.request.urlopen(req, timeout=600))["data"][0]["embedding"], device="cuda")
    except Exception as err:  # a failed request is a failed check
        emit(checks, check="embedding", shape=shape, run="b1" + sfx, value=1, limit=0, note=str(err))
        return
    ref = load_file(f"{ck}/hf_logits.safetensors")
    last = len(seq) - 1
    f32, own = ref["f32"][last].cuda(), ref[HF_OWN[dtype]][last].cuda()
    got = lm_head(ck) @ e
    got = got * (got @ f32) / (got @ got)
    rel = lambda x: ((x - f32).abs().max() / f32.abs().max()).item()
    # An FP8 checkpoint's prefill may run W8A8: its limit grows by HF's W8A8 forward's own error.
    w8 = rel(ref["w8a8"][last].cuda()) if "w8a8" in ref else 0.0
    emit(checks, check="embedding", shape=shape, run="b1" + sfx, vs="hf_f32", value=rel(got),
         limit=0.8 * rel(own) + w8 + ALLOWANCE[dtype], w8a8=w8, norm=e.norm().item(), width=e.numel())


def gguf(checks, name, cpu, cuda, twin, lens, pre):
    lens, pre = [int(n) for n in lens.split(",")], int(pre)
    ref, got, bf16 = (load_file(p)["logits"] for p in (cpu, cuda, twin))
    if not (ref.shape == got.shape == bf16.shape) or ref.shape[0] != sum(lens):
        emit(checks, check=name, value=1, limit=0, note=f"shapes {[list(t.shape) for t in (ref, got, bf16)]}")
        return
    twin_max, twin_rms, _, _ = errors(bf16, ref, lens, pre)
    got_max, got_rms, clear, same = errors(got, ref, lens, pre)
    base = dict(vs="cpu_blocks", twin_bf16_max=twin_max, twin_bf16_rms=twin_rms)
    emit(checks, check=name + "_max", value=got_max, limit=1.5 * twin_max + ALLOWANCE["bf16"], rms=got_rms, **base)
    emit(checks, check=name + "_greedy", value=clear - same, limit=0, greedy_equal=same, greedy_clear=clear, **base)


if __name__ == "__main__":
    kind, checks, *args = sys.argv[1:]
    {"hf": hf, "pair": pair, "sampling": sampling, "alone": alone, "same_tokens": same_tokens, "embed": embed,
     "gguf": gguf}[kind](checks, *args)
