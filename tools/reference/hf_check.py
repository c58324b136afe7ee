#!/usr/bin/env python3
"""A GPU-machine check of Loom's Hugging Face export, import and loom-generate against transformers.

Needs torch, transformers and safetensors (the GPU machine has them; this repository's CI does not) and a Loom build
(loom-train, loom-export, loom-generate). Run by tools/device/hf_check.sh:

    python3 tools/reference/hf_check.py --bin build-dev --work /tmp/hf_check [--devices cpu,cuda] [--out DIR]

(a) Out: a tiny GPT-2 and a tiny LLaMA trained 2 steps by loom-train, exported with `loom-export --hf`, load with
    from_pretrained; their logits equal Loom's (loom-generate --dump-logits) to --tol relative (f32), and the bf16
    export loads as bfloat16.
(b) Greedy: transformers' generate and loom-generate --greedy give the same tokens on the same weights (and, for
    GPT-2, the same text through the exported tokenizer files).
(c) In: random LLaMAs built by transformers (2 layers, head_dim != hidden/heads, vocab 1001, rope_scaling llama3,
    tied and untied) and a random GPT-2, saved sharded (model.safetensors.index.json): Loom loads them with equal
    logits and greedy tokens, and loom-train --init-from DIR starts from them.
(d) PEFT: a LoRA run of llama3-tiny started from an exported base directory; its `loom-export --peft` directory
    loads with peft's PeftModel onto that base, giving the LoRA checkpoint's logits, as does its `--merge-lora` export.
(a) covers gpt2-tiny, llama3-tiny and mixtral-tiny.

Relative error = max |loom - hf| / max |hf| over all positions and the real vocabulary. Prints a PASS/FAIL table and
writes hf_check.json (to --out when given); exits 1 when a check fails.
"""
import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time

RESULTS = []


def record(name, ok, detail):
    RESULTS.append({"check": name, "ok": bool(ok), "detail": detail})
    print(("PASS " if ok else "FAIL ") + name + ": " + detail, flush=True)


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError("command failed (%d): %s\n%s%s" % (p.returncode, " ".join(cmd), p.stdout[-3000:],
                                                               p.stderr[-3000:]))
    return p


def write_shard(path, tokens):
    """An llm.c token shard: 256 int32 header (magic 20240520, version 1, count), uint16 tokens."""
    header = [0] * 256
    header[0], header[1], header[2] = 20240520, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack("<%dH" % len(tokens), *tokens))


def rel_err(a, b):
    import torch
    a = a.double()
    b = b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def loom_logits(args, model_path, prompt, device):
    from safetensors.torch import load_file
    out = os.path.join(args.work, "logits_%d.safetensors" % random.randrange(1 << 30))
    run([os.path.join(args.bin, "loom-generate"), "-m", model_path, "--prompt-tokens", ",".join(map(str, prompt)),
         "-n", "0", "--device", device, "--dump-logits", out])
    t = load_file(out)["logits"]
    os.remove(out)
    return t


def loom_greedy(args, model_path, prompt, n, device):
    p = run([os.path.join(args.bin, "loom-generate"), "-m", model_path, "--prompt-tokens",
             ",".join(map(str, prompt)), "-n", str(n), "--greedy", "--device", device])
    return [int(x) for x in p.stdout.split()]


def hf_model(path, dtype=None):
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype or torch.float32, attn_implementation="eager")
    m.eval()
    return m


def hf_logits(model, prompt, vocab):
    import torch
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, :, :vocab].float()


def hf_greedy(model, prompt, n):
    import torch
    model.generation_config.eos_token_id = None  # loom-generate does not stop at an end token
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, num_beams=1)
    return out[0, len(prompt):].tolist()


