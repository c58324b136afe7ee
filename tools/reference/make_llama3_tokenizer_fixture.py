#!/usr/bin/env python3
"""Writes the reference fixture for Loom's LLaMA-3 tokenizer tests (tests/llama3_tokenizer_test.cc).

    python3 tools/reference/make_llama3_tokenizer_fixture.py [OUT_DIR]     (default: tests/fixtures)

Meta's tokenizer.model is gated, so this builds a small vocabulary of the same format and pins the encoding with an
implementation independent of Loom's: the `regex` module (which knows \\p{L} and \\p{N}) applying LLaMA-3's
pre-tokenizer pattern verbatim, and a plain rank-merge BPE as tiktoken does it. It writes

  OUT_DIR/llama3_tiny_tokenizer.model   tiktoken BPE format, one "base64(token bytes) rank" per line: the 256 single
                                        bytes (ranks shuffled with a fixed seed), merges learned on a small corpus,
                                        and one token no merge reaches ("zqzq", to pin tiktoken's whole-piece lookup)
  OUT_DIR/llama3_tokenizer_cases.json   for each text (hex bytes): the pre-tokenizer's pieces and the token ids;
                                        texts with special-token strings also carry their ids when specials are
                                        allowed. The 256 special tokens follow the file's ranks, as in Meta's
                                        tokenizer.py (LLaMA-3: ids 128000..128255).

Invalid UTF-8 reaches the regex as Python's surrogateescape characters (one per undecodable byte, matched by no
class but "other"), the same treatment Loom gives such bytes (include/loom/data/pretokenizer.h: the pattern runs in
PCRE2 with Unicode's classes). Only the standard library and `regex` are needed;
the output is deterministic.
"""
import base64
import json
import os
import random
import sys

import regex

PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PAT = regex.compile(PATTERN)

# Meta's llama3 tokenizer.py (meta-llama/llama3, llama/tokenizer.py): ids num_base_tokens + i.
SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|reserved_special_token_4|>", "<|eot_id|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(5, 256 - 5)]
assert len(SPECIAL_TOKENS) == 256

NUM_MERGES = 600

CORPUS = """\
The quick brown fox jumps over the lazy dog. It's the dog's day; they're sure we'll see what I'd done.
I'M SURE THEY'RE RIGHT, AREN'T THEY? She said: "Don't worry -- it'll be fine!"
In 2024, 1,234,567 people read 3.14159 pages; 42 of them wrote 100000 lines.
def main(argv):
    for i in range(10):
        print(f"value {i}: {i * i}")
    return 0
naïve café résumé Ünïcödé façade déjà vu
Ωμέγα και άλφα. Привет, мир! Как дела? שלום עולם. مرحبا بالعالم. नमस्ते दुनिया।
こんにちは世界。今日はいい天気ですね。한국어 텍스트입니다. 你好，世界！
Hello world! Hello again, world... and hello once more.\r\nWindows lines\r\nend.
Emoji: 🍕🍕 👍🏽 ❤️ 😀 — dashes – and “quotes”.
    indented   text\twith\ttabs   and    spaces
"""


