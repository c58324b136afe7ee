#!/usr/bin/env python3
"""Writes an llm.c token shard of random GPT-2 tokens (for benchmarks and distributed checks without real data).

usage: make_random_shard.py PATH [NUM_TOKENS] [SEED]
"""
import random
import struct
import sys


def main():
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
    rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 1234)
    header = [20240520, 1, n] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack(f"<{n}H", *(rng.randrange(50257) for _ in range(n))))


if __name__ == "__main__":
    main()
