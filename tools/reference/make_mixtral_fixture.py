#!/usr/bin/env python3
"""Writes the Mixtral reference fixture: transformers' MixtralForCausalLM at a tiny size, in float64.

Run where PyTorch and transformers are installed (the device machine):
    python3 tools/reference/make_mixtral_fixture.py tests/fixtures
It writes OUT_DIR/mixtral_tiny.safetensors ("param.<name>" the initial weights in Mixtral-8x7B's per-expert layout,
block_sparse_moe.experts.N.w1|w2|w3, whatever layout the installed transformers keeps; "logits", "x", "y") and
OUT_DIR/mixtral_tiny.json (Loom's config, the cross-entropy "loss", the router "aux_loss" as transformers'
load_balancing_loss_func computes it over every layer, and "loss_with_aux" = loss + router_aux_loss_coef * aux_loss).
tests/moe_fixture_test.cc loads them (and skips while they are absent).
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM

B, T = 2, 16


def per_expert(sd, n_layer, n_experts):
    """Mixtral-8x7B's names from transformers 5's fused ones (transformers 4 already uses them)."""
    out = {}
    for k, v in sd.items():
        if ".mlp.experts.gate_up_proj" in k:
            p = k.split(".mlp.")[0]
            F = v.shape[1] // 2
            for e in range(n_experts):
                out[f"{p}.block_sparse_moe.experts.{e}.w1.weight"] = v[e, :F]
                out[f"{p}.block_sparse_moe.experts.{e}.w3.weight"] = v[e, F:]
        elif ".mlp.experts.down_proj" in k:
            p = k.split(".mlp.")[0]
            for e in range(n_experts):
                out[f"{p}.block_sparse_moe.experts.{e}.w2.weight"] = v[e]
        elif k.endswith(".mlp.gate.weight"):
            out[k.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")] = v
        else:
            out[k] = v
    return out


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
    os.makedirs(out_dir, exist_ok=True)
    loom = {"family": "llama", "vocab_size": 256, "padded_vocab_size": 256, "max_seq_len": 64, "n_layer": 2,
            "n_head": 4, "n_kv_head": 2, "n_embd": 64, "ffn_hidden": 96, "norm_eps": 1e-5, "rope_theta": 1e6,
            "tie_embeddings": False, "num_experts": 4, "experts_per_token": 2, "router_aux_loss_coef": 0.02}
    hf_cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           rms_norm_eps=1e-5, rope_theta=1e6, num_local_experts=4, num_experts_per_tok=2,
                           router_aux_loss_coef=0.02, router_jitter_noise=0.0, sliding_window=None,
                           tie_word_embeddings=False, attn_implementation="eager")
    # Newer transformers run the experts through torch._grouped_mm, which has no float64: ask for the per-expert loop.
    if hasattr(hf_cfg, "_experts_implementation"):
        hf_cfg._experts_implementation = "eager"
    torch.manual_seed(1234)
    model = MixtralForCausalLM(hf_cfg).double().eval()
    if hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = "eager"
    with torch.no_grad():  # weights that move the logits, rounded to f32 (Loom loads f32 weights)
        for n, p in model.named_parameters():
            p.copy_((torch.randn_like(p) * (0.08 if p.dim() > 1 else 0.1) + (1.0 if "norm" in n else 0.0))
                    .float().double())
    torch.manual_seed(99)
    x = torch.randint(0, 256, (B, T))
    y = torch.randint(0, 256, (B, T))
    with torch.no_grad():
        out = model(x, labels=y, output_router_logits=True)
        ce = model(x, labels=y).loss
    logits = out.logits
    # transformers shifts labels inside; Loom's loss takes the targets as given, so the fixture's "loss" is the plain
    # cross entropy of logits against y.
    loss = torch.nn.functional.cross_entropy(logits.view(-1, 256), y.view(-1)).item()
    aux = (out.loss - ce).item() / hf_cfg.router_aux_loss_coef
    sd = per_expert({k: v.detach().float().contiguous() for k, v in model.state_dict().items()}, 2, 4)
    tensors = {f"param.{k}": v.contiguous() for k, v in sd.items()}
    tensors["logits"] = logits.detach().contiguous()
    tensors["x"], tensors["y"] = x.contiguous(), y.contiguous()
    save_file(tensors, os.path.join(out_dir, "mixtral_tiny.safetensors"))
    import transformers
    meta = {"config": loom, "batch": B, "seq_len": T, "loss": loss, "aux_loss": aux,
            "loss_with_aux": loss + hf_cfg.router_aux_loss_coef * aux,
            "generator": f"torch {torch.__version__}, transformers {transformers.__version__}, float64"}
    with open(os.path.join(out_dir, "mixtral_tiny.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"mixtral_tiny: loss {loss:.6f}, router aux loss {aux:.6f}")


if __name__ == "__main__":
    main()
