#!/usr/bin/env python3
"""Where a decode graph's step goes, kernel by kernel, from scripts/gpu/timeline.c's records.

Usage: timeline.py TIMELINE.txt [NODES]

Takes the CUDA graph replayed most often (a benchmark's decode graph of its batch size), lines
up its launches (the i-th record of each graph node belongs to launch i), and prints, with the
median over launches (the first fifth left out as warm-up):
  - the step's span (first kernel start to last kernel end) against the sum of its kernels'
    own times: what the kernels run back to back, and what is gaps between them;
  - per kernel name: launches a step, time a step, and the gaps before them (start minus the
    previous node's end in step order; negative where a kernel starts before the previous one
    ends, as programmatic dependent launches allow);
  - the first NODES nodes (default 40) in step order, each with its start offset, time and gap.
"""
import collections
import statistics
import sys


def read(path):
    recs = collections.defaultdict(list)
    with open(path) as f:
        for line in f:
            p = line.split(maxsplit=7)
            if len(p) < 8:
                continue
            start, end, graph, node = int(p[0]), int(p[1]), int(p[2]), int(p[3])
            recs[graph].append((start, end, node, p[7].strip()))
    return recs


def launches(recs):
    """The graph's launches, each {node: (start, end, name)}: the i-th record of each node
    belongs to launch i."""
    by_node = collections.defaultdict(list)
    for r in sorted(recs):
        by_node[r[2]].append(r)
    n = min(len(v) for v in by_node.values())
    return [{node: (v[i][0], v[i][1], v[i][3]) for node, v in by_node.items()} for i in range(n)]


def short(name):
    return name if len(name) <= 60 else name[:57] + "..."


def main():
    path = sys.argv[1]
    show = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    recs = read(path)
    if not recs:
        sys.exit(f"{path}: no kernel records of a CUDA graph")
    graph = max(recs, key=lambda g: len(recs[g]))
    steps = launches(recs[graph])
    steps = steps[len(steps) // 5 :] or steps
    med = statistics.median
    first = [min(b for b, _, _ in s.values()) for s in steps]
    # Step order: the nodes by their median start offset.
    order = sorted(steps[0], key=lambda node: med([s[node][0] - f for s, f in zip(steps, first)]))
    nodes = len(order)
    span = med([max(e for _, e, _ in s.values()) - f for s, f in zip(steps, first)]) / 1e3
    busy = med([sum(e - b for b, e, _ in s.values()) for s in steps]) / 1e3
    print(f"graph {graph}: {len(steps)} launches used, {nodes} kernels a step")
    print(f"step span {span:.1f} us; kernels' own time {busy:.1f} us (summed; overlapping kernels count twice)")
    rows = []
    for i, node in enumerate(order):
        t = [s[node][1] - s[node][0] for s in steps]
        off = [s[node][0] - f for s, f in zip(steps, first)]
        gap = [s[node][0] - s[order[i - 1]][1] for s in steps] if i else [0]
        rows.append((steps[0][node][2], med(off) / 1e3, med(t) / 1e3, med(gap) / 1e3))
    per = collections.OrderedDict()
    for name, _, t, gap in rows:
        c = per.setdefault(name, [0, 0.0, 0.0])
        c[0] += 1
        c[1] += t
        c[2] += gap
    print(f"\n{'kernel':60} {'calls':>5} {'us':>9} {'gaps us':>9}")
    for name, (n, t, gap) in sorted(per.items(), key=lambda kv: -kv[1][1] - kv[1][2]):
        print(f"{short(name):60} {n:5d} {t:9.1f} {gap:9.1f}")
    gaps = sum(r[3] for r in rows)
    print(f"{'all':60} {nodes:5d} {sum(r[2] for r in rows):9.1f} {gaps:9.1f}")
    print(f"\nthe first {min(show, nodes)} kernels of a step: start offset, time, gap before (us)")
    for name, off, t, gap in rows[:show]:
        print(f"{off:9.1f} {t:8.1f} {gap:7.1f}  {short(name)}")


if __name__ == "__main__":
    main()
