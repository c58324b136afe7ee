#!/usr/bin/env python3
"""What driving Loom's trainer from Python costs: the same run, from one TOML file, once with loom-train and once with
loom.Trainer.run(on_step=...) (a Python callback every step, so the Python path runs each step), each in its own
process, one after the other. Both write metrics.jsonl, whose step lines carry the wall-clock time they were written:
the median interval between consecutive step lines after the warm-up steps is the step time of each, measured the
same way on both sides (the callback's cost falls inside loom.Trainer's intervals). Also printed: the step's own time
as the trainer measures it (perf/ms_per_step, the callback outside it) and the interval between callbacks as Python
sees it. The last line is one RESULT line.

On a GPU (after tools/device/build.sh with LOOM_PYTHON=ON), from the repository root:
  PYTHONPATH=build-dev/python python3 tools/bench/python_overhead.py --loom-train build-dev/loom-train
A quick check on the CPU:
  PYTHONPATH=build/python python3 tools/bench/python_overhead.py --model d2 --device cpu --steps 5 -b 2 -t 64 \
      --loom-train build/loom-train

Without --data, a synthetic shard (tools/bench/make_shard.py) of enough tokens is written to the work folder.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def child(config, log_dir, times_path):
    """loom.Trainer over the TOML file, a Python callback every step (run in its own process)."""
    import loom

    seen = []

    def on_step(metrics):
        seen.append({"step": metrics["step"], "t": time.perf_counter(), "loss": metrics["loss"], "ms": metrics["ms"]})

    trainer = loom.Trainer(config, log_dir=log_dir)
    trainer.run(on_step=on_step)
    pathlib.Path(times_path).write_text(json.dumps(seen))


def step_lines(log_dir):
    """The step lines of a metrics.jsonl's last run: (step, wall time, ms of the step, loss, tokens per step)."""
    rows = []
    for line in (pathlib.Path(log_dir) / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry.get("run_start"):
            rows = []
        elif entry.get("perf/ms_per_step") is not None:
            tokens = entry["perf/tokens_per_second"] * entry["perf/ms_per_step"] / 1000
            rows.append((entry["step"], entry["time"], entry["perf/ms_per_step"], entry.get("train/loss"), tokens))
    return rows


def median_after(values, warm):
    """The median of the values ((step, value) pairs) of the steps after the warm-up."""
    kept = [v for step, v in values if step > warm]
    return statistics.median(kept) if kept else float("nan")


def summary(rows, warm):
    """Median wall interval between step lines, median step ms, tokens per step, by step."""
    intervals = [(b[0], (b[1] - a[1]) * 1000) for a, b in zip(rows, rows[1:]) if b[0] == a[0] + 1]
    return {"wall_ms": median_after(intervals, warm), "step_ms": median_after([(r[0], r[2]) for r in rows], warm),
            "tokens": round(rows[0][4]) if rows else 0, "losses": {r[0]: r[3] for r in rows}}


def run(cmd, log, timeout, env=None):
    start = time.time()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except OSError as e:  # no such program
            rc = e
    print(f"  {' '.join(map(str, cmd))}: rc {rc}, {time.time() - start:.1f} s (log {log})", flush=True)
    if rc != 0:
        print("".join(open(log, errors="replace").readlines()[-15:]), end="")
        sys.exit(f"python_overhead: {cmd[0]} failed (rc {rc})")


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        return child(*sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-124m", help="any name loom-train --model takes (default gpt2-124m)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default bf16 on cuda, f32 on the CPU")
    ap.add_argument("-b", "--batch-size", type=int, default=16)
    ap.add_argument("-t", "--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warm", type=int, default=5, help="steps left out of the medians (default 5)")
    ap.add_argument("--data", help="a token shard (default: a synthetic one in the work folder)")
    ap.add_argument("--vocab", type=int, default=50257, help="the synthetic shard's vocabulary (default GPT-2's)")
    ap.add_argument("--loom-train", default=os.environ.get("LOOM_TRAIN_EXE") or
                    next((p for p in ("build-dev/loom-train", "build/loom-train") if os.path.exists(ROOT / p)),
                         "build/loom-train"))
    ap.add_argument("--work", help="where the config, shard, logs and metrics go (default: a new temporary folder)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    a = ap.parse_args()
    dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "f32")
    exe = pathlib.Path(a.loom_train)
    exe = exe if exe.is_absolute() or exe.exists() else ROOT / exe
    work = pathlib.Path(a.work or tempfile.mkdtemp(prefix="loom_python_overhead_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    # At least two intervals after the warm-up, however few the steps.
    warm = max(0, min(a.warm, a.steps - 3))
    if warm != a.warm:
        print(f"python_overhead: {a.steps} steps: the first {warm} left out of the medians, not {a.warm}")

    data = a.data
    if not data:
        tokens = max((a.steps + 2) * a.batch_size * a.seq_len + 1, 100_000)
        data = work / f"shard_v{a.vocab}_{tokens}.bin"
        if not data.exists():
            subprocess.run([sys.executable, str(ROOT / "tools/bench/make_shard.py"), str(data), "--tokens", str(tokens),
                            "--vocab", str(a.vocab)], check=True, stdout=subprocess.DEVNULL)
    # One file for both runs: loom-train's flags as keys (e2e_gpt2.sh's settings); eval_batches 1 keeps the end short.
    config = work / "run.toml"
    config.write_text(f"""[model]
model = "{a.model}"

[training]
train_data = "{pathlib.Path(data).resolve()}"
batch_size = {a.batch_size}
seq_len = {a.seq_len}
steps = {a.steps}
device = "{a.device}"
dtype = "{dtype}"
eval_interval = 0
eval_batches = 1
sample_tokens = 0
""")
    app_dir, py_dir, times = work / "loom_train", work / "loom_trainer", work / "callbacks.json"
    for d in (app_dir, py_dir):  # metrics.jsonl is appended to: start clean
        (d / "metrics.jsonl").unlink(missing_ok=True)
    print(f"== {a.model} on {a.device}, {dtype}, B={a.batch_size}, T={a.seq_len}, {a.steps} steps ({config})")
    run([str(exe), "--config", str(config), "--log-dir", str(app_dir)], work / "loom_train.log", a.timeout)
    run([sys.executable, str(pathlib.Path(__file__).resolve()), "--child", str(config), str(py_dir), str(times)],
        work / "loom_trainer.log", a.timeout)

    app, py = summary(step_lines(app_dir), warm), summary(step_lines(py_dir), warm)
    calls = json.loads(times.read_text())
    callback_ms = median_after([(cur["step"], (cur["t"] - prev["t"]) * 1000) for prev, cur in zip(calls, calls[1:])],
                               warm)
    if len(calls) != a.steps or len(py["losses"]) != a.steps or len(app["losses"]) != a.steps:
        sys.exit(f"python_overhead: expected {a.steps} steps, got loom-train {len(app['losses'])}, "
                 f"loom.Trainer {len(py['losses'])} ({len(calls)} callbacks)")
    tokens = app["tokens"]
    app_tok, py_tok = tokens / app["wall_ms"] * 1000, tokens / py["wall_ms"] * 1000
    overhead = (py["wall_ms"] / app["wall_ms"] - 1) * 100
    # The same settings and seed: the same losses, where the device's kernels are deterministic.
    pairs = [(app["losses"][s], py["losses"].get(s)) for s in app["losses"]]
    same = sum(x == y for x, y in pairs)
    diff = max((abs(x - y) for x, y in pairs if x is not None and y is not None), default=float("nan"))
    print(f"median over steps {warm + 1}..{a.steps} ({tokens} tokens a step):")
    print(f"  {'':14}{'wall ms/step':>14}{'tokens/s':>12}{'step ms':>10}")
    print(f"  {'loom-train':14}{app['wall_ms']:14.2f}{app_tok:12.0f}{app['step_ms']:10.2f}")
    print(f"  {'loom.Trainer':14}{py['wall_ms']:14.2f}{py_tok:12.0f}{py['step_ms']:10.2f}"
          f"   (between callbacks: {callback_ms:.2f} ms)")
    print(f"  losses: {same} of {a.steps} steps equal, largest difference {diff:.3g}")
    print(f"RESULT python_overhead model={a.model} device={a.device} dtype={dtype} B={a.batch_size} T={a.seq_len} "
          f"steps={a.steps} warm={warm} loom_train_tok_s={app_tok:.0f} trainer_tok_s={py_tok:.0f} "
          f"overhead_pct={overhead:.2f} loom_train_ms={app['wall_ms']:.2f} trainer_ms={py['wall_ms']:.2f} "
          f"loom_train_step_ms={app['step_ms']:.2f} trainer_step_ms={py['step_ms']:.2f} "
          f"callback_interval_ms={callback_ms:.2f} losses_equal={same}/{a.steps}")


if __name__ == "__main__":
    main()
