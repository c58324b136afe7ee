#!/usr/bin/env python3
"""PyTorch reference for Loom's end-to-end benchmark: a nanoGPT-style GPT-2 trained the way loom-train trains it.

Padded vocabulary 50304 with tied embeddings, bf16 autocast over f32 master weights, torch.compile,
F.scaled_dot_product_attention, fused AdamW (lr 6e-4, weight decay 0.1 on matrices, betas 0.9/0.95), gradient
clipping at 1.0 and loom-train's schedule (linear warmup, cosine to 10%). Batches come from an llm.c token shard
read in order, as loom-train reads it (x = tokens[i*B*T : (i+1)*B*T], y shifted by one), or from random tokens.
Prints each step's loss, then tokens/s (median over the steps after --timing-warmup), MFU (6N + 6*L*C*T flops per
token against --peak-tflops) and peak memory (torch.cuda.max_memory_allocated). --save-init PATH writes the freshly
initialized weights (before any step) as f32 safetensors with Hugging Face GPT-2 names, which loom-train --init-from
loads, so both frameworks start from the same weights.

  python3 tools/bench/pytorch_gpt2.py --model 124m --batch-size 16 --steps 30 --data shard.bin

Under torchrun (WORLD_SIZE > 1) it trains with DistributedDataParallel (NCCL, default buckets, f32 gradient
reduction; the DDP-wrapped model compiled, so the DDP optimizer splits the graph at bucket boundaries): --batch-size
per GPU, rank r reading windows r, r + world, ..., and the printed tokens/s is the world's.

  torchrun --nproc-per-node 2 tools/bench/pytorch_gpt2.py --model 124m --batch-size 32 --steps 30

--fp8 classifier|linear|all runs those products in FP8 as loom-train's --fp8 does, the recipe torchao's float8
training uses written out with torch._scaled_mm: e4m3 activations and weights (cast from the f32 masters), e5m2
output gradients, each tensor scaled by its own amax (current scaling), the forward's products in the tensor cores'
fast accumulator and the gradients' promoted (--fp8-fast-accumulation none: every product promoted). It checks its
three products against f32 on random operands before training and stops if one is off by more than FP8 explains.
"""
import argparse
import json
import math
import re
import struct
import statistics
import time

import os

import numpy as np
import torch
import torch.distributed as dist
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


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def to_fp8(t, dtype):
    """t's codes in dtype, scaled so its amax lands on the format's largest value, and the scale back (f32)."""
    top = torch.finfo(dtype).max
    scale = top / t.abs().amax().float().clamp(min=1e-12)
    return (t.float() * scale).clamp(-top, top).to(dtype).contiguous(), scale.reciprocal()


def column_major(q):
    """The same matrix laid out column by column, as torch._scaled_mm takes its second operand."""
    return q.t().contiguous().t()


class Fp8Matmul(torch.autograd.Function):
    """y = x w^T with x [N, in] and w [out, in] in FP8: the forward in bf16 out, the input gradient in bf16, the
    weight gradient in f32 (w's dtype, the master's)."""

    @staticmethod
    def forward(ctx, x, w, fast):
        with torch.autocast("cuda", enabled=False):
            xq, sx = to_fp8(x, E4M3)
            wq, sw = to_fp8(w, E4M3)
            ctx.save_for_backward(xq, sx, wq, sw)
            ctx.x_dtype = x.dtype
            return torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast)

    @staticmethod
    def backward(ctx, g):
        xq, sx, wq, sw = ctx.saved_tensors
        with torch.autocast("cuda", enabled=False):
            gq, sg = to_fp8(g, E5M2)
            gx = torch._scaled_mm(gq, column_major(wq), scale_a=sg, scale_b=sw, out_dtype=torch.bfloat16,
                                  use_fast_accum=False)
            gw = torch._scaled_mm(gq.t().contiguous(), column_major(xq), scale_a=sg, scale_b=sx,
                                  out_dtype=torch.float32, use_fast_accum=False)
        return gx.to(ctx.x_dtype), gw, None


class Fp8Linear(nn.Module):
    """A linear layer whose product runs in FP8 (Fp8Matmul); the weight and bias are the layer's own (a tied weight
    stays tied)."""

    def __init__(self, linear, fast):
        super().__init__()
        self.weight, self.bias, self.fast = linear.weight, linear.bias, fast

    def forward(self, x):
        y = Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), self.weight, self.fast).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def use_fp8(model, scope, fast):
    """Puts Fp8Linear in place of the blocks' linear layers (linear, all) and of the classifier (classifier, all)."""
    if scope in ("linear", "all"):
        for block in model.h:
            for name in ("c_attn", "attn_proj", "c_fc", "mlp_proj"):
                setattr(block, name, Fp8Linear(getattr(block, name), fast))
    if scope in ("classifier", "all"):
        model.lm_head = Fp8Linear(model.lm_head, fast)


