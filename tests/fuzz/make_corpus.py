#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/): small valid files of each format, so the
fuzzer starts past the first checks. Run from the repository root; the output is committed."""
import base64, json, os, struct, sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def put(target, name, data):
    d = os.path.join(root, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None):
    header, blob = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + blob


put("fuzz_safetensors", "f32", safetensors({"w": ("F32", [2, 3], struct.pack("<6f", *range(6)))}))
put("fuzz_safetensors", "mixed", safetensors({"a": ("BF16", [2], b"\x80\x3f\x00\x40"), "b": ("I64", [1], struct.pack("<q", 7)),
                                              "e": ("F16", [0, 4], b"")}, {"format": "pt"}))

def token_shard(magic, version, tokens, fmt):
    return struct.pack("<256i", magic, version, len(tokens), *([0] * 253)) + struct.pack("<%d%s" % (len(tokens), fmt), *tokens)

put("fuzz_token_file", "u16", b"\x02" + token_shard(20240520, 1, [1, 2, 50256, 7, 0], "H"))
put("fuzz_token_file", "u32", b"\x03" + token_shard(20240801, 7, [128000, 5, 9, 128009], "I"))
put("fuzz_token_file", "u16_limit", b"\x06" + token_shard(20240520, 1, [65535, 3], "H"))

# llm.c GPT-2: maxT 8, V 10, L 1, H 2, C 4, Vp 16.
T, V, L, H, C, Vp = 8, 10, 1, 2, 4, 16
n = Vp * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
hdr = struct.pack("<256i", 20240326, 3, T, V, L, H, C, Vp, *([0] * 248))
put("fuzz_llmc_model", "tiny_f32", hdr + struct.pack("<%df" % n, *[0.01 * (i % 17) for i in range(n)]))
hdr5 = struct.pack("<256i", 20240326, 5, T, V, L, H, C, Vp, *([0] * 248))
put("fuzz_llmc_model", "tiny_bf16", hdr5 + b"\x80\x3f" * n)

put("fuzz_model_config", "gpt2", json.dumps({"family": "gpt2", "vocab_size": 100, "max_seq_len": 32, "n_layer": 2,
                                             "n_head": 2, "n_embd": 16}))
put("fuzz_model_config", "llama", json.dumps({"family": "llama", "vocab_size": 100, "max_seq_len": 32, "n_layer": 1,
                                              "n_head": 4, "n_kv_head": 2, "n_embd": 16, "ffn_hidden": 24,
                                              "tie_embeddings": False, "rope_theta": 10000.0}))
put("fuzz_model_config", "hf_llama", json.dumps({"model_type": "llama", "vocab_size": 128, "hidden_size": 16,
                                                 "intermediate_size": 32, "num_hidden_layers": 1,
                                                 "num_attention_heads": 4, "num_key_value_heads": 2,
                                                 "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
                                                 "rope_theta": 500000.0, "tie_word_embeddings": True,
                                                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                  "original_max_position_embeddings": 32}}))
put("fuzz_model_config", "hf_gpt2", json.dumps({"model_type": "gpt2", "vocab_size": 100, "n_positions": 32,
                                                "n_embd": 16, "n_layer": 1, "n_head": 2, "layer_norm_epsilon": 1e-5}))

put("fuzz_checkpoint", "state", json.dumps({"step": 3, "loader": {"shard_index": 0, "batch_offset": 2, "epoch": 1,
                                                                   "rng_state": 1234}, "rng": {"seed": 1337, "offset": 8},
                                            "model": "d2"}))


hf_llama_config = json.dumps({"model_type": "llama", "vocab_size": 128, "hidden_size": 16, "intermediate_size": 32,
                              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "head_dim": 4, "max_position_embeddings": 64})
put("fuzz_hf_model_dir", "llama_sharded", hf_llama_config + "\n#index\n" + json.dumps(
    {"metadata": {"total_size": 1024}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                                      "lm_head.weight": "model-00001-of-00002.safetensors"}}))
put("fuzz_hf_model_dir", "gpt2_no_weights", json.dumps({"model_type": "gpt2", "vocab_size": 100, "n_positions": 32,
                                                        "n_embd": 16, "n_layer": 1, "n_head": 2}))

put("fuzz_policy_file", "full", json.dumps({"routes": {"gemm": ["native"], "softmax": "native"},
                                            "devices": {"cpu": {"gemm": ["native"]}, "cuda": {"add": "native"}},
                                            "order": ["native"], "deny": ["slowlib"], "shadow": {"softmax": "native"},
                                            "autotune": ["gemm"], "cpu_fallback": False, "verify": False}) +
    "\n#spec\nnative:gemm,softmax;-slowlib;shadow=native:gemm")
put("fuzz_policy_file", "shadow_all", json.dumps({"shadow": "native", "autotune": True}))

put("fuzz_json_config", "train_config", json.dumps({"lr": 3e-4, "steps": 10, "shuffle": True, "model": "d2",
                                                    "train-data": ["a.bin", "b.bin"]}))
put("fuzz_json_config", "nested", "[" * 200 + "]" * 200)

meta_params = [{"name": "wte.weight", "shape": [8, 4], "split": None, "adam_step": 2,
                "pieces": [[0, 0, 0, 16], [1, 0, 16, 32]]},
               {"name": "c_attn.weight", "shape": [12, 4], "split": {"dim": 0, "blocks": [4, 4, 4]}, "adam_step": 2,
                "pieces": [[0, 0, 0, 24], [1, 1, 0, 24]]}]
put("fuzz_sharded_meta", "tp2", json.dumps({
    "format": "loom-sharded-checkpoint-1", "step": 2,
    "state": {"step": 2, "loader": {"shard_index": 0, "batch_offset": 2, "epoch": 0, "rng_state": 1},
              "rng": {"seed": 1337, "offset": 8}, "model": "d2", "run_id": "0123456789abcdef"},
    "model": "d2", "config": {"family": "gpt2", "vocab_size": 8, "n_embd": 4},
    "layout": {"world": 2, "dp": 1, "tp": 2, "zero": 0, "pp": 1}, "optimizer": {"step": 2, "lr": 0.001},
    "files": ["rank0.safetensors", "rank1.safetensors"], "parameters": meta_params}))


def bytes_to_unicode():  # GPT-2's byte <-> printable character table
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    k = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    return {b: chr(c) for b, c in zip(bs, cs)}

b2u = bytes_to_unicode()
enc = {b2u[b]: b for b in range(256)}
merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
for a, b in merges:
    enc[a + b] = len(enc)
enc["<|endoftext|>"] = len(enc)
bpe = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
put("fuzz_gpt2_tokenizer", "tiny", json.dumps(enc, ensure_ascii=False) + "\n#vocab.bpe\n" + bpe + "\n#text\n" +
    "in the thing, <|endoftext|> héllo 123's")

lines = [base64.b64encode(bytes([b])).decode() + f" {b}" for b in range(256)]
for i, t in enumerate([b"th", b"he", b"the", b" the", b"in"]):
    lines.append(base64.b64encode(t).decode() + f" {256 + i}")
put("fuzz_llama3_tokenizer", "tiny", "\n".join(lines) + "\n" + "\n#text\n" +
    "the thing <|begin_of_text|>in 1234 héllo<|eot_id|>")

ref_dir = os.path.join(os.path.dirname(root), "..", "..", "conformance", "reference")
with open(os.path.join(ref_dir, "writer_check.json")) as f:
    doc = json.load(f)
doc["tensors"] = "refs.safetensors"
with open(os.path.join(ref_dir, "writer_check.safetensors"), "rb") as f:
    put("fuzz_conformance_refs", "writer_check", json.dumps(doc).encode() + b"\n#tensors\n" + f.read())
