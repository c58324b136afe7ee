#!/usr/bin/env python3
"""Where a data-parallel step's time goes on each GPU, from an Nsight Systems trace exported to SQLite.

  nsys profile --trace=cuda --sample=none -o /tmp/ddp build-dev/loom-run --nproc-per-node 2 build-dev/loom-train ...
  nsys export --type sqlite -o /tmp/ddp.sqlite /tmp/ddp.nsys-rep
  python3 tools/bench/nsys_overlap.py /tmp/ddp.sqlite [--skip-steps 3]

Per device, over the steps after --skip-steps (a step ends with its AdamW kernel): milliseconds per step in which
compute kernels run, NCCL kernels run, NCCL runs with no compute kernel beside it (exposed communication), and the
GPU runs nothing (idle: host syncs, launch gaps, waiting for the other rank). Standard library only.
"""
import argparse
import sqlite3


def union(intervals):
    """Total length and merged list of [start, end) intervals."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return sum(e - s for s, e in merged), merged


def minus(a, b):
    """Length of merged intervals a not covered by merged intervals b."""
    total, j = 0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


ap = argparse.ArgumentParser()
ap.add_argument("db")
ap.add_argument("--skip-steps", type=int, default=3)
ap.add_argument("--step-kernel", default="adamw", help="a name fragment of the one kernel that ends each step")
a = ap.parse_args()
con = sqlite3.connect(a.db)
rows = con.execute("SELECT k.deviceId, k.start, k.end, s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                   "JOIN StringIds s ON s.id = k.shortName ORDER BY k.start").fetchall()
print(f"{'GPU':>3} {'steps':>5} {'ms/step':>8} {'compute':>8} {'nccl':>7} {'exposed':>8} {'idle':>7}   (ms per step)")
for dev in sorted({r[0] for r in rows}):
    ks = [r for r in rows if r[0] == dev]
    ends = []
    for r in ks:  # one end per step: the last of the step's update kernels (one per parameter group)
        if a.step_kernel in r[3].lower():
            if ends and r[1] - ends[-1] < 1e6:
                ends[-1] = r[2]
            else:
                ends.append(r[2])
    if len(ends) <= a.skip_steps + 1:
        print(f"{dev:>3}: too few steps ({len(ends)} '{a.step_kernel}' kernels)")
        continue
    t0, t1 = ends[a.skip_steps], ends[-1]
    steps = len(ends) - 1 - a.skip_steps
    inside = [(max(s, t0), min(e, t1), n) for _, s, e, n in ks if e > t0 and s < t1]
    comp_len, comp = union([(s, e) for s, e, n in inside if "nccl" not in n.lower()])
    nccl_len, nccl = union([(s, e) for s, e, n in inside if "nccl" in n.lower()])
    exposed = minus(nccl, comp)
    busy_len, _ = union([(s, e) for s, e, _ in inside])
    span = t1 - t0
    ms = lambda x: x / 1e6 / steps
    print(f"{dev:>3} {steps:>5} {ms(span):8.2f} {ms(comp_len):8.2f} {ms(nccl_len):7.2f} {ms(exposed):8.2f} "
          f"{ms(span - busy_len):7.2f}")