def check_fp8(dev, fast):
    """Fp8Matmul's forward and both gradients against f32 on random operands of GPT-2's shapes: relative errors of a
    few tenths of a percent to a few percent come from the FP8 rounding; more means a wrong layout or scale."""
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(512, 768, device=dev, generator=gen, requires_grad=True)
    w = (torch.randn(3072, 768, device=dev, generator=gen) * 0.02).requires_grad_()
    g = torch.randn(512, 3072, device=dev, generator=gen) * 1e-3
    y = Fp8Matmul.apply(x.to(torch.bfloat16), w, fast)
    y.backward(g.to(torch.bfloat16))
    ref_y = x.detach() @ w.detach().t()
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
    errors = {"forward": rel(y, ref_y), "input gradient": rel(x.grad, g @ w.detach()),
              "weight gradient": rel(w.grad, g.t() @ x.detach())}
    print("fp8 check (relative error against f32): " + ", ".join(f"{k} {v:.4f}" for k, v in errors.items()),
          flush=True)
    bad = [k for k, v in errors.items() if not v < 0.1]
    if bad:
        raise SystemExit(f"pytorch_gpt2.py: the FP8 products are off ({', '.join(bad)}): not training with them")


# This model's parameter names -> Hugging Face GPT-2's (the names Loom's GPT-2 loader, load_hf_state_dict in
# src/nn/models.cc, looks up; it also accepts them with a "transformer." prefix and ignores names it does not know).
HF_RENAMES = [(r"^h\.(\d+)\.c_attn\.", r"h.\1.attn.c_attn."), (r"^h\.(\d+)\.attn_proj\.", r"h.\1.attn.c_proj."),
              (r"^h\.(\d+)\.c_fc\.", r"h.\1.mlp.c_fc."), (r"^h\.(\d+)\.mlp_proj\.", r"h.\1.mlp.c_proj.")]
HF_KEPT = re.compile(r"^(wte\.weight|wpe\.weight|ln_f\.(weight|bias)|h\.\d+\.ln_[12]\.(weight|bias))$")


def hf_conv1d(hf_name):
    """Loom's GPT2::is_conv1d: Hugging Face stores these as Conv1D, [in, out], the transpose of nn.Linear's."""
    return ".weight" in hf_name and any(k in hf_name for k in ("c_attn", "c_proj", "c_fc"))


def hf_gpt2_tensors(named):
    """(name, f32 numpy array) pairs of this model -> {Hugging Face name: array in Hugging Face's layout}.

    wte keeps all PADDED_VOCAB rows (Loom's loader takes up to its padded vocabulary, so the padding rows match too);
    lm_head is tied to wte and not written (named_parameters lists a shared tensor once)."""
    out = {}
    for name, a in named:
        hf = name
        for pat, rep in HF_RENAMES:
            hf = re.sub(pat, rep, hf)
        if hf == name and not HF_KEPT.match(name):
            raise ValueError(f"save-init: no Hugging Face name for parameter {name!r}")
        a = np.asarray(a, dtype=np.float32)
        if hf_conv1d(hf):
            assert a.ndim == 2, (name, a.shape)
            a = a.T
        assert hf not in out, hf
        out[hf] = np.ascontiguousarray(a, dtype="<f4")
    return out


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: f32 numpy array} as safetensors: u64 little-endian header length, a JSON header (dtype, shape,
    data_offsets per tensor, padded with spaces to 8 bytes), then the tensors' little-endian bytes in header order."""
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, a in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())


def save_init(model, path, args):
    tensors = hf_gpt2_tensors((n, p.detach().cpu().float().numpy()) for n, p in model.named_parameters())
    write_safetensors(path, tensors, {"format": "pt", "source": "tools/bench/pytorch_gpt2.py",
                                      "model": args.model, "seed": args.seed})
    n = sum(a.size for a in tensors.values())
    print(f"save-init: {len(tensors)} tensors, {n} parameters (f32, Hugging Face names) -> {path}", flush=True)


