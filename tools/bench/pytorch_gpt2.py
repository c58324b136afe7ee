#!/usr/bin/env python3
"""PyTorch reference for Loom's end-to-end benchmark: a nanoGPT-style GPT-2 trained the way loom-train trains it.

Padded vocabulary 50304 with tied embeddings, bf16 autocast over f32 master weights, torch.compile,
F.scaled_dot_product_attention, fused AdamW (lr 6e-4, weight decay 0.1 on matrices, betas 0.9/0.95), gradient
clipping at 1.0 and loom-train's schedule (linear warmup, cosine to 10%). Batches come from an llm.c token shard
read in order, as loom-train reads it (x = tokens[i*B*T : (i+1)*B*T], y shifted by one), or from random tokens.
Prints each step's loss, then tokens/s (median over the steps after --timing-warmup), MFU (6N + 6*L*C*T flops per
token against --peak-tflops) and peak memory (torch.cuda.max_memory_allocated).

  python3 tools/bench/pytorch_gpt2.py --model 124m --batch-size 16 --steps 30 --data shard.bin
"""
import argparse
import math
import statistics
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MODELS = {"124m": (12, 12, 768), "350m": (24, 16, 1024), "774m": (36, 20, 1280)}
VOCAB, PADDED_VOCAB, CONTEXT = 50257, 50304, 1024


class Block(nn.Module):
    def __init__(self, n_head, dim):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.attn_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, n_layer, n_head, dim):
        super().__init__()
        self.wte = nn.Embedding(PADDED_VOCAB, dim)
        self.wpe = nn.Embedding(CONTEXT, dim)
        self.h = nn.ModuleList(Block(n_head, dim) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, PADDED_VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():  # GPT-2 / llm.c initialization
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def read_shard(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520 and header[1] == 1, f"{path}: not an llm.c uint16 token shard"
    return np.fromfile(path, dtype=np.uint16, offset=1024, count=int(header[2])).astype(np.int64)


def lr_at(step, args):
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    low = args.lr * 0.1
    return low + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - low)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="124m", choices=sorted(MODELS))
    ap.add_argument("--batch-size", "-b", type=int, default=16)
    ap.add_argument("--seq-len", "-t", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--data", help="llm.c uint16 token shard (default: random tokens)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=10, help="learning-rate warmup steps (loom-train's default)")
    ap.add_argument("--timing-warmup", type=int, default=5, help="steps left out of the tokens/s median")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = "cuda"
    B, T = args.batch_size, args.seq_len
    if args.data:
        tokens = torch.from_numpy(read_shard(args.data))
    else:
        tokens = torch.randint(0, VOCAB, (args.steps * B * T + 1,), generator=torch.Generator().manual_seed(args.seed))
    windows = (tokens.numel() - 1) // (B * T)
    assert windows > 0, f"{tokens.numel()} tokens is fewer than one batch of {B}x{T}"

    model = GPT2(*MODELS[args.model]).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    n_layer, _, dim = MODELS[args.model]
    flops_per_token = 6 * n_params + 6 * n_layer * dim * T
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    step_fn = model if args.no_compile else torch.compile(model)
    print(f"pytorch {torch.__version__}: GPT-2 {args.model}, {n_params / 1e6:.1f}M parameters, batch {B}x{T}, "
          f"{args.steps} steps, {'random tokens' if not args.data else args.data}, "
          f"compile {'off' if args.no_compile else 'on'}", flush=True)

    times = []
    for step in range(args.steps):
        w = step % windows
        chunk = tokens[w * B * T: w * B * T + B * T + 1]
        x = chunk[:-1].view(B, T).to(dev, non_blocking=True)
        y = chunk[1:].view(B, T).to(dev, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        print(f"step {step + 1:4d}/{args.steps} | loss {loss_value:.4f} | norm {norm.item():.4f} | "
              f"{dt * 1000:7.1f} ms | {B * T / dt:9.0f} tok/s", flush=True)

    timed = times[args.timing_warmup:] or times
    tok_s = B * T / statistics.median(timed)
    mfu = flops_per_token * tok_s / (args.peak_tflops * 1e12)
    peak = torch.cuda.max_memory_allocated() / 2**20
    print(f"RESULT pytorch tokens_per_s {tok_s:.0f} mfu {mfu * 100:.1f} peak_mem_mib {peak:.0f} "
          f"params {n_params} flops_per_token {flops_per_token}", flush=True)


if __name__ == "__main__":
    main()
