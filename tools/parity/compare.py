#!/usr/bin/env python3
"""Compares two files of tools/parity/mode_matrix.sh: run by run, every step's loss, gradient norm and evaluation loss,
as written (every digit). Prints each run as 'same bits', the largest relative difference, or what is missing; exits
non-zero unless every run of the first file is in the second with the same bits."""
import json
import sys


def load(path):
    return {j["run"]: j for j in map(json.loads, open(path))}


a, b = load(sys.argv[1]), load(sys.argv[2])
bad = 0
for name, ra in a.items():
    rb = b.get(name)
    if rb is None or "error" in ra or "error" in rb:
        print(f"{name:40s} {'missing' if rb is None else 'error: ' + str(ra.get('error') or rb.get('error'))[-200:]}")
        bad += 1
        continue
    worst, same = 0.0, ra["steps"] == rb["steps"]
    for step, va in ra["steps"].items():
        vb = rb["steps"].get(step, {})
        for k, x in va.items():
            if k not in vb:
                worst = float("inf")
                continue
            x, y = float(x), float(vb[k])
            worst = max(worst, abs(x - y) / max(abs(x), 1e-30))
    print(f"{name:40s} {'same bits' if same else f'differs (max rel {worst:.3g})'}")
    bad += not same
print(f"{len(a) - bad} of {len(a)} runs give the same bits")
sys.exit(1 if bad else 0)