def to_str(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def to_bytes(s: str) -> bytes:
    return s.encode("utf-8", "surrogateescape")


def pretokenize(text: bytes):
    return [to_bytes(m) for m in PAT.findall(to_str(text))]


def learn_vocab():
    rng = random.Random(20240418)
    singles = list(range(256))
    rng.shuffle(singles)
    ranks = {bytes([b]): r for r, b in enumerate(singles)}
    # Byte-level BPE training on the corpus's pieces: repeatedly the most frequent adjacent pair (ties: the
    # smallest pair of byte strings) becomes a token.
    counts = {}
    for piece in pretokenize(CORPUS.encode()):
        counts[piece] = counts.get(piece, 0) + 1
    words = [([bytes([b]) for b in piece], n) for piece, n in sorted(counts.items())]
    for _ in range(NUM_MERGES):
        pairs = {}
        for parts, n in words:
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + n
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merged = best[0] + best[1]
        if merged in ranks:
            continue
        ranks[merged] = len(ranks)
        for parts, _ in words:
            i = 0
            while i + 1 < len(parts):
                if parts[i] == best[0] and parts[i + 1] == best[1]:
                    parts[i:i + 2] = [merged]
                i += 1
    assert b"zq" not in ranks and b"qz" not in ranks
    ranks[b"zqzq"] = len(ranks)
    return ranks


def bpe(piece: bytes, ranks):
    """tiktoken's encoding of one piece: the piece itself if it is a token, else merge the adjacent pair whose
    concatenation has the lowest rank (the leftmost of equals) until no pair is a token."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


def encode(text: bytes, ranks):
    ids = []
    for piece in pretokenize(text):
        ids += bpe(piece, ranks)
    return ids


def encode_with_special(text: bytes, ranks):
    special = {s.encode(): len(ranks) + i for i, s in enumerate(SPECIAL_TOKENS)}
    alternation = regex.compile("|".join(regex.escape(s) for s in SPECIAL_TOKENS))
    ids, start = [], 0
    s = to_str(text)
    for m in alternation.finditer(s):
        ids += encode(to_bytes(s[start:m.start()]), ranks)
        ids.append(special[m.group().encode()])
        start = m.end()
    return ids + encode(to_bytes(s[start:]), ranks)


TEXTS = [
    # contractions, any case (the pattern's (?i:...)); "'ſ" is "'s" under Unicode case folding
    "I'M HE'LL SHE'S THEY'RE WE'VE YOU'D DON'T can't 'Re 'rE 'Ll 'x 'ſ Itſ",
    "it's", "'s's 're 'x", "''s", "'", "x'", "don'T", "O'Neil's",
    # digit runs of 1..7, numbers among letters and punctuation, other scripts' digits and number forms
    "1 12 123 1234 12345 123456 1234567", "v1.2.3 x2024y 3.14159 -42 1,000,000",
    "\u0661\u0662\u0663\u0664 \u0967\u0968\u0969\u096a\u096b \u00bd\u00b2 \u216b \u2460\u2461",
    # newlines with spaces, CRLF, lone CR
    "a \n b", "line1\n\n\nline2", "  \n  \n  x", "x \n\n  ", "\n \n", " \n", "\n",
    "one\r\ntwo\r\n\r\nthree\r\n", "a\r b\r\n c", "\r\n\r\n", "x\r", "x \r \n y",
    # punctuation runs followed by newlines
    "Hello!!!\n\nWorld...\r\n", "--> ;;\n", " ?!\n\n\nx", "end.\n", "(x) [y]\n{z}", "...\n \n", "a.\r\n\r\nb",
    # letters of several scripts
    "na\u00efve caf\u00e9 \u00dcn\u00efc\u00f6d\u00e9", "\u03a9\u03bc\u03ad\u03b3\u03b1 \u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440",
    "\u05e9\u05dc\u05d5\u05dd \u0639\u0627\u0644\u0645", "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35", "\u3053\u3093\u306b\u3061\u306f\u4e16\u754c \ud55c\uad6d\uc5b4",
    "\uff21\uff22\uff23\uff11\uff12", "\ufb01ne \u0101\u0113", "e\u0301t\u00e9",
    # emoji (symbols, modifiers, joiners, variation selectors)
    "I \u2764\ufe0f \U0001F355! \U0001F44D\U0001F3FD\U0001F468\u200d\U0001F469\u200d\U0001F467 ok",
    " \U0001F600\U0001F600\n", "\U0001F600abc",
    # leading and trailing whitespace, other White_Space characters
    "   lead", "trail   ", "\t\ttabs\t", " ", "", "  \u00a0 x \u3000y", "\u00a0word", "a\u2028b", "x\u0085y",
    "\x0b\x0c z", "a" + " " * 40 + "b", "=" * 50, "a" * 17, "tab\there",
    # code and mixed
    "Hello, world! It's 2024.", "def f(x):\n    return x**2  # sq\n", "if (a && b) { c++; }\n\treturn;",
    "The quick brown fox jumps over the lazy dog.", "Hello world! Hello again, world...",
    # special-token strings are text by default
    "<|begin_of_text|>Hi<|eot_id|>", "a<|end_of_text|> <|reserved_special_token_250|>\n<|start_header_id|>",
    "<|not_special|> <|begin_of_text|", "<|reserved_special_token_251|>",
    # whole-piece lookup: "zqzq" is a token no merge reaches
    "zqzq", "\nzqzq", "(zqzq", " zqzq",
]

# Bytes that are not valid UTF-8 (each one "other" character).
BYTE_TEXTS = [
    b"ab\xffcd \xc3( \xe2\x82 \xf0\x9f\x98 x\x80y \xc0\x80 \xed\xa0\x80 \xf4\x90\x80\x80",
    b"\xff\xfe", b" \xff\n", b"\xffabc", b"caf\xe9 12\xff34",
]

# Random texts over an alphabet of characters that exercise every branch of the pattern.
ALPHABET = [" ", " ", " ", "\n", "\r", "\t", "a", "b", "Z", "'", "s", "S", "t", "l", "L", "e", "1", "2", "0", ".",
            "!", "(", "-", "\u00e9", "\u03a9", "\u017f", "\u00bd", "\u0663", "\u00a0", "\u3000", "\U0001F600",
            "\u0301", "\u4e16", "<|", "|>", "\u2028"]


def random_texts(n):
    rng = random.Random(7)
    out = []
    for _ in range(n):
        s = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 40)))
        b = s.encode()
        if rng.random() < 0.2:  # sprinkle an invalid byte
            pos = rng.randrange(0, len(b) + 1)
            b = b[:pos] + bytes([rng.choice([0x80, 0xbf, 0xc3, 0xff])]) + b[pos:]
        out.append(b)
    return out


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "tests",
                                                                   "fixtures")
    ranks = learn_vocab()
    model_path = os.path.join(out_dir, "llama3_tiny_tokenizer.model")
    with open(model_path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")

    cases = []
    texts = [t.encode() for t in TEXTS] + BYTE_TEXTS + random_texts(300)
    for text in texts:
        pieces = pretokenize(text)
        assert b"".join(pieces) == text
        ids = encode(text, ranks)
        case = {"text_hex": text.hex(), "pieces_hex": [p.hex() for p in pieces], "ids": ids}
        if b"<|" in text:
            case["ids_with_special"] = encode_with_special(text, ranks)
        cases.append(case)
    fixture = {
        "comment": "made by tools/reference/make_llama3_tokenizer_fixture.py (python regex " + regex.__version__ +
                   "); texts and pieces are hex bytes",
        "pattern": PATTERN,
        "vocab": "llama3_tiny_tokenizer.model",
        "num_base_tokens": len(ranks),
        "special_tokens": SPECIAL_TOKENS,
        "cases": cases,
    }
    with open(os.path.join(out_dir, "llama3_tokenizer_cases.json"), "w") as f:
        json.dump(fixture, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {model_path} ({len(ranks)} ranks) and {len(cases)} cases")


if __name__ == "__main__":
    main()
