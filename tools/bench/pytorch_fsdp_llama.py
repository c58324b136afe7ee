#!/usr/bin/env python3
"""PyTorch FSDP2 reference for Loom's ZeRO-3 benchmark: LLaMA-3 trained sharded over the GPUs of one node.

The model is tools/bench/pytorch_llama.py's (Loom's LLaMA written in PyTorch), built on the meta device, each decoder
layer and then the root wrapped with fully_shard (bf16 parameters, f32 gradient reduction: MixedPrecisionPolicy),
every layer checkpointed (torch.utils.checkpoint, non-reentrant), bf16 autocast (the model's RMSNorm computes in f32),
fused AdamW (lr 6e-4, betas 0.9/0.95, weight decay
0.1), gradient clipping at 1.0, random tokens. Prints tokens/s per GPU (median over the steps after
--timing-warmup), MFU (6N + 6*L*C*T flops per token, as loom-train counts them) and peak memory.

  torchrun --nproc-per-node 2 tools/bench/pytorch_fsdp_llama.py --model llama3-8b -b 1 -t 2048 --steps 12
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_llama import MODELS, ROPE_THETA, Llama, rope_tables  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    ap.add_argument("--batch-size", "-b", type=int, default=1, help="sequences per GPU")
    ap.add_argument("--seq-len", "-t", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timing-warmup", type=int, default=4)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--no-checkpoint", action="store_true", help="keep every activation")
    a = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    torch.manual_seed(1337)
    n_layer, n_head, _, dim, _, vocab, scaling, _, context = MODELS[a.model]
    with torch.device("meta"):
        model = Llama(a.model)
    if not a.no_checkpoint:
        for block in model.model.layers:
            block.forward = (lambda f: lambda x, cos, sin: checkpoint(f, x, cos, sin, use_reentrant=False))(block.forward)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=dev)
    proj_std = 0.02 / math.sqrt(2 * n_layer)  # Llama.__init__'s, again on the sharded parameters
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.fill_(1.0)
            else:
                p.normal_(0.0, proj_std if ("o_proj" in pname or "down_proj" in pname) else 0.02)
        cos, sin = rope_tables(context, dim // n_head, ROPE_THETA, scaling)
        model.rope_cos = cos.to(dev)
        model.rope_sin = sin.to(dev)
    n_params = sum(p.numel() for p in model.parameters())  # DTensors: the global count
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    plain = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    B, T = a.batch_size, a.seq_len
    g = torch.Generator(device=dev).manual_seed(1000 + rank)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for step in range(a.steps):
        x = torch.randint(0, vocab, (B, T + 1), device=dev, generator=g)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):  # the f32 norm outputs meet bf16 weights, as in Loom
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        if rank == 0:
            print(f"step {step + 1:3d} | loss {loss.item():.4f} | norm {norm.item():.3f} | {dt * 1000:.0f} ms | "
                  f"{B * T / dt:.0f} tok/s per GPU", flush=True)
    med = statistics.median(times[a.timing_warmup:])
    tok = B * T / med
    flops = 6 * n_params + 6 * n_layer * dim * T
    peak = torch.cuda.max_memory_allocated() / 2**30
    reserved = torch.cuda.max_memory_reserved() / 2**30
    if rank == 0:
        print(f"pytorch fsdp2 {a.model}: {world} GPUs, B={B} T={T} per GPU, {tok:.0f} tokens/s per GPU, "
              f"MFU {100 * tok * flops / (a.peak_tflops * 1e12):.1f}%, peak {peak:.1f} GiB allocated "
              f"({reserved:.1f} GiB reserved), {n_params / 1e9:.2f}B parameters", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
