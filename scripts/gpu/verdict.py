"""The GPU check's verdict: reads the checks file that scripts/gpu/compare.py appended to, prints
one line per check and a summary, writes verdict.json beside it, and exits 1 when any check
failed or none ran.

Usage: verdict.py CHECKS_JSONL [EXPECTED_MIN_CHECKS]
"""
import json
import os
import sys

path = sys.argv[1]
expected = int(sys.argv[2]) if len(sys.argv) > 2 else 1
lines = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
failed = [c for c in lines if not c["pass"]]
for c in lines:
    where = " ".join(str(c[k]) for k in ("shape", "run", "spec", "vs") if k in c)
    print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['check']:<14} {where:<48} {c['value']:.3g} <= {c['limit']:.3g}")
ok = bool(lines) and not failed and len(lines) >= expected
verdict = {"pass": ok, "checks": len(lines), "failed": len(failed), "expected_at_least": expected,
           "failures": failed}
json.dump(verdict, open(os.path.join(os.path.dirname(path), "verdict.json"), "w"), indent=1)
print(f"VERDICT: {'PASS' if ok else 'FAIL'} ({len(lines)} checks, {len(failed)} failed"
      + (f", fewer than the {expected} expected" if len(lines) < expected else "") + ")")
sys.exit(0 if ok else 1)
