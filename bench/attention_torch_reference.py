"""PyTorch's scaled_dot_product_attention on loom-bench-attention's shapes (bf16, causal), timed the same way (CUDA
events, warm-up, median of 20), for comparison. Prints TFLOP/s for the default backend choice and for each fast
backend forced, with GQA both through enable_gqa and with k/v expanded to every query head."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch_timing import median_ms

SHAPES = [("gpt2", 16, 12, 12, 1024, 64), ("llama", 4, 32, 8, 2048, 128)]


def run(name, B, H, Hkv, T, D, backend, expand):
    dev, dt = "cuda", torch.bfloat16
    q = torch.empty(B, H, T, D, device=dev, dtype=dt).uniform_(-1, 1).requires_grad_()
    k = torch.empty(B, Hkv, T, D, device=dev, dtype=dt).uniform_(-1, 1)
    v = torch.empty(B, Hkv, T, D, device=dev, dtype=dt).uniform_(-1, 1)
    if expand and Hkv != H:
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    k.requires_grad_()
    v.requires_grad_()
    grad_out = torch.empty_like(q).uniform_(-1, 1)
    gqa = {} if (expand or Hkv == H) else {"enable_gqa": True}

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)

    def forward_backward():
        out = forward()
        torch.autograd.grad(out, (q, k, v), grad_out)

    ctx = sdpa_kernel([backend]) if backend is not None else torch.autocast("cuda", enabled=False)
    with ctx:
        fwd_ms = median_ms(forward)
        both_ms = median_ms(forward_backward)
    fwd_flops = 4.0 * B * H * T * T * D / 2
    label = (backend.name if backend is not None else "default") + (" expand" if expand else "")
    print(f"torch {name:6s} {label:28s} fwd {fwd_ms:8.3f} ms {fwd_flops / fwd_ms / 1e9:7.1f} TFLOP/s | "
          f"f+b {both_ms:8.3f} ms {3.5 * fwd_flops / both_ms / 1e9:7.1f} TFLOP/s", flush=True)


def main():
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    for shape in SHAPES:
        for backend in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            for expand in ((False, True) if shape[2] != shape[3] else (False,)):
                try:
                    run(*shape, backend, expand)
                except Exception as e:  # a backend that cannot take the case says so and the rest go on
                    print(f"torch {shape[0]} {backend} expand={expand}: {type(e).__name__}: {str(e)[:120]}", flush=True)


if __name__ == "__main__":
    main()