def read_shard(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520 and header[1] == 1, f"{path}: not an llm.c uint16 token shard"
    return np.fromfile(path, dtype=np.uint16, offset=1024, count=int(header[2])).astype(np.int64)


def make_optimizer(model, lr, fused=True):
    """AdamW as loom-train sets it up (fused on a GPU): weight decay 0.1 on matrices, none on vectors, betas
    0.9/0.95, eps 1e-8. pytorch_llama.py's too."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, **({"fused": True} if fused else {}))


def train_step(step_fn, model, opt, x, y, bf16, lr, device_type="cuda"):
    """One step as loom-train takes it: the loss (under bf16 autocast when asked), its backward, clipping at 1.0,
    AdamW at learning rate lr. Returns the loss and the gradient norm (tensors: nothing waits for the GPU here)."""
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        loss = step_fn(x, y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for g in opt.param_groups:
        g["lr"] = lr
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, norm


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
    ap.add_argument("--precision", choices=("bf16", "f32"), default="bf16",
                    help="bf16: autocast over f32 weights; f32: no autocast and no TF32 (a reference for noise)")
    ap.add_argument("--fp8", choices=("off", "classifier", "linear", "all"), default="off",
                    help="FP8 products, as loom-train's --fp8 (current scaling, e4m3 operands, e5m2 gradients)")
    ap.add_argument("--fp8-fast-accumulation", choices=("forward", "none"), default="forward",
                    help="with --fp8: the forward's products in the fast accumulator (forward, torchao's default) "
                         "or every product promoted (none)")
    ap.add_argument("--save-init", metavar="PATH",
                    help="write the initial weights (before any step) as f32 safetensors with Hugging Face GPT-2 "
                         "names, for loom-train --init-from")
    args = ap.parse_args()

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "bf16"
    torch.backends.cudnn.allow_tf32 = args.precision == "bf16"
    dev = f"cuda:{torch.cuda.current_device()}"
    B, T = args.batch_size, args.seq_len
    if args.data:
        tokens = torch.from_numpy(read_shard(args.data))
    else:
        tokens = torch.randint(0, VOCAB, (args.steps * B * T * world + 1,), generator=torch.Generator().manual_seed(args.seed))
    windows = (tokens.numel() - 1) // (B * T)
    assert windows > 0, f"{tokens.numel()} tokens is fewer than one batch of {B}x{T}"

    model = GPT2(*MODELS[args.model])
    if args.save_init:
        save_init(model, args.save_init, args)
    model = model.to(dev)
    if args.fp8 != "off":
        if args.precision != "bf16":
            ap.error("--fp8 trains under bf16 autocast (--precision bf16)")
        fast = args.fp8_fast_accumulation == "forward"
        check_fp8(dev, fast)
        use_fp8(model, args.fp8, fast)
    n_params = sum(p.numel() for p in model.parameters())
    n_layer, _, dim = MODELS[args.model]
    flops_per_token = 6 * n_params + 6 * n_layer * dim * T
    opt = make_optimizer(model, args.lr)
    wrapped = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        wrapped = DDP(model, device_ids=[torch.cuda.current_device()])
    step_fn = wrapped if args.no_compile else torch.compile(wrapped)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"pytorch {torch.__version__}: GPT-2 {args.model}, {n_params / 1e6:.1f}M parameters, batch {B}x{T}, "
          f"{args.steps} steps, {'random tokens' if not args.data else args.data}, "
          f"compile {'off' if args.no_compile else 'on'}, {args.precision}"
          + (f", fp8 {args.fp8} (fast accumulation: {args.fp8_fast_accumulation})" if args.fp8 != "off" else "")
          + (f", DDP over {world} GPUs" if world > 1 else ""), flush=True)

    times = []
    for step in range(args.steps):
        w = (step * world + rank) % windows
        chunk = tokens[w * B * T: w * B * T + B * T + 1]
        x = chunk[:-1].view(B, T).to(dev, non_blocking=True)
        y = chunk[1:].view(B, T).to(dev, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, norm = train_step(step_fn, model, opt, x, y, args.precision == "bf16", lr_at(step, args))
        loss_value = loss.item()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        say(f"step {step + 1:4d}/{args.steps} | loss {loss_value:.4f} | norm {norm.item():.4f} | "
            f"{dt * 1000:7.1f} ms | {B * T * world / dt:9.0f} tok/s", flush=True)

    timed = times[args.timing_warmup:] or times
    tok_s = B * T * world / statistics.median(timed)
    mfu = flops_per_token * tok_s / world / (args.peak_tflops * 1e12)
    peak = torch.cuda.max_memory_allocated() / 2**20
    say(f"RESULT pytorch tokens_per_s {tok_s:.0f} mfu {mfu * 100:.1f} peak_mem_mib {peak:.0f} "
        f"params {n_params} flops_per_token {flops_per_token} world {world}", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
