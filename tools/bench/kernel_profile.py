#!/usr/bin/env python3
"""Where each framework's GPU time goes, kernel by kernel, in the same call: GPT-2 trained a few steps by PyTorch
(tools/bench/pytorch_gpt2.py's model and step: bf16 autocast, torch.compile, fused AdamW, clipping) and by Loom
(loom.Trainer, the Python package, from the same settings), each in a process of its own under torch.profiler's CUDA
activity. CUPTI records every kernel of the process, so Loom's kernels and its libraries' (cuBLAS, cuDNN) are seen
the same way as PyTorch's, without the synchronization per op of Loom's own breakdown (LOOM_PROFILE_OPS). The
profiled steps' kernels are grouped into classes (matrix products, FP8 casts, attention, norms, loss, optimizer,
casts and copies, other elementwise work) per step, side by side with the difference, then each framework's largest kernels,
then one RESULT line. The step's wall time beside the kernels' sum shows the time the GPU waited.

On a GPU, after the Python package is built (tools/device/session.sh kernels does both), from the repository root:
  PYTHONPATH=build-dev/python python3 tools/bench/kernel_profile.py --model gpt2-124m -b 32
  ... --loom-set fp8=classifier --loom-set fp8_amax_history=16     (loom-train's settings as TOML keys)
  ... --skip-torch                                                    (Loom alone, any model loom-train takes)
"""
import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Kernel classes, first match wins (names lower-cased). cuBLAS's Hopper kernels are "nvjet_*" or "sm90_xmma_*", cuDNN's
# attention "cudnn_generated_fort_native_sdpa_*", torch.compile's fused kernels "triton_*_fused_<ops>".
CLASSES = [
    ("matrix products", r"gemm|xmma|nvjet|cutlass|wgmma|matmul|splitk|gemv"),
    ("FP8 casts and scales", r"quantiz|amax|fp8"),
    ("attention", r"flash|fmha|attention|sdpa|attn"),
    ("loss", r"cross_entropy|crossentropy|nll|log_softmax|logsumexp|softmax"),
    ("norms", r"norm"),
    ("optimizer", r"adam|multi_tensor|optimizer|sgd"),
    ("casts and copies", r"copy|cast|convert|memcpy|memset|to_dtype|transpose|permute|contiguous|fill"),
    ("other elementwise and reductions", r"."),
]


def kernel_class(name):
    low = name.lower()
    for label, pattern in CLASSES:
        if re.search(pattern, low):
            return label
    return CLASSES[-1][0]


