#!/usr/bin/env python3
"""PyTorch reference for Loom's end-to-end benchmark: a LLaMA-3 trained the way loom-train trains it.

The model is Loom's (src/nn/models.cc, llama_config and class Llama) written out in PyTorch: RMSNorm (eps 1e-5),
grouped-query attention with q/k/v/o projections and no biases, rotary embedding with theta 500000 and the LLaMA-3.1
frequency scaling (llama3-1b: factor 32, low/high frequency factors 1 and 4, original context 8192), applied in the
"rotate_half" layout (pairs (i, i + D/2), as Hugging Face LLaMA and Loom's ops::rope), SwiGLU MLP, vocabulary 128256
unpadded (already a multiple of 128, Loom's padded_vocab_size for LLaMA), tied embeddings for llama3-1b. Trained as
tools/bench/pytorch_gpt2.py trains GPT-2: bf16 autocast over f32 master weights, torch.compile,
F.scaled_dot_product_attention (enable_gqa where this PyTorch has it, else keys and values repeated per query head),
fused AdamW (lr 6e-4, weight decay 0.1 on matrices including the embedding, betas 0.9/0.95, eps 1e-8), gradient
clipping at 1.0 and loom-train's schedule (linear warmup, cosine to 10%), on an llm.c token shard read in order.
Prints each step's loss, then tokens/s (median over the steps after --timing-warmup), MFU (6N + 6*L*C*T flops per
token, N every parameter with the tied embedding counted once, as loom-train counts it) and peak memory.
--save-init PATH writes the freshly initialized weights as f32 safetensors with Hugging Face LLaMA names (the
parameter names of this model, which are Loom's; no lm_head when tied), for loom-train --init-from.

  python3 tools/bench/pytorch_llama.py --model llama3-1b -b 4 -t 2048 --steps 30 --data shard.bin
  python3 tools/bench/pytorch_llama.py --model llama3-tiny -b 2 -t 64 --steps 2 --device cpu --dtype f32 --no-compile
With --model mixtral-1b (or mixtral-tiny) the MLPs are Loom's mixture of experts (Mixtral's layout, 8 experts,
top-2) run with torch._grouped_mm, rope theta 1e6, untied; MFU counts the active parameters.
"""
import argparse
import math
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_gpt2 import (lr_at, make_optimizer, read_shard, train_step,  # noqa: E402  (same data, schedule,
                          write_safetensors)                             # optimizer, step and file format)

# Loom's ModelConfig::from_name: (layers, heads, kv heads, dim, ffn, vocab, rope scaling (factor, low, high,
# original context) or None, tied embeddings, context). Norm eps 1e-5 and rope theta 500000 for all.
MODELS = {
    "llama3-1b": (16, 32, 8, 2048, 8192, 128256, (32.0, 1.0, 4.0, 8192), True, 8192),
    "llama3-3b": (28, 24, 8, 3072, 8192, 128256, (32.0, 1.0, 4.0, 8192), True, 8192),
    "llama3-8b": (32, 32, 8, 4096, 14336, 128256, (8.0, 1.0, 4.0, 8192), False, 8192),
    "llama3-tiny": (2, 4, 2, 64, 160, 512, (8.0, 1.0, 4.0, 64), False, 256),
    "mixtral-1b": (16, 32, 8, 2048, 4096, 32000, None, False, 4096),
    "mixtral-tiny": (2, 4, 2, 64, 128, 512, None, False, 256),
}
# Loom's mixtral_config: (experts, top k) of the models whose MLP is a mixture of experts (Mixtral's router: softmax
# over every expert, the top k renormalized; no auxiliary loss at these sizes), rope theta 1e6.
MOE = {"mixtral-1b": (8, 2), "mixtral-tiny": (4, 2)}
NORM_EPS, ROPE_THETA, MIXTRAL_ROPE_THETA = 1e-5, 500000.0, 1e6


