"""torch._grouped_mm on loom-bench-grouped-gemm's shapes and group sizes (by default 8 experts, top-2, hidden 4096,
FFN 14336, bf16, loads proportional to 1..8), timed the same way (CUDA events, warm-up, median of 20), beside one
dense torch.mm of the same work and a loop of one torch.mm per expert.
    python3 bench/grouped_gemm_torch_reference.py [--experts E] [--top-k K] [--hidden C] [--ffn F] [tokens...]
    (default tokens 8192 32768; the flags as loom-bench-grouped-gemm's)"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_torch_reference import median_ms  # noqa: E402  (CUDA events, warm-up, median of 20)

EXPERTS, TOP_K, HIDDEN, FFN = 8, 2, 4096, 14336


def uneven_sizes(rows):
    sizes, given = [], 0
    for e in range(EXPERTS):
        s = rows - given if e + 1 == EXPERTS else rows * (e + 1) // (EXPERTS * (EXPERTS + 1) // 2)
        sizes.append(s)
        given += s
    return sizes


def main():
    global EXPERTS, TOP_K, HIDDEN, FFN
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=EXPERTS)
    parser.add_argument("--top-k", type=int, default=TOP_K)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--ffn", type=int, default=FFN)
    parser.add_argument("tokens", type=int, nargs="*")
    args = parser.parse_args()
    for v in (args.experts, args.top_k, args.hidden, args.ffn, *args.tokens):
        if v <= 0:
            parser.error(f"sizes must be positive, got {v}")
    EXPERTS, TOP_K, HIDDEN, FFN = args.experts, args.top_k, args.hidden, args.ffn
    counts = args.tokens or [8192, 32768]
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    print(f"{'product':34s} {'grouped ms':>10s} {'TFLOP/s':>9s} {'loop ms':>9s} {'TFLOP/s':>9s} {'dense ms':>9s} {'TFLOP/s':>9s}")
    for tokens in counts:
        rows = TOP_K * tokens
        sizes = uneven_sizes(rows)
        print(f"tokens {tokens} (rows {rows}; per expert: {' '.join(map(str, sizes))})", flush=True)
        offs = torch.tensor(sizes, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
        flops = 2.0 * rows * FFN * HIDDEN
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(EXPERTS, FFN, HIDDEN, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(rows, FFN, device="cuda", dtype=torch.bfloat16)
        starts = [0] + offs.tolist()[:-1]
        cases = {
            "forward x W^T": (lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
                              lambda: [x[s:s + n] @ w[e].t() for e, (s, n) in enumerate(zip(starts, sizes))],
                              lambda: x @ w[0].t()),
            "input grad dy W": (lambda: torch._grouped_mm(dy, w, offs=offs),
                                lambda: [dy[s:s + n] @ w[e] for e, (s, n) in enumerate(zip(starts, sizes))],
                                lambda: dy @ w[0]),
            # The weight gradient as _grouped_mm takes it: a 2D x 2D product grouped along K.
            "weight grad dy^T x": (lambda: torch._grouped_mm(dy.t(), x, offs=offs),
                                   lambda: [dy[s:s + n].t() @ x[s:s + n] for s, n in zip(starts, sizes)],
                                   lambda: dy.t() @ x),
        }
        for name, (grouped, loop, dense) in cases.items():
            g, lo, d = median_ms(grouped, warmup=3), median_ms(loop, warmup=3), median_ms(dense, warmup=3)
            print(f"{name:34s} {g:10.3f} {flops / g / 1e9:9.1f} {lo:9.3f} {flops / lo / 1e9:9.1f} {d:9.3f} "
                  f"{flops / d / 1e9:9.1f}", flush=True)


if __name__ == "__main__":
    main()