def kernels_of_trace(path):
    """name -> [launches, microseconds] of the GPU work in a chrome trace (kernels, memcpys, memsets)."""
    events = json.loads(pathlib.Path(path).read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    table = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        row = table.setdefault(e.get("name", "?"), [0, 0.0])
        row[0] += 1
        row[1] += float(e.get("dur", 0.0))
    return table


def profiler():
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    return profile(activities=[ProfilerActivity.CUDA])


def child_torch(a, out):
    """PyTorch's GPT-2 step (pytorch_gpt2.py's model, optimizer and step), warm steps, then the profiled ones."""
    sys.path.insert(0, str(ROOT / "tools/bench"))
    import torch
    import pytorch_gpt2 as ref

    name = a.model.replace("gpt2-", "").lower()
    if name not in ref.MODELS:
        sys.exit(f"kernel_profile: the PyTorch side knows GPT-2 {sorted(ref.MODELS)}, not '{a.model}' "
                 "(--skip-torch profiles Loom alone)")
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model = ref.GPT2(*ref.MODELS[name]).to("cuda")
    opt = ref.make_optimizer(model, 6e-4)
    step_fn = torch.compile(model)
    B, T = a.batch_size, a.seq_len
    tokens = torch.randint(0, ref.VOCAB, (B * T + 1,), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:-1].view(B, T).cuda(), tokens[1:].view(B, T).cuda()
    prof, walls = profiler(), []
    for step in range(a.warm + a.profile_steps):
        if step == a.warm:
            torch.cuda.synchronize()
            prof.start()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, _ = ref.train_step(step_fn, model, opt, x, y, True, 6e-4)
        loss.item()
        torch.cuda.synchronize()
        if step >= a.warm:
            walls.append((time.perf_counter() - t0) * 1000)
    prof.stop()
    finish(prof, walls, out, f"pytorch {torch.__version__} + compile")


def child_loom(a, out):
    """loom.Trainer from a TOML file of the same settings; the profiler runs over the steps after the warm ones."""
    import torch
    import loom

    work = pathlib.Path(out).parent
    data = work / "shard.bin"
    tokens = max((a.warm + a.profile_steps + 2) * a.batch_size * a.seq_len + 1, 100_000)
    subprocess.run([sys.executable, str(ROOT / "tools/bench/make_shard.py"), str(data), "--tokens", str(tokens),
                    "--vocab", str(a.vocab)], check=True, stdout=subprocess.DEVNULL)
    # The extra settings first, before any section (a key outside a section may be any of loom-train's); the
    # script's own settings leave out those the extra ones name.
    given = {key.replace("-", "_") for key, _ in a.loom_set}
    dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "f32")
    sections = {"model": {"model": f'"{a.model}"'},
                "training": {"train_data": f'"{data}"', "batch_size": a.batch_size, "seq_len": a.seq_len,
                             "steps": a.warm + a.profile_steps + 1, "device": f'"{a.device}"', "dtype": f'"{dtype}"',
                             "eval_interval": 0, "eval_batches": 1, "sample_tokens": 0}}
    text = "".join(f"{key} = {value}\n" for key, value in a.loom_set)
    for section, keys in sections.items():
        text += f"\n[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items() if k not in given)
    config = work / "run.toml"
    config.write_text(text)
    prof, walls = profiler(), []

    def on_step(metrics):
        step = metrics["step"]
        if a.warm < step <= a.warm + a.profile_steps:
            walls.append(metrics["ms"])
        if step == a.warm:
            torch.cuda.synchronize()
            prof.start()
        elif step == a.warm + a.profile_steps:
            torch.cuda.synchronize()
            prof.stop()

    loom.Trainer(str(config), log_dir=str(work / "logs")).run(on_step=on_step)
    finish(prof, walls, out, f"loom {getattr(loom, '__version__', '')}".strip())


def finish(prof, walls, out, who):
    trace = pathlib.Path(out).with_suffix(".trace.json")
    prof.export_chrome_trace(str(trace))
    pathlib.Path(out).write_text(json.dumps({"who": who, "walls_ms": walls, "kernels": kernels_of_trace(trace)}))
    trace.unlink(missing_ok=True)  # large; the table holds what is read from it


def per_step(result, steps):
    """class -> ms per step, and the kernels as (ms per step, launches per step, name), largest first."""
    classes, kernels = {label: 0.0 for label, _ in CLASSES}, []
    for name, (count, us) in result["kernels"].items():
        classes[kernel_class(name)] += us / 1000 / steps
        kernels.append((us / 1000 / steps, count / steps, name))
    return classes, sorted(kernels, reverse=True)


