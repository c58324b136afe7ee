#!/usr/bin/env python3
"""Per-step kernel breakdown from two LOOM_PROFILE_OPS_FILE tables of runs that differ only in their step count.

  op_profile.py short.tsv long.tsv STEPS_BETWEEN
  op_profile.py - run.tsv STEPS    (one run whose table covers STEPS steps: loom-train resets it after step 1)

(long - short) / STEPS_BETWEEN is one training step with the first step's warm-up (plan creation, first
allocations) and the run's start and end left out. Rows are grouped by (op, dtype); each row's time is its calls'
device-synchronized wall time, so it includes one launch per call.
"""
import csv
import sys


def load(path):
    rows = {}
    with open(path) as f:
        for r in csv.DictReader(f, delimiter="\t"):
            op = r["op"] + (" " + r["detail"] if r.get("detail") else "")
            rows[(op, r["device"], r["dtype"])] = (int(r["calls"]), float(r["total_ms"]))
    return rows


short, long_, steps = ({} if sys.argv[1] == "-" else load(sys.argv[1])), load(sys.argv[2]), float(sys.argv[3])
diff = []
for key, (calls, ms) in long_.items():
    c0, m0 = short.get(key, (0, 0.0))
    d_calls, d_ms = (calls - c0) / steps, (ms - m0) / steps
    if d_calls > 0:
        diff.append((key, d_calls, d_ms))
diff.sort(key=lambda r: -r[2])
total = sum(r[2] for r in diff)
calls = sum(r[1] for r in diff)
print(f"per-step kernel breakdown ({sys.argv[2]} minus {sys.argv[1]}, over {steps:g} steps)")
width = max([40] + [len(op) + 2 for (op, _, _), _, _ in diff])
print(f"{'op':{width}}{'dtype':6}{'calls':>8}{'ms/step':>10}{'us/call':>10}{'share':>8}")
for (op, dev, dtype), c, ms in diff:
    print(f"{op:{width}}{dtype:6}{c:8.0f}{ms:10.3f}{1000 * ms / c:10.1f}{100 * ms / total:7.1f}%")
print(f"{'total':{width + 6}}{calls:8.0f}{total:10.3f}")
