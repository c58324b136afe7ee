#!/usr/bin/env python3
"""The peer of loom-bench-fp8-gemm: torch._scaled_mm on the same products (each linear layer's forward, input
gradient and weight gradient over `tokens` rows), e4m3 activations and weights, e5m2 gradients, with and without
use_fast_accum, beside torch.mm in bf16. Operands in the layouts _scaled_mm takes (the first row-major, the second
column-major: the transposed copies made once, outside the timing, as Loom's casts write both layouts). CUDA events,
warm-up, then the median of 20 runs; microseconds and TFLOP/s = 2mnk / time.

  fp8_gemm_torch_reference.py [model] [tokens]     (model: llama3-3b (default), llama3-1b, llama3-8b, gpt2-124m)
"""
import sys

import torch
from torch_timing import median_ms

# The dimensions of Loom's models of those names (src/nn/model_config.cc): C, FFN, heads, kv heads, head size, vocab.
MODELS = {
    "llama3-1b": (2048, 8192, 32, 8, 64, 128256),
    "llama3-3b": (3072, 8192, 24, 8, 128, 128256),
    "llama3-8b": (4096, 14336, 32, 8, 128, 128256),
    "gpt2-124m": (768, 3072, 12, 12, 64, 50304),
}


def median_us(fn):
    return median_ms(fn, warmup=3) * 1e3


def codes(x, dtype):
    scale = torch.finfo(dtype).max / x.abs().max().float()
    return (x.float() * scale).to(dtype), (1.0 / scale).reshape(())


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else "llama3-3b"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    if model not in MODELS:
        sys.exit(f"fp8_gemm_torch_reference.py: model '{model}' is not one of {', '.join(MODELS)}")
    C, F, H, KV, D, V = MODELS[model]
    if model.startswith("gpt2"):
        layers = [("c_attn", C, 3 * C), ("attn c_proj", C, C), ("c_fc", C, F), ("mlp c_proj", F, C)]
    else:
        layers = [("q", C, H * D), ("k, v", C, KV * D), ("o", H * D, C), ("gate, up", C, F), ("down", F, C)]
    layers.append(("classifier", C, V))
    dev = "cuda"
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; {model}'s linear layers over {tokens} "
          f"tokens: torch._scaled_mm against torch.mm in bf16, microseconds (TFLOP/s)")
    print(f"{'layer':12} {'product':8} {'bf16':>16} {'fp8 promoted':>16} {'fp8 fast':>16} {'fp8/bf16':>8} {'fast +%':>8}")
    totals = [0.0, 0.0, 0.0]
    for name, n_in, n_out in layers:
        flops = 2.0 * tokens * n_in * n_out
        cell = lambda us: f"{us:.1f} ({flops / (us * 1e-6) / 1e12:.0f})"
        x = torch.randn(tokens, n_in, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(n_out, n_in, device=dev) * 0.02).to(torch.bfloat16)
        g = (torch.randn(tokens, n_out, device=dev) * 1e-3).to(torch.bfloat16)
        xq, sx = codes(x, e4)
        wq, sw = codes(w, e4)
        gq, sg = codes(g, e5)
        w_t = wq.t().contiguous()  # [in, out] row-major: W as the input gradient's second operand reads it
        g_t = gq.t().contiguous()  # [out, tokens]: the weight gradient's first operand
        x_t = xq.t().contiguous()  # [in, tokens]: its second
        sm = torch._scaled_mm
        rows = [
            ("forward", median_us(lambda: torch.mm(x, w.t())),
             median_us(lambda: sm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=False)),
             median_us(lambda: sm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True))),
            ("grad x", median_us(lambda: torch.mm(g, w)),
             median_us(lambda: sm(gq, w_t.t(), scale_a=sg, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=False)),
             median_us(lambda: sm(gq, w_t.t(), scale_a=sg, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True))),
            ("grad w", median_us(lambda: torch.mm(g.t(), x)),
             median_us(lambda: sm(g_t, x_t.t(), scale_a=sg, scale_b=sx, out_dtype=torch.float32, use_fast_accum=False)),
             median_us(lambda: sm(g_t, x_t.t(), scale_a=sg, scale_b=sx, out_dtype=torch.float32, use_fast_accum=True))),
        ]
        for product, bf16, promoted, fast in rows:
            trained = fast if product == "forward" else promoted
            print(f"{name:12} {product:8} {cell(bf16):>16} {cell(promoted):>16} {cell(fast):>16} "
                  f"{bf16 / trained:8.2f} {100 * (promoted / fast - 1):8.1f}")
            totals[0] += bf16
            totals[1] += trained
            totals[2] += fast
    print(f"one of each layer's three products: bf16 {totals[0]:.1f} us, FP8 as trained (forward fast) {totals[1]:.1f} us "
          f"({totals[0] / totals[1]:.2f}x), all fast {totals[2]:.1f} us ({totals[0] / totals[2]:.2f}x)")


if __name__ == "__main__":
    main()
