#!/usr/bin/env python3
"""Writes a synthetic llm.c token shard for benchmarks when no real data is at hand: uint16 (magic 20240520, version 1),
or uint32 (magic 20240801, version 7, as llm.c writes LLaMA-3 shards) when the vocabulary exceeds 65536.

By default tokens follow a fixed random first-order Markov chain over GPT-2's 50257 tokens, each token having
--successors equally likely next tokens, so a model can learn it (the loss falls from ~10.9 toward ln(successors)) and
two frameworks' loss curves can be compared.

With --from SHARD the tokens are sampled from the n-gram statistics of a real text's shard instead: each next token
drawn among those that followed the last --order tokens in the text, as often as they did (a context never seen, as
at the start, backs off to the last token alone). The result follows its text a few words at a time and then turns
elsewhere, so at any length it is new: a run of many times the text's length keeps learning where the text itself,
read over and over, is memorized, the regime in which two precisions' losses can be compared without the run-to-run
spread of memorization.

Standard library only; same seed, same file.

  python3 tools/bench/make_shard.py out.bin --tokens 2000000
  python3 tools/bench/make_shard.py llama.bin --tokens 200000 --vocab 128256
  python3 tools/bench/make_shard.py ngram.bin --tokens 34000000 \
      --from data/tinyshakespeare/tinyshakespeare_train_000000.bin
"""
import argparse
import random
import struct
import sys
from array import array

ap = argparse.ArgumentParser()
ap.add_argument("path")
ap.add_argument("--tokens", type=int, default=2_000_000)
ap.add_argument("--successors", type=int, default=4)
ap.add_argument("--vocab", type=int, default=50257)
ap.add_argument("--seed", type=int, default=1337)
ap.add_argument("--from", dest="source", help="an llm.c shard of real text whose n-gram statistics the tokens follow")
ap.add_argument("--order", type=int, default=2, help="with --from: tokens of context each next token is drawn on")
a = ap.parse_args()


def fail(message):
    print(f"make_shard.py: {message}", file=sys.stderr)
    sys.exit(2)


if a.tokens < 1:
    fail(f"--tokens must be 1 or more, not {a.tokens}")
if a.order < 1:
    fail(f"--order must be 1 or more, not {a.order}")


def read_shard(path):
    """The tokens of an llm.c shard (256 int32 of header: magic, version, token count; then the tokens)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        fail(f"cannot read --from {path}: {e.strerror}")
    if len(data) < 1024:
        fail(f"--from {path} is {len(data)} bytes, shorter than an llm.c shard's 1024-byte header")
    magic, version, count = struct.unpack("<3i", data[:12])
    width = {(20240520, 1): 2, (20240801, 7): 4}.get((magic, version))
    if width is None:
        fail(f"--from {path} is not an llm.c shard (magic {magic}, version {version})")
    if len(data) != 1024 + width * count:
        fail(f"--from {path} says {count} tokens but holds {(len(data) - 1024) / width:g}")
    tokens = array("H" if width == 2 else "I")
    tokens.frombytes(data[1024:])
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens


rng = random.Random(a.seed)
if a.source:
    text = read_shard(a.source)
    if len(text) <= a.order:
        fail(f"--from {a.source} has {len(text)} tokens, too few for --order {a.order}")
    a.vocab = max(a.vocab, max(text) + 1)
    follow = {}  # context (the last `order` tokens) -> the tokens that followed it, once per occurrence
    backoff = {}  # the last token alone -> the same
    for i in range(a.order, len(text)):
        follow.setdefault(tuple(text[i - a.order:i]), []).append(text[i])
        backoff.setdefault(text[i - 1], []).append(text[i])
    start = rng.randrange(len(text) - a.order)
    context = list(text[start:start + a.order])
wide = a.vocab > 65536
tokens = array("I" if wide else "H", bytes((4 if wide else 2) * a.tokens))
if a.source:
    for i in range(a.tokens):
        choices = follow.get(tuple(context)) or backoff.get(context[-1]) or text
        t = choices[rng.randrange(len(choices))]
        tokens[i] = t
        context = context[1:] + [t]
else:
    table = [[rng.randrange(a.vocab) for _ in range(a.successors)] for _ in range(a.vocab)]
    t = rng.randrange(a.vocab)
    for i in range(a.tokens):
        tokens[i] = t
        t = table[t][rng.randrange(a.successors)]
if sys.byteorder == "big":
    tokens.byteswap()
with open(a.path, "wb") as f:
    f.write(struct.pack("<3i", 20240801 if wide else 20240520, 7 if wide else 1, a.tokens) + bytes(4 * 253))
    tokens.tofile(f)
if a.source:
    print(f"{a.path}: {a.tokens} tokens sampled from the order-{a.order} statistics of {a.source} ({len(text)} tokens)")
else:
    print(f"{a.path}: {a.tokens} tokens, Markov chain with {a.successors} successors per token")
