#!/usr/bin/env python3
"""LoRA fine-tuning with transformers + PEFT, the reference beside `loom-train --lora-rank`: a LLaMA-3 (random
weights in the shape of --model: llama3-8b by default, llama3-tiny for a smoke test; nothing is downloaded) with its
frozen base in bf16, PEFT adapters of rank R on q, k, v, o, gate, up and down (alpha 2R by default, dropout 0),
SDPA attention, gradient checkpointing, AdamW on the adapters (lr 2e-4, PyTorch's fused kernel), bf16 autocast, on an
llm.c token shard (or random tokens). Prints each step's loss, then tokens/s (median after --timing-warmup) and peak
memory in the RESULT line that tools/bench/lora_8b.sh reads.
    python3 tools/bench/peft_lora.py --model llama3-8b -b 2 -t 4096 --steps 20 --data shard.bin
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_gpt2 import read_shard  # noqa: E402

# transformers' LlamaConfig of Loom's llama_config: (layers, heads, kv heads, dim, ffn, vocab, rope scaling factor,
# tied embeddings).
SHAPES = {"llama3-8b": (32, 32, 8, 4096, 14336, 128256, 8.0, False),
          "llama3-1b": (16, 32, 8, 2048, 8192, 128256, 32.0, True),
          "llama3-tiny": (2, 4, 2, 64, 160, 512, 8.0, False)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batch-size", "-b", type=int, default=2)
    ap.add_argument("--seq-len", "-t", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=None, help="default: twice the rank")
    ap.add_argument("--data", help="llm.c token shard (default: random tokens)")
    ap.add_argument("--timing-warmup", type=int, default=5)
    ap.add_argument("--no-checkpointing", action="store_true", help="keep every activation (more memory)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    L, H, KV, C, F, V, factor, tied = SHAPES[args.model]
    cfg = LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                      num_key_value_heads=KV, max_position_embeddings=max(8192, args.seq_len), rms_norm_eps=1e-5,
                      rope_theta=500000.0, tie_word_embeddings=tied, attn_implementation="sdpa",
                      rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    dev = torch.device(args.device)
    with dev:
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    lora = LoraConfig(r=args.rank, lora_alpha=args.alpha or 2 * args.rank, lora_dropout=0.0, bias="none",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    for p in model.parameters():  # the adapters train in f32 (as Loom's), the frozen base stays bf16
        if p.requires_grad:
            p.data = p.data.float()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=2e-4, betas=(0.9, 0.95), weight_decay=0.0,
                            **({"fused": True} if dev.type == "cuda" else {}))
    B, T = args.batch_size, args.seq_len
    if args.data:
        tokens = torch.from_numpy(read_shard(args.data).astype("int64"))
    else:
        tokens = torch.randint(0, V, (args.steps * B * T + 1,), generator=torch.Generator().manual_seed(1))
    windows = (tokens.numel() - 1) // (B * T)
    n_train = sum(p.numel() for p in trainable)
    print(f"torch {torch.__version__}, transformers + peft: {args.model} LoRA rank {args.rank} on q,k,v,o,gate,up,down "
          f"({n_train / 1e6:.1f}M trainable), base bf16, batch {B}x{T}, checkpointing "
          f"{'off' if args.no_checkpointing else 'on'}", flush=True)
    cuda = dev.type == "cuda"
    times = []
    for step in range(args.steps):
        w = step % windows
        chunk = tokens[w * B * T: w * B * T + B * T + 1]
        x = chunk[:-1].view(B, T).to(dev)
        y = chunk[1:].view(B, T).to(dev)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, V), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        print(f"step {step + 1:4d}/{args.steps} | loss {value:.4f} | {dt * 1000:7.1f} ms | {B * T / dt:9.0f} tok/s",
              flush=True)
    timed = times[args.timing_warmup:] or times
    tok_s = B * T / statistics.median(timed)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0
    print(f"RESULT peft tokens_per_s {tok_s:.0f} peak_mem_mib {peak:.0f} trainable {n_train}", flush=True)


if __name__ == "__main__":
    main()
