#!/usr/bin/env python3
"""Writes a synthetic llm.c token shard for benchmarks when no real data is at hand: uint16 (magic 20240520, version 1),
or uint32 (magic 20240801, version 7, as llm.c writes LLaMA-3 shards) when the vocabulary exceeds 65536.

Tokens follow a fixed random first-order Markov chain over GPT-2's 50257 tokens, each token having --successors
equally likely next tokens, so a model can learn it (the loss falls from ~10.9 toward ln(successors)) and two
frameworks' loss curves can be compared. Standard library only; same seed, same file.

  python3 tools/bench/make_shard.py out.bin --tokens 2000000
  python3 tools/bench/make_shard.py llama.bin --tokens 200000 --vocab 128256
"""
import argparse
import random
import struct
from array import array

ap = argparse.ArgumentParser()
ap.add_argument("path")
ap.add_argument("--tokens", type=int, default=2_000_000)
ap.add_argument("--successors", type=int, default=4)
ap.add_argument("--vocab", type=int, default=50257)
ap.add_argument("--seed", type=int, default=1337)
a = ap.parse_args()
rng = random.Random(a.seed)
table = [[rng.randrange(a.vocab) for _ in range(a.successors)] for _ in range(a.vocab)]
wide = a.vocab > 65536
tokens = array("I" if wide else "H", bytes((4 if wide else 2) * a.tokens))
t = rng.randrange(a.vocab)
for i in range(a.tokens):
    tokens[i] = t
    t = table[t][rng.randrange(a.successors)]
with open(a.path, "wb") as f:
    f.write(struct.pack("<3i", 20240801 if wide else 20240520, 7 if wide else 1, a.tokens) + bytes(4 * 253))
    tokens.tofile(f)
print(f"{a.path}: {a.tokens} tokens, Markov chain with {a.successors} successors per token")
