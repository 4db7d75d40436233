#!/usr/bin/env python3
"""Which FP8 scale layouts cuBLASLt takes on this GPU, and how fast, through torch._scaled_mm
(which calls cublasLtMatmul): per-tensor, row-wise (per token x per channel: outer-vector
scales) and 1 x 128 blocks on both operands (VEC128_32F x VEC128_32F, the layout of our E4M3
weights on the device: one f32 scale per row and 128 columns). For each, the error against the
f32 product of the dequantized operands and the time against a bf16 matmul of the same shape.
Usage: python3 scripts/gpu/scaled_mm_probe.py [M ...] (default 64 4096), shapes (k, n) of the
Qwen2.5-7B linears."""
import sys

import torch

E4M3 = torch.float8_e4m3fn


def quant_groups(x, group):
    """Codes and scales of x [r, k] with one scale per row and `group` columns."""
    r, k = x.shape
    g = x.float().reshape(r, k // group, group)
    s = g.abs().amax(-1).clamp(min=1e-12) / 448.0
    q = (g / s[..., None]).to(E4M3).reshape(r, k)
    return q, s


def timed(f, reps=20):
    f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        f()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1e3


def main():
    ms = [int(a) for a in sys.argv[1:]] or [64, 4096]
    torch.manual_seed(0)
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
    for m in ms:
        for k, n in [(3584, 4608), (3584, 37888), (18944, 3584)]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
            t16 = timed(lambda: x @ w.t())
            line = f"m={m} k={k} n={n}: bf16 {t16:.1f} us"
            xq, xs = quant_groups(x, 128)
            wq, ws = quant_groups(w, 128)
            ref = (xq.float().reshape(m, k // 128, 128) * xs[..., None]).reshape(m, k) @ (
                wq.float().reshape(n, k // 128, 128) * ws[..., None]
            ).reshape(n, k).t()
            # torch wants the 1 x 128 scales of each operand outer-dim major: [rows, k/128]
            # with stride (1, rows), i.e. k/128 columns of `rows` contiguous scales.
            sa = xs.t().contiguous().t()
            sb = ws.t().contiguous().t()
            cases = {"blockwise 1x128 x 1x128": (xq, wq, sa, sb), "blockwise, scale_b [k/128, n]": (xq, wq, sa, ws.t())}
            xr, xrs = quant_groups(x, k)
            wr, wrs = quant_groups(w, k)
            cases["rowwise"] = (xr, wr, xrs, wrs.t())
            for name, (a, b, s_a, s_b) in cases.items():
                try:
                    f = lambda: torch._scaled_mm(a, b.t(), scale_a=s_a, scale_b=s_b, out_dtype=torch.bfloat16)
                    out = f().float()
                    want = ref if name.startswith("block") else (a.float() * s_a) @ (b.float() * s_b.t()).t()
                    err = ((out - want).abs().max() / want.abs().max()).item()
                    line += f" | {name} {timed(f):.1f} us rel err {err:.2e}"
                except Exception as e:  # noqa: BLE001 - report what the library refuses
                    line += f" | {name} refused: {str(e).splitlines()[0][:160]}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