def compare_model(args, tag, loom_path, hf, vocab, ctx):
    """Logits and greedy tokens of Loom (every device) against transformers (CPU, f32)."""
    rng = random.Random(args.seed)
    prompt = [rng.randrange(vocab) for _ in range(min(24, ctx // 2))]
    ref = hf_logits(hf, prompt, vocab)
    for device in args.devices:
        try:
            err = rel_err(loom_logits(args, loom_path, prompt, device), ref)
            record("%s logits (loom %s f32 vs transformers)" % (tag, device), err <= args.tol,
                   "rel err %.2e (tol %.0e)" % (err, args.tol))
        except Exception as e:  # noqa: BLE001 (one failed check must not stop the others)
            record("%s logits (loom %s)" % (tag, device), False, str(e).splitlines()[0][:300])
    n = min(args.new_tokens, ctx - len(prompt) - 1)
    want = hf_greedy(hf, prompt, n)
    for device in args.devices:
        try:
            got = loom_greedy(args, loom_path, prompt, n, device)
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
            record("%s greedy %d tokens (loom %s vs transformers generate)" % (tag, n, device), got == want,
                   "equal" if got == want else "first difference at %s: loom %s, transformers %s" % (
                       first, got[first:first + 5] if first is not None else got, want[first:first + 5]
                       if first is not None else want))
        except Exception as e:  # noqa: BLE001
            record("%s greedy (loom %s)" % (tag, device), False, str(e).splitlines()[0][:300])


def check_out(args):
    """(a) and (b): models trained by Loom, exported, loaded by transformers."""
    import torch
    rng = random.Random(args.seed)
    for tag, model, vocab in (("gpt2-tiny", "gpt2-tiny", 50257), ("llama3-tiny", "llama3-tiny", 512),
                              ("mixtral-tiny", "mixtral-tiny", 512)):
        work = os.path.join(args.work, tag)
        shutil.rmtree(work, ignore_errors=True)  # loom-train refuses to write over an earlier run's checkpoints
        os.makedirs(work)
        shard = os.path.join(work, "train_000000.bin")
        write_shard(shard, [rng.randrange(vocab) for _ in range(8192)])
        try:
            run([os.path.join(args.bin, "loom-train"), "--model", model, "--train-data", shard, "-b", "4", "-t", "64",
                 "--steps", "2", "--warmup", "0", "--lr", "1e-3", "--sample-tokens", "0", "--device", "cpu",
                 "--checkpoint-dir", os.path.join(work, "ckpt")])
            ckpt = os.path.join(work, "ckpt", "step_000002.safetensors")
            hf_dir = os.path.join(work, "hf")
            exp = run([os.path.join(args.bin, "loom-export"), "--checkpoint", ckpt, "--hf", hf_dir, "--force",
                       "--max-shard-size", "100KB"])
            print(exp.stdout.strip())
            hf = hf_model(hf_dir)
            record("%s export loads with from_pretrained (sharded)" % tag,
                   os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json")),
                   "%s, %d parameters" % (type(hf).__name__, sum(p.numel() for p in hf.parameters())))
        except Exception as e:  # noqa: BLE001
            record("%s export" % tag, False, str(e).splitlines()[0][:300])
            continue
        ctx = hf.config.max_position_embeddings if hasattr(hf.config, "max_position_embeddings") else 256
        compare_model(args, tag + " export", ckpt, hf, vocab, ctx)
        if tag.startswith("gpt2"):
            try:  # the exported tokenizer files: same text as loom-generate's own tokenizer path
                from transformers import AutoTokenizer
                tok = AutoTokenizer.from_pretrained(hf_dir)
                text = "ROMEO: Is the day so young?"
                ids = tok(text)["input_ids"]
                want = tok.decode(ids + hf_greedy(hf, ids, 16))
                got = run([os.path.join(args.bin, "loom-generate"), "-m", hf_dir, "--prompt", text, "-n", "16",
                           "--greedy"]).stdout
                got = got[:-1] if got.endswith("\n") else got  # the newline loom-generate ends with
                record("gpt2-tiny text greedy through the exported tokenizer", got == want,
                       "equal" if got == want else "loom %r vs transformers %r" % (got[:120], want[:120]))
            except Exception as e:  # noqa: BLE001
                record("gpt2-tiny tokenizer export", False, str(e).splitlines()[0][:300])
        try:  # the bf16 export loads as bfloat16, close to the f32 model
            bf_dir = os.path.join(work, "hf_bf16")
            run([os.path.join(args.bin, "loom-export"), "--checkpoint", ckpt, "--hf", bf_dir, "--force", "--dtype",
                 "bf16"])
            hb = hf_model(bf_dir, torch.bfloat16)
            prompt = [rng.randrange(vocab) for _ in range(16)]
            err = rel_err(hf_logits(hb, prompt, vocab), hf_logits(hf, prompt, vocab))
            ok = next(hb.parameters()).dtype == torch.bfloat16 and err < 5e-2
            record("%s bf16 export loads as bfloat16" % tag, ok, "rel err vs f32 %.2e (tol 5e-2)" % err)
        except Exception as e:  # noqa: BLE001
            record("%s bf16 export" % tag, False, str(e).splitlines()[0][:300])


def check_peft(args):
    """(d) A LoRA run of llama3-tiny from an exported base directory: its `loom-export --peft` directory loaded by
    peft onto that base gives loom-generate's logits of the LoRA checkpoint, and so does `--merge-lora --hf`."""
    rng = random.Random(args.seed + 1)
    vocab = 512
    work = os.path.join(args.work, "lora")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    shard = os.path.join(work, "train_000000.bin")
    write_shard(shard, [rng.randrange(vocab) for _ in range(8192)])
    try:
        from peft import PeftModel
        common = ["--train-data", shard, "-b", "4", "-t", "64", "--warmup", "0", "--sample-tokens", "0", "--device",
                  "cpu"]
        # The base: 2 steps of llama3-tiny, exported; the LoRA run starts from that directory (the base frozen).
        run([os.path.join(args.bin, "loom-train"), "--model", "llama3-tiny", "--steps", "2", "--lr", "1e-3"] +
            common + ["--checkpoint-dir", os.path.join(work, "base_ckpt")])
        base_dir, adapter_dir, merged_dir = (os.path.join(work, d) for d in ("base", "adapter", "merged"))
        run([os.path.join(args.bin, "loom-export"), "--checkpoint",
             os.path.join(work, "base_ckpt", "step_000002.safetensors"), "--hf", base_dir, "--force"])
        run([os.path.join(args.bin, "loom-train"), "--init-from", base_dir, "--steps", "3", "--lr", "1e-2",
             "--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,k,v,o,gate,up,down"] + common +
            ["--checkpoint-dir", os.path.join(work, "ckpt")])
        ckpt = os.path.join(work, "ckpt", "step_000003.safetensors")
        run([os.path.join(args.bin, "loom-export"), "--checkpoint", ckpt, "--peft", adapter_dir, "--force"])
        run([os.path.join(args.bin, "loom-export"), "--checkpoint", ckpt, "--merge-lora", "--hf", merged_dir,
             "--force"])
        prompt = [rng.randrange(vocab) for _ in range(24)]
        peft_model = PeftModel.from_pretrained(hf_model(base_dir), adapter_dir)
        peft_model.eval()
        want = hf_logits(peft_model, prompt, vocab)
        base = hf_logits(hf_model(base_dir), prompt, vocab)
        record("llama3-tiny LoRA: the adapters change the logits", rel_err(want, base) > 1e-4,
               "rel change %.2e" % rel_err(want, base))
        merged = hf_logits(hf_model(merged_dir), prompt, vocab)
        err = rel_err(merged, want)
        record("llama3-tiny LoRA: --merge-lora export vs peft on the base", err <= args.tol,
               "rel err %.2e (tol %.0e)" % (err, args.tol))
        for device in args.devices:
            err = rel_err(loom_logits(args, ckpt, prompt, device), want)
            record("llama3-tiny LoRA checkpoint (loom %s) vs peft on the base" % device, err <= args.tol,
                   "rel err %.2e (tol %.0e)" % (err, args.tol))
    except Exception as e:  # noqa: BLE001
        record("llama3-tiny LoRA and PEFT", False, str(e).splitlines()[0][:300])


def check_in(args):
    """(c): random models built and saved (sharded) by transformers, loaded by Loom."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(args.seed)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    models = []
    for tie in (False, True):
        cfg = LlamaConfig(vocab_size=1001, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=40, max_position_embeddings=256,
                          rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=rope, tie_word_embeddings=tie,
                          bos_token_id=0, eos_token_id=1)
        models.append(("hf-llama%s" % ("-tied" if tie else ""), LlamaForCausalLM(cfg), 1001, 256))
    g = GPT2Config(vocab_size=1001, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=1)
    models.append(("hf-gpt2", GPT2LMHeadModel(g), 1001, 128))
    for tag, m, vocab, ctx in models:
        d = os.path.join(args.work, tag)
        shutil.rmtree(d, ignore_errors=True)
        try:
            with torch.no_grad():  # weights away from the init's exact zeros and ones
                for p in m.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
            m.eval()
            m.save_pretrained(d, max_shard_size="200KB", safe_serialization=True)
            sharded = os.path.exists(os.path.join(d, "model.safetensors.index.json"))
            record("%s saved sharded by transformers" % tag, sharded,
                   "%d files" % len([f for f in os.listdir(d) if f.endswith(".safetensors")]))
            hf = hf_model(d)
        except Exception as e:  # noqa: BLE001
            record("%s save" % tag, False, str(e).splitlines()[0][:300])
            continue
        compare_model(args, tag, d, hf, vocab, ctx)
        try:
            shard = os.path.join(args.work, tag + "_train.bin")
            write_shard(shard, [random.randrange(vocab) for _ in range(4096)])
            p = run([os.path.join(args.bin, "loom-train"), "--init-from", d, "--train-data", shard, "-b", "2", "-t",
                     "32", "--steps", "1", "--warmup", "0", "--sample-tokens", "0", "--device", args.devices[-1]])
            line = [l for l in p.stdout.splitlines() if l.startswith("step")]
            record("%s loom-train --init-from DIR" % tag, True, line[-1][:100] if line else "ran")
        except Exception as e:  # noqa: BLE001
            record("%s loom-train --init-from DIR" % tag, False, str(e).splitlines()[0][:300])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="the build directory with loom-train, loom-export, loom-generate")
    ap.add_argument("--work", default="/tmp/hf_check")
    ap.add_argument("--devices", default="cpu,cuda", help="devices loom-generate runs on")
    ap.add_argument("--tol", type=float, default=1e-5, help="relative logits tolerance (f32)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.devices = args.devices.split(",")
    os.makedirs(args.work, exist_ok=True)
    try:
        import torch
        import transformers
        import safetensors  # noqa: F401
    except ImportError as e:
        print("hf_check: needs torch, transformers and safetensors: %s" % e)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    print("hf_check: torch %s, transformers %s, loom %s, devices %s" % (torch.__version__, transformers.__version__,
                                                                     args.bin, ",".join(args.devices)))
    t0 = time.time()
    check_out(args)
    check_peft(args)
    check_in(args)
    print("\n%-72s %s" % ("check", "result"))
    for r in RESULTS:
        print("%-72s %s  %s" % (r["check"][:72], "PASS" if r["ok"] else "FAIL", r["detail"]))
    failed = sum(not r["ok"] for r in RESULTS)
    print("\nhf_check: %d checks, %d failed (%.0f s)" % (len(RESULTS), failed, time.time() - t0))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "hf_check.json"), "w") as f:
            json.dump({"torch": torch.__version__, "transformers": transformers.__version__, "results": RESULTS}, f,
                      indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