def main():
    if len(sys.argv) >= 2 and sys.argv[1] in ("--child-torch", "--child-loom"):
        a = parse(sys.argv[3:])
        return (child_torch if sys.argv[1] == "--child-torch" else child_loom)(a, sys.argv[2])
    a = parse(sys.argv[1:])
    work = pathlib.Path(a.work or tempfile.mkdtemp(prefix="loom_kernel_profile_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    sides = ([] if a.skip_torch else ["torch"]) + ["loom"]
    results = {}
    for side in sides:
        out, log = work / f"{side}.json", work / f"{side}.log"
        start = time.time()
        with open(log, "w") as f:
            try:
                rc = subprocess.run([sys.executable, __file__, f"--child-{side}", str(out)] + sys.argv[1:], stdout=f,
                                    stderr=subprocess.STDOUT, timeout=a.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        print(f"{side}: rc {rc}, {time.time() - start:.0f} s (log {log})", flush=True)
        if rc != 0:
            print("".join(open(log, errors="replace").readlines()[-20:]), end="")
            sys.exit(f"kernel_profile: the {side} run failed (rc {rc})")
        results[side] = json.loads(out.read_text())
    report(a, results)


def report(a, results):
    """The class table side by side, each side's largest kernels, and the RESULT line."""
    sides = list(results)
    steps = a.profile_steps
    tables = {side: per_step(r, steps) for side, r in results.items()}
    walls = {side: statistics.median(r["walls_ms"]) if r["walls_ms"] else float("nan") for side, r in results.items()}
    print(f"\n{a.model}, B = {a.batch_size}, T = {a.seq_len}, {steps} profiled steps after {a.warm}; ms per step "
          f"of GPU work by kernel class ({', '.join(results[s]['who'] for s in sides)})")
    head = f"{'class':34}" + "".join(f"{s:>12}" for s in sides) + ("   loom - torch" if len(sides) == 2 else "")
    print(head)
    for label, _ in CLASSES:
        values = [tables[s][0][label] for s in sides]
        line = f"{label:34}" + "".join(f"{v:12.2f}" for v in values)
        print(line + (f"{values[1] - values[0]:+15.2f}" if len(values) == 2 else ""))
    totals = [sum(tables[s][0].values()) for s in sides]
    print(f"{'all kernels':34}" + "".join(f"{v:12.2f}" for v in totals) +
          (f"{totals[1] - totals[0]:+15.2f}" if len(totals) == 2 else ""))
    print(f"{'step wall time (median)':34}" + "".join(f"{walls[s]:12.2f}" for s in sides) +
          (f"{walls['loom'] - walls['torch']:+15.2f}" if len(sides) == 2 else ""))
    print(f"{'GPU idle (wall - kernels)':34}" + "".join(f"{walls[s] - t:12.2f}" for s, t in zip(sides, totals)))
    for s in sides:
        print(f"\n{s}: the {a.top} largest kernels (ms per step, launches per step, class, name)")
        for ms, calls, name in tables[s][1][:a.top]:
            print(f"  {ms:8.3f} {calls:6.1f}  {kernel_class(name)[:16]:16}  {name[:110]}")
    fields = " ".join(f"{s}_kernels_ms {t:.2f} {s}_wall_ms {walls[s]:.2f}" for s, t in zip(sides, totals))
    print(f"RESULT kernel_profile {a.model} b {a.batch_size} t {a.seq_len} {fields}")


def setting(text):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"'{text}' is not KEY=VALUE")
    return tuple(text.split("=", 1))


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-124m", help="loom-train's name (the PyTorch side: GPT-2 124m/350m/774m)")
    ap.add_argument("-b", "--batch-size", type=int, default=32)
    ap.add_argument("-t", "--seq-len", type=int, default=1024)
    ap.add_argument("--warm", type=int, default=5, help="steps before the profiled ones (compilation, plans)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25, help="kernels listed per framework")
    ap.add_argument("--loom-set", action="append", default=[], metavar="KEY=VALUE", type=setting,
                    help="a loom-train setting for Loom's run, as its TOML key (fp8=classifier; a word is quoted)")
    ap.add_argument("--vocab", type=int, default=50257,
                    help="the synthetic shard's vocabulary for Loom's run (GPT-2's; 128256 for LLaMA-3)")
    ap.add_argument("--skip-torch", action="store_true", help="profile Loom alone")
    ap.add_argument("--device", default="cuda", help="Loom's device (cpu: a check of this script, no kernels)")
    ap.add_argument("--dtype", help="Loom's dtype (default bf16 on CUDA, f32 on the CPU)")
    ap.add_argument("--work", help="where the logs and tables go (default: a new temporary folder)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    a = ap.parse_args(argv)
    quoted = []
    for key, value in a.loom_set:
        bare = re.fullmatch(r"-?\d+(\.\d+)?|true|false|\".*\"", value)
        quoted.append((key, value if bare else json.dumps(value)))
    a.loom_set = quoted
    if a.profile_steps < 1 or a.warm < 1:
        ap.error("--warm and --profile-steps must be at least 1")
    if not a.skip_torch and not a.device.startswith("cuda"):
        ap.error("the PyTorch side runs on CUDA only: --skip-torch with --device " + a.device)
    return a


if __name__ == "__main__":
    main()
