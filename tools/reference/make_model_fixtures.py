#!/usr/bin/env python3
"""Writes PyTorch reference fixtures for Loom's tiny GPT-2 and LLaMA tests.

Run on a machine with PyTorch (the device machine):  python3 tools/reference/make_model_fixtures.py OUT_DIR
For each model it writes OUT_DIR/<name>.safetensors (initial weights under "param.<HF name>", gradients of the first
loss under "grad.<HF name>", "logits", "x", "y") and OUT_DIR/<name>.json (config, loss, the losses of 3 AdamW steps).

The models are written out here in plain PyTorch with Hugging Face's parameter names and layouts (GPT-2's
projections are Conv1D, [in, out]); when `transformers` is importable the GPT-2 logits are also checked against
GPT2LMHeadModel loaded with the same weights, so the fixture pins Hugging Face's semantics.
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

B, T = 2, 16
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class GPT2(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        C, V = c["n_embd"], c["vocab_size"]
        p = {}
        p["wte.weight"] = torch.randn(V, C) * 0.02
        p["wpe.weight"] = torch.randn(c["max_seq_len"], C) * 0.02
        for i in range(c["n_layer"]):
            h = f"h.{i}."
            p[h + "ln_1.weight"] = 1 + 0.1 * torch.randn(C)
            p[h + "ln_1.bias"] = 0.1 * torch.randn(C)
            p[h + "attn.c_attn.weight"] = torch.randn(C, 3 * C) * 0.02  # Conv1D: [in, out]
            p[h + "attn.c_attn.bias"] = 0.02 * torch.randn(3 * C)
            p[h + "attn.c_proj.weight"] = torch.randn(C, C) * 0.02
            p[h + "attn.c_proj.bias"] = 0.02 * torch.randn(C)
            p[h + "ln_2.weight"] = 1 + 0.1 * torch.randn(C)
            p[h + "ln_2.bias"] = 0.1 * torch.randn(C)
            p[h + "mlp.c_fc.weight"] = torch.randn(C, 4 * C) * 0.02
            p[h + "mlp.c_fc.bias"] = 0.02 * torch.randn(4 * C)
            p[h + "mlp.c_proj.weight"] = torch.randn(4 * C, C) * 0.02
            p[h + "mlp.c_proj.bias"] = 0.02 * torch.randn(C)
        p["ln_f.weight"] = 1 + 0.1 * torch.randn(C)
        p["ln_f.bias"] = 0.1 * torch.randn(C)
        self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v) for k, v in p.items()})

    def named(self):
        return {k.replace("__", "."): v for k, v in self.p.items()}

    def forward(self, idx):
        c, w = self.c, self.named()
        C, H = c["n_embd"], c["n_head"]
        Tn = idx.shape[1]
        x = w["wte.weight"][idx] + w["wpe.weight"][:Tn]
        for i in range(c["n_layer"]):
            h = f"h.{i}."
            a = F.layer_norm(x, (C,), w[h + "ln_1.weight"], w[h + "ln_1.bias"], 1e-5)
            qkv = a @ w[h + "attn.c_attn.weight"] + w[h + "attn.c_attn.bias"]
            q, k, v = qkv.split(C, dim=2)
            q, k, v = [t.view(B, Tn, H, C // H).transpose(1, 2) for t in (q, k, v)]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(B, Tn, C)
            x = x + y @ w[h + "attn.c_proj.weight"] + w[h + "attn.c_proj.bias"]
            m = F.layer_norm(x, (C,), w[h + "ln_2.weight"], w[h + "ln_2.bias"], 1e-5)
            m = gelu_tanh(m @ w[h + "mlp.c_fc.weight"] + w[h + "mlp.c_fc.bias"])
            x = x + m @ w[h + "mlp.c_proj.weight"] + w[h + "mlp.c_proj.bias"]
        x = F.layer_norm(x, (C,), w["ln_f.weight"], w["ln_f.bias"], 1e-5)
        return x @ w["wte.weight"].t()


def llama3_inv_freq(c):
    D = c["n_embd"] // c["n_head"]
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    s = c.get("rope_scaling")
    if s:
        factor, lo, hi, orig = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_positions"]
        low_wavelen, high_wavelen = orig / lo, orig / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (orig / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    return inv


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Llama(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        C, V, F_ = c["n_embd"], c["vocab_size"], c["ffn_hidden"]
        D = C // c["n_head"]
        kv = c["n_kv_head"] * D
        p = {"model.embed_tokens.weight": torch.randn(V, C) * 0.02}
        for i in range(c["n_layer"]):
            h = f"model.layers.{i}."
            p[h + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(C)
            p[h + "self_attn.q_proj.weight"] = torch.randn(C, C) * 0.05
            p[h + "self_attn.k_proj.weight"] = torch.randn(kv, C) * 0.05
            p[h + "self_attn.v_proj.weight"] = torch.randn(kv, C) * 0.05
            p[h + "self_attn.o_proj.weight"] = torch.randn(C, C) * 0.05
            p[h + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(C)
            p[h + "mlp.gate_proj.weight"] = torch.randn(F_, C) * 0.05
            p[h + "mlp.up_proj.weight"] = torch.randn(F_, C) * 0.05
            p[h + "mlp.down_proj.weight"] = torch.randn(C, F_) * 0.05
        p["model.norm.weight"] = 1 + 0.1 * torch.randn(C)
        p["lm_head.weight"] = torch.randn(V, C) * 0.02
        self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v) for k, v in p.items()})

    def named(self):
        return {k.replace("__", "."): v for k, v in self.p.items()}

    def forward(self, idx):
        c, w = self.c, self.named()
        C, H, Hkv = c["n_embd"], c["n_head"], c["n_kv_head"]
        D, Tn = C // H, idx.shape[1]
        inv = llama3_inv_freq(c)
        ang = torch.outer(torch.arange(Tn, dtype=torch.float64), inv)
        emb = torch.cat((ang, ang), dim=-1)
        cos, sin = emb.cos().float(), emb.sin().float()
        rms = lambda x, wt: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c["norm_eps"]) * wt
        x = w["model.embed_tokens.weight"][idx]
        for i in range(c["n_layer"]):
            h = f"model.layers.{i}."
            a = rms(x, w[h + "input_layernorm.weight"])
            q = (a @ w[h + "self_attn.q_proj.weight"].t()).view(B, Tn, H, D).transpose(1, 2)
            k = (a @ w[h + "self_attn.k_proj.weight"].t()).view(B, Tn, Hkv, D).transpose(1, 2)
            v = (a @ w[h + "self_attn.v_proj.weight"].t()).view(B, Tn, Hkv, D).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, Tn, C)
            x = x + y @ w[h + "self_attn.o_proj.weight"].t()
            m = rms(x, w[h + "post_attention_layernorm.weight"])
            m = F.silu(m @ w[h + "mlp.gate_proj.weight"].t()) * (m @ w[h + "mlp.up_proj.weight"].t())
            x = x + m @ w[h + "mlp.down_proj.weight"].t()
        x = rms(x, w["model.norm.weight"])
        return x @ w["lm_head.weight"].t()


def check_against_transformers(model, c, idx, logits):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except Exception as e:  # noqa: BLE001
        print(f"transformers not available ({e}); skipping the Hugging Face cross-check")
        return
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=c["vocab_size"], n_positions=c["max_seq_len"], n_embd=c["n_embd"],
                                    n_layer=c["n_layer"], n_head=c["n_head"], resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0, activation_function="gelu_new"))
    sd = {k: v.detach().clone() for k, v in model.named().items()}
    missing, unexpected = hf.transformer.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not m.endswith("attn.bias") and not m.endswith("masked_bias")]
    assert not missing and not unexpected, (missing, unexpected)
    hf.eval()
    with torch.no_grad():
        ref = hf(idx).logits
    err = (ref - logits).abs().max().item()
    print(f"GPT-2 fixture vs transformers GPT2LMHeadModel: max |logits diff| = {err:.3e}")
    assert err < 1e-4, err


def make(name, model_cls, c, out_dir):
    torch.manual_seed(1234)
    model = model_cls(c).double()  # float64 reference; saved as float32 inputs but float64 results
    torch.manual_seed(99)
    x = torch.randint(0, c["vocab_size"], (B, T))
    y = torch.randint(0, c["vocab_size"], (B, T))
    # Round the weights to f32 first so Loom (which loads f32 weights) starts from exactly these values.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.float().double())
    params0 = {k: v.detach().float().clone() for k, v in model.named().items()}
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    loss.backward()
    grads = {k: v.grad.detach().clone() for k, v in model.named().items()}
    if name.startswith("gpt2"):
        check_against_transformers(model.float(), c, x, logits.float())
        model.double()
    decay = [p for k, p in model.named().items() if p.dim() >= 2]
    no_decay = [p for k, p in model.named().items() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    losses = []
    for step in range(3):
        opt.zero_grad()
        lg = model(x)
        l = F.cross_entropy(lg.view(-1, lg.size(-1)), y.view(-1))
        losses.append(l.item())
        l.backward()
        opt.step()
    tensors = {f"param.{k}": v.contiguous() for k, v in params0.items()}
    tensors.update({f"grad.{k}": v.contiguous() for k, v in grads.items()})
    tensors["logits"] = logits.detach().contiguous()
    tensors["x"], tensors["y"] = x.contiguous(), y.contiguous()
    save_file(tensors, os.path.join(out_dir, name + ".safetensors"))
    meta = {"config": c, "batch": B, "seq_len": T, "loss": loss.item(), "adamw": {"lr": LR, "betas": BETAS,
            "eps": EPS, "weight_decay": WD, "decay": "params with dim >= 2"}, "adamw_losses": losses,
            "generator": f"torch {torch.__version__}, float64"}
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"{name}: loss {loss.item():.6f}, AdamW losses {losses}")


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
    os.makedirs(out_dir, exist_ok=True)
    gpt2 = {"family": "gpt2", "vocab_size": 200, "padded_vocab_size": 256, "max_seq_len": 32, "n_layer": 2,
            "n_head": 4, "n_kv_head": 4, "n_embd": 64, "ffn_hidden": 256, "norm_eps": 1e-5, "tie_embeddings": True}
    llama = {"family": "llama", "vocab_size": 256, "padded_vocab_size": 256, "max_seq_len": 32, "n_layer": 2,
             "n_head": 4, "n_kv_head": 2, "n_embd": 64, "ffn_hidden": 160, "norm_eps": 1e-5, "rope_theta": 10000.0,
             "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_positions": 16},
             "tie_embeddings": False}
    make("gpt2_tiny", GPT2, gpt2, out_dir)
    make("llama_tiny", Llama, llama, out_dir)


if __name__ == "__main__":
    main()
