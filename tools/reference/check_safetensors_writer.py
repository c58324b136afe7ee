#!/usr/bin/env python3
"""Checks make_conformance_refs.py's hand-written safetensors writer without torch (struct and array only), and
writes the tiny reference set conformance/reference/writer_check.{json,safetensors} that Loom's tests load, so that
the writer and Loom's reader are tested against each other in CI:

    python3 tools/reference/check_safetensors_writer.py [--write-fixture conformance/reference]
"""
import argparse
import array
import json
import math
import os
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_conformance_refs as refs  # noqa: E402  (imports no torch at module level)


def f32_bytes(values):
    return array.array("f", values).tobytes()


def f64_bytes(values):
    return array.array("d", values).tobytes()


def i64_bytes(values):
    return struct.pack("<%dq" % len(values), *values)


def bf16_bytes(values):
    """Values exactly representable in bf16: the upper half of each f32."""
    out = b""
    for v in values:
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        assert bits & 0xFFFF == 0, "%r is not a bf16 value" % v
        out += struct.pack("<H", bits >> 16)
    return out


def parse(blob):
    """An independent reader: header length, JSON header, byte spans."""
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    return header, meta, data, n


def check_writer():
    tensors = [("a", "F32", [2, 3], f32_bytes([1, 2, 3, 4, 5, 6.5])),
               ("scalar", "F64", [], f64_bytes([0.25])),
               ("idx", "I64", [4], i64_bytes([3, -100, 0, 2 ** 40])),
               ("h", "BF16", [3], bf16_bytes([1.5, -0.25, 3.0])),
               ("empty", "F32", [0, 5], b"")]
    blob = refs.safetensors_bytes(tensors, {"format": refs.FORMAT})
    header, meta, data, n = parse(blob)
    assert n % 8 == 0, "header length %d is not 8-aligned" % n
    assert meta == {"format": refs.FORMAT}, meta
    assert list(header) == [t[0] for t in tensors], list(header)
    end = 0
    for name, dtype, shape, raw in tensors:
        e = header[name]
        assert e["dtype"] == dtype and e["shape"] == shape, e
        b, f = e["data_offsets"]
        assert b == end and f - b == len(raw) and data[b:f] == raw, (name, e)
        end = f
    assert end == len(data), "trailing bytes"
    assert struct.unpack("<4q", data[header["idx"]["data_offsets"][0]:header["idx"]["data_offsets"][1]])[1] == -100
    for bad in ([("x", "F32", [2], b"\0" * 4)], [("x", "F32", [1], b"\0" * 4)] * 2):
        try:
            refs.safetensors_bytes(bad)
        except ValueError:
            continue
        raise AssertionError("accepted a bad tensor list: %r" % (bad,))
    assert refs.worst_error([1.0, float("nan")], [1.0, float("nan")], 1e-4, 1e-5) == 0
    assert refs.worst_error([float("nan")], [1.0], 1e-4, 1e-5) == math.inf
    assert abs(refs.worst_error([1.0 + 2e-4], [1.0], 1e-4, 0) - 2) < 1e-9


def gelu_tanh(x):
    return 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def write_fixture(out_dir):
    """Three cases in the pytorch_refs format, with references computed here in Python float64."""
    a, b = [0.5, -1.25, 2.0, 3.5, -0.75, 1.0], [0.25, -2.0, 1.5]
    x = [-3.0, -1.5, -0.5, 0.0, 0.25, 1.0, 2.5]
    m1, m2 = [1.5, -0.25, 3.0, 0.5], [2.0, 4.0, -1.5, -0.125]
    grad, idx, vocab = [0.5, 1.0, -2.0, 0.25, 1.5, -0.5, 3.0, 0.75], [2, 0, 2, 3], 4
    gw = [0.0] * (vocab * 2)
    for row, i in enumerate(idx):
        for c in range(2):
            gw[i * 2 + c] += grad[row * 2 + c]
    cases = [
        ("add_broadcast_f32", "add", "f32", {}, [("a", "F32", [2, 3], f32_bytes(a)), ("b", "F32", [3], f32_bytes(b))],
         [("out", [2, 3], [a[i] + b[i % 3] for i in range(6)])]),
        ("gelu_f32", "gelu", "f32", {}, [("x", "F32", [7], f32_bytes(x))], [("out", [7], [gelu_tanh(v) for v in x])]),
        ("mul_bf16", "mul", "bf16", {}, [("a", "BF16", [2, 2], bf16_bytes(m1)), ("b", "BF16", [2, 2], bf16_bytes(m2))],
         [("out", [2, 2], [p * q for p, q in zip(m1, m2)])]),
        ("embedding_backward_f32", "embedding_backward", "f32", {"vocab": vocab},
         [("grad", "F32", [4, 2], f32_bytes(grad)), ("indices", "I64", [4], i64_bytes(idx))],
         [("grad_weight", [vocab, 2], gw)]),
    ]
    tensors, described = [], []
    for name, op, dtype, attrs, ins, outs in cases:
        rtol, atol = refs.TOLERANCE[dtype]
        entry = {"name": name, "op": op, "dtype": dtype, "attrs": attrs, "strided": op == "add",
                 "tolerance": {"rtol": rtol, "atol": atol}, "max_mismatch_ratio": 0, "inputs": [], "outputs": [],
                 "peer": {"device": "python", "worst_error": 0.0}}
        for role, st, shape, raw in ins:
            tensors.append(("%s:in:%s" % (name, role), st, shape, raw))
            entry["inputs"].append({"tensor": "%s:in:%s" % (name, role), "role": role})
        for role, shape, values in outs:
            tensors.append(("%s:ref:%s" % (name, role), "F64", shape, f64_bytes(values)))
            entry["outputs"].append({"tensor": "%s:ref:%s" % (name, role), "role": role})
        described.append(entry)
    description = {"format": refs.FORMAT, "generator": "tools/reference/check_safetensors_writer.py",
                   "torch_version": "none (references computed in Python)", "peer_device": "python",
                   "cases": described}
    return refs.write_reference_set(out_dir, "writer_check", description, tensors)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write-fixture", metavar="DIR", help="write writer_check.{json,safetensors} into DIR")
    args = parser.parse_args()
    check_writer()
    with tempfile.TemporaryDirectory() as tmp:
        st_path, json_path = write_fixture(tmp)
        with open(st_path, "rb") as f:
            header, meta, data, _ = parse(f.read())
        with open(json_path) as f:
            doc = json.load(f)
        for case in doc["cases"]:
            for t in case["inputs"] + case["outputs"]:
                assert t["tensor"] in header, t
    if args.write_fixture:
        print("wrote", *write_fixture(args.write_fixture))
    print("safetensors writer: ok")


if __name__ == "__main__":
    main()
