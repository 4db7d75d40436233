import numpy as np, random
def bisect(bits, w, floor, need):
    lo, hi = floor, 0x3f800000
    while lo < hi:
        span = hi - lo
        t = [lo + (span * (j + 1) + 3) // 4 for j in range(3)]
        W = [int(w[bits >= tj].sum()) for tj in t]
        if W[2] >= need: lo = t[2]
        elif W[1] >= need: lo, hi = t[1], t[2] - 1
        elif W[0] >= need: lo, hi = t[0], t[1] - 1
        else: hi = t[0] - 1
    return lo
def radix(bits, w, floor, need):
    prefix, above = 0, 0
    for shift in (24, 16, 8, 0):
        high = prefix >> (shift + 8)
        inr = (bits.astype(np.uint64) >> np.uint64(shift + 8)) == high
        digit = (bits >> shift) & 255
        hist = np.zeros(256, dtype=object)
        for d, x in zip(digit[inr], w[inr]): hist[d] += int(x)
        sbyte, sabove = 0, above
        found = 0
        for lane in range(32):
            mine = sum(hist[8*lane:8*lane+8])
            incl = sum(hist[8*lane:256])
            if above + incl >= need and above + incl - mine < need:
                found += 1
                acc = above + incl - mine
                for e in range(7, -1, -1):
                    h = hist[8*lane+e]
                    if acc + h >= need:
                        sbyte, sabove = 8*lane+e, acc; break
                    acc += h
        assert found == 1, found
        prefix |= sbyte << shift
        above = sabove
    return max(prefix, floor)
rng = np.random.default_rng(1)
res=set()
for trial in range(300):
    n = int(rng.integers(1, 3000))
    kind = trial % 3
    if kind == 0: l = rng.normal(0, 0.05, n)      # flat
    elif kind == 1: l = rng.normal(0, 3, n)       # peaked
    else: l = np.round(rng.normal(0, 1, n), 1)    # ties
    T = float(rng.uniform(0.3, 1.5))
    m = l.max()
    p = np.exp((l - m) / T).astype(np.float32); p[l == m] = 1.0
    bits = p.view(np.uint32)
    mass = (p.astype(np.float64) * 2.0**40).astype(np.uint64)   # approx of the device's mass
    by_mass = trial % 2 == 0
    w = mass if by_mass else np.ones(n, dtype=np.uint64)
    total = int(w.sum())
    floor = 0
    if rng.random() < 0.3:
        k = int(rng.integers(1, n + 1)); floor = radix(bits, np.ones(n, dtype=np.uint64), 0, k)
        total = int(w[bits >= floor].sum())
    need = max(1, int(rng.uniform(0, 1) * total))
    a, b = bisect(bits, w, floor, need), radix(bits, w, floor, need)
    assert a == b, (trial, a, b); res.add(a)
print("ok", trial, n, a, need, total)
print(len(res), "distinct thresholds")