def torch_at_least(major, minor):
    v = torch.__version__.split("+")[0].split(".")
    return (int(v[0]), int(v[1])) >= (major, minor)


SDPA_GQA = torch_at_least(2, 5)  # F.scaled_dot_product_attention(enable_gqa=...)


def causal_attention(q, k, v):
    """F.scaled_dot_product_attention(is_causal=True); written out for PyTorch before 2.0 (local CPU checks only)."""
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T, S = q.size(-2), k.size(-2)
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.size(-1))
    scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool, device=q.device).triu(S - T + 1), float("-inf"))
    return (torch.softmax(scores, dim=-1).to(v.dtype) @ v)


def rope_tables(T, D, theta, scaling):
    """Loom's ops::rope_tables: cos and sin [T, D/2] (f32), computed in f64 with the LLaMA-3.1 frequency scaling."""
    inv_freq = [theta ** (-2.0 * i / D) for i in range(D // 2)]
    if scaling:
        factor, low, high, original = scaling
        low_wavelen, high_wavelen = original / low, original / high
        for i, f in enumerate(inv_freq):
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                continue
            if wavelen > low_wavelen:
                inv_freq[i] = f / factor
            else:
                smooth = (original / wavelen - low) / (high - low)
                inv_freq[i] = (1 - smooth) * f / factor + smooth * f
    angles = torch.arange(T, dtype=torch.float64)[:, None] * torch.tensor(inv_freq, dtype=torch.float64)[None, :]
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(x, cos, sin):
    """x [B, H, T, D]; rotates the pairs (i, i + D/2) in f32 and rounds once to x's dtype, as Loom's rope kernels."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # in f32 (the residual stream is f32 under autocast); the next linear rounds to bf16
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim, n_head, n_kv_head, repeat_kv):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, dim // n_head
        self.repeat_kv = repeat_kv or not SDPA_GQA
        kv_dim = n_kv_head * self.head_dim
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        D = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, D).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_head == self.n_head:
            y = causal_attention(q, k, v)
        elif self.repeat_kv:  # query head h reads kv head h // (H / Hkv), as Loom's kernels and enable_gqa
            rep = self.n_head // self.n_kv_head
            y = causal_attention(q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """E SwiGLU experts as transformers 5 stores them (gate_up_proj [E, 2F, C], gate rows first; down_proj [E, C, F]),
    run over the rows grouped by expert with torch._grouped_mm (one call per projection, as Loom's grouped_gemm)."""

    def __init__(self, dim, hidden, n_experts):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, rows, offsets):
        if rows.is_cuda:
            gate_up = torch._grouped_mm(rows, self.gate_up_proj.to(rows.dtype).transpose(-2, -1), offs=offsets)
        else:  # a loop over the experts (CPU smoke tests: _grouped_mm is CUDA only)
            gate_up = torch.cat([rows[s:e] @ w.to(rows.dtype).t() for s, e, w in
                                 zip([0] + offsets[:-1].tolist(), offsets.tolist(), self.gate_up_proj)])
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.silu(gate) * up
        if rows.is_cuda:
            return torch._grouped_mm(h, self.down_proj.to(h.dtype).transpose(-2, -1), offs=offsets)
        return torch.cat([h[s:e] @ w.to(h.dtype).t() for s, e, w in
                          zip([0] + offsets[:-1].tolist(), offsets.tolist(), self.down_proj)])


class MoeMLP(nn.Module):
    """Loom's MoeMLP: a router (mlp.gate), softmax over the experts, the top k renormalized, the tokens' rows sorted
    by expert, the experts, and the weighted sum back per token."""

    def __init__(self, dim, hidden, n_experts, top_k):
        super().__init__()
        self.top_k, self.n_experts = top_k, n_experts
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = Experts(dim, hidden, n_experts)

    def forward(self, x):
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        order = experts.reshape(-1).argsort(stable=True)
        # histc rather than bincount: a fixed output shape, which torch.compile keeps in one graph
        counts = torch.histc(experts.reshape(-1).float(), bins=self.n_experts, min=0, max=self.n_experts - 1)
        offsets = counts.cumsum(0).to(torch.int32)
        amp = torch.is_autocast_enabled(x.device.type) if torch_at_least(2, 4) else torch.is_autocast_enabled()
        rows = flat.to(torch.bfloat16 if amp else flat.dtype)[order // self.top_k]
        out = self.experts(rows, offsets)
        combined = torch.empty_like(out)
        combined[order] = out
        combined = combined.view(B * T, self.top_k, C) * weights.unsqueeze(-1).to(out.dtype)
        return combined.sum(1).view(B, T, C)


class Block(nn.Module):
    def __init__(self, dim, n_head, n_kv_head, ffn, repeat_kv, moe=None):
        super().__init__()
        self.input_layernorm = RMSNorm(dim, NORM_EPS)
        self.self_attn = Attention(dim, n_head, n_kv_head, repeat_kv)
        self.post_attention_layernorm = RMSNorm(dim, NORM_EPS)
        self.mlp = MoeMLP(dim, ffn, *moe) if moe else MLP(dim, ffn)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):  # holds the "model." prefix of the Hugging Face names, as Loom's LlamaBody
    def __init__(self, n_layer, n_head, n_kv_head, dim, ffn, vocab, repeat_kv, moe=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_head, n_kv_head, ffn, repeat_kv, moe) for _ in range(n_layer))
        self.norm = RMSNorm(dim, NORM_EPS)


class Llama(nn.Module):
    """Parameter names are Hugging Face's LLaMA names, which are also Loom's (model.embed_tokens.weight,
    model.layers.N.self_attn.q_proj.weight, ..., model.norm.weight, lm_head.weight when untied)."""

    def __init__(self, name, repeat_kv=False):
        super().__init__()
        n_layer, n_head, n_kv_head, dim, ffn, vocab, scaling, tie, context = MODELS[name]
        self.n_layer, self.dim, self.vocab = n_layer, dim, vocab
        self.model = Body(n_layer, n_head, n_kv_head, dim, ffn, vocab, repeat_kv, MOE.get(name))
        self.lm_head = None if tie else nn.Linear(dim, vocab, bias=False)
        cos, sin = rope_tables(context, dim // n_head, MIXTRAL_ROPE_THETA if name in MOE else ROPE_THETA, scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        proj_std = 0.02 / math.sqrt(2 * n_layer)  # Loom's Llama::init_weights
        for pname, p in self.named_parameters():
            if "norm" in pname:
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, proj_std if ("o_proj" in pname or "down_proj" in pname) else 0.02)

    def forward(self, idx, targets):
        T = idx.size(1)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.model.embed_tokens(idx)
        for block in self.model.layers:
            x = block(x, cos, sin)
        x = self.model.norm(x)
        logits = self.lm_head(x) if self.lm_head is not None else F.linear(x, self.model.embed_tokens.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def save_init(model, path, args):
    """This model's parameters are already named and laid out as Hugging Face's LLaMA ([out, in] linears, q/k in
    the rotate_half order), which Loom's LanguageModel::load_hf_state_dict takes by name and shape."""
    tensors = {n: np.ascontiguousarray(p.detach().cpu().float().numpy(), dtype="<f4")
               for n, p in model.named_parameters()}
    write_safetensors(path, tensors, {"format": "pt", "source": "tools/bench/pytorch_llama.py",
                                      "model": args.model, "seed": args.seed})
    n = sum(a.size for a in tensors.values())
    print(f"save-init: {len(tensors)} tensors, {n} parameters (f32, Hugging Face names) -> {path}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-1b", choices=sorted(MODELS))
    ap.add_argument("--batch-size", "-b", type=int, default=4)
    ap.add_argument("--seq-len", "-t", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--data", help="llm.c uint16 token shard (default: random tokens)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=10, help="learning-rate warmup steps (loom-train's default)")
    ap.add_argument("--timing-warmup", type=int, default=5, help="steps left out of the tokens/s median")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--repeat-kv", action="store_true",
                    help="repeat keys/values per query head before SDPA instead of enable_gqa (lets SDPA pick "
                         "backends that do not take GQA)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a local smoke test")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"], help="bf16 autocast (default) or plain f32")
    ap.add_argument("--save-init", metavar="PATH",
                    help="write the initial weights (before any step) as f32 safetensors with Hugging Face LLaMA "
                         "names, for loom-train --init-from")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = args.device
    cuda = dev.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    B, T = args.batch_size, args.seq_len
    n_layer, _, _, dim, _, vocab, _, tie, context = MODELS[args.model]
    assert T <= context, f"--seq-len {T} exceeds {args.model}'s context of {context}"
    if args.data:
        tokens = torch.from_numpy(read_shard(args.data))
        assert int(tokens.max()) < vocab, f"{args.data}: token {int(tokens.max())} >= {args.model}'s vocabulary {vocab}"
    else:
        tokens = torch.randint(0, vocab, (args.steps * B * T + 1,), generator=torch.Generator().manual_seed(args.seed))
    windows = (tokens.numel() - 1) // (B * T)
    assert windows > 0, f"{tokens.numel()} tokens is fewer than one batch of {B}x{T}"

    model = Llama(args.model, repeat_kv=args.repeat_kv)
    if args.save_init:
        save_init(model, args.save_init, args)
    model = model.to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    # Active parameters (what a token's products touch, as loom-train counts them): all but the experts it skips.
    n_experts, top_k = MOE.get(args.model, (1, 1))
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n_active = n_params - expert_params * (n_experts - top_k) // n_experts
    flops_per_token = 6 * n_active + 6 * n_layer * dim * T
    opt = make_optimizer(model, args.lr, fused=cuda)
    step_fn = model if args.no_compile else torch.compile(model)
    attn = ("no GQA" if model.model.layers[0].self_attn.n_kv_head == model.model.layers[0].self_attn.n_head
            else "kv repeated" if model.model.layers[0].self_attn.repeat_kv else "SDPA enable_gqa")
    print(f"pytorch {torch.__version__}: LLaMA {args.model}, {n_params / 1e6:.1f}M parameters "
          f"({n_active / 1e6:.1f}M active) "
          f"({'tied' if tie else 'untied'} embeddings), batch {B}x{T}, {args.steps} steps, "
          f"{'random tokens' if not args.data else args.data}, {args.dtype} on {dev}, attention {attn}, "
          f"compile {'off' if args.no_compile else 'on'}", flush=True)

    times = []
    for step in range(args.steps):
        w = step % windows
        chunk = tokens[w * B * T: w * B * T + B * T + 1]
        x = chunk[:-1].view(B, T).to(dev, non_blocking=True)
        y = chunk[1:].view(B, T).to(dev, non_blocking=True)
        sync()
        t0 = time.perf_counter()
        loss, norm = train_step(step_fn, model, opt, x, y, args.dtype == "bf16", lr_at(step, args),
                                "cuda" if cuda else "cpu")
        loss_value = loss.item()
        sync()
        dt = time.perf_counter() - t0
        times.append(dt)
        print(f"step {step + 1:4d}/{args.steps} | loss {loss_value:.4f} | norm {norm.item():.4f} | "
              f"{dt * 1000:7.1f} ms | {B * T / dt:9.0f} tok/s", flush=True)

    timed = times[args.timing_warmup:] or times
    tok_s = B * T / statistics.median(timed)
    mfu = flops_per_token * tok_s / (args.peak_tflops * 1e12)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0
    print(f"RESULT pytorch tokens_per_s {tok_s:.0f} mfu {mfu * 100:.1f} peak_mem_mib {peak:.0f} "
          f"params {n_params} flops_per_token {flops_per_token}", flush=True)


if __name__ == "__main__":
    main()
