#!/usr/bin/env python3
"""PyTorch reference data for loom-conformance: the main ops' inputs and PyTorch's float64 results.

    python3 tools/reference/make_conformance_refs.py [--out conformance/reference]

needs only `torch`. It builds each case's inputs from its own seed in the case's dtype (f32 or bf16; index tensors
i64), runs PyTorch on the CPU in float64 on those inputs (upcast) for the reference, and, informative only, runs
PyTorch again in the case's dtype on CUDA (on the CPU where no GPU is visible) and records how far that lands from
the reference in units of the case's tolerance. It writes two files:
  pytorch_refs.safetensors  inputs ("<case>:in:<role>"), float64 references ("<case>:ref:<role>") and PyTorch's own
                            result in the case's dtype ("<case>:peer:<role>")
  pytorch_refs.json         per case: the Loom op, attributes, the tensors in the order of the op's conformance
                            harness (its kernel's argument order), dtype, tolerance, the peer's error, torch version.
Loom's conventions mirrored here: gemm is column-major (a row-major [R, C] tensor is a C x R matrix) with
C = alpha op(A) op(B) + beta C (+ bias[i] per row i of C); gelu is the tanh approximation; layer norm's statistics are
mean and rstd = 1/sqrt(var + eps) over the last dim (f32); attention is [B, H, T, D] with kv heads shared by
H/Hkv query heads, scale defaulting to 1/sqrt(D), causal masks aligned bottom-right (query t sees keys
s <= t + S - T), lse the natural log of each row's softmax denominator; cross entropy averages over the counted
targets (ignore_index -100); AdamW as PyTorch's with the 1-based step in its bias correction.
The safetensors writer is plain Python (json + struct) so that tools/reference/check_safetensors_writer.py can test
it without torch.
"""
import argparse
import json
import math
import os
import struct
import sys

FORMAT = "loom-pytorch-conformance/1"
ST_DTYPE_SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}

# ---------------------------------------------------------------------------------------------------------------
# safetensors, by hand: 8-byte little-endian header length, JSON header, then the raw little-endian bytes.


def safetensors_bytes(tensors, metadata=None):
    """tensors: list of (name, safetensors dtype, shape, raw little-endian bytes), stored in this order."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape, data in tensors:
        if name in header:
            raise ValueError("duplicate tensor name %r" % name)
        numel = 1
        for d in shape:
            numel *= int(d)
        if numel * ST_DTYPE_SIZE[dtype] != len(data):
            raise ValueError("%s: %d bytes for %s%s" % (name, len(data), dtype, list(shape)))
        header[name] = {"dtype": dtype, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors)


def write_reference_set(out_dir, stem, description, tensors):
    """Writes <stem>.safetensors (tensors as for safetensors_bytes) and <stem>.json (description, to which the
    tensor file's name is added). Returns both paths."""
    os.makedirs(out_dir, exist_ok=True)
    description = dict(description)
    description["tensors"] = stem + ".safetensors"
    st_path = os.path.join(out_dir, stem + ".safetensors")
    json_path = os.path.join(out_dir, stem + ".json")
    blob = safetensors_bytes(tensors, {"format": description["format"]})
    with open(st_path + ".tmp", "wb") as f:
        f.write(blob)
    os.replace(st_path + ".tmp", st_path)
    with open(json_path + ".tmp", "w") as f:
        json.dump(description, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(json_path + ".tmp", json_path)
    return st_path, json_path


def worst_error(got, want, rtol, atol):
    """Loom's metric: max |got - want| / (atol + rtol |want|) over flat lists; NaN in both is skipped (unwritten
    padding), NaN in one of them is infinite."""
    worst = 0.0
    for g, w in zip(got, want):
        if math.isnan(w) or math.isnan(g):
            if math.isnan(w) and math.isnan(g):
                continue
            return math.inf
        if g != w:
            worst = max(worst, abs(g - w) / (atol + rtol * abs(w)))
    return worst


# ---------------------------------------------------------------------------------------------------------------
# The cases. torch is imported in main() only, so that the writer above can be imported without it.

torch = None
F = None
TOLERANCE = {"f32": (1e-4, 1e-5), "bf16": (3e-2, 2e-2)}


def torch_dtype(name):
    return {"f32": torch.float32, "bf16": torch.bfloat16, "f64": torch.float64, "i64": torch.int64}[name]


def st_dtype(t):
    return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float64: "F64", torch.int64: "I64",
            torch.float16: "F16", torch.int32: "I32"}[t.dtype]


def tensor_bytes(t):
    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    return bytes(t.view(torch.uint8).tolist())


class Case:
    def __init__(self, name, op, dtype, inputs, compute, attrs=None, strided=False, tol=None, about="",
                 checks=()):
        self.name, self.op, self.dtype = name, op, dtype
        self.inputs = inputs        # [(role, tensor)] in the harness's input order, stored as they are
        self.compute = compute      # f(list of tensors) -> [(role, tensor)], in the harness's output order
        self.attrs = attrs or {}
        self.strided = strided      # Loom passes non-contiguous views of the inputs (ops that take any strides)
        self.tol = tol or TOLERANCE[dtype]
        self.about = about
        # [(what, f(float64 inputs) -> (got, want)[, (rtol, atol)])]: the script checks its own conventions
        self.checks = checks


def gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def uniform(g, shape, dtype, lo=-1.0, hi=1.0):
    return (torch.rand(tuple(shape), generator=g, dtype=torch.float64) * (hi - lo) + lo).to(torch_dtype(dtype))


def targets_with_ignored(g, n, classes):
    t = torch.randint(0, classes, (n,), generator=g, dtype=torch.int64)
    t[4::5] = -100  # every 5th row ignored, as Loom's declarative cases do
    return t


def f64(ts):
    return [t.to(torch.float64) if t.is_floating_point() else t for t in ts]


# ---- gemm: column-major, C[m x n] = alpha op(A) op(B) + beta C (+ bias[i]); each matrix stored [batch, cols, ld].


def colmajor(s, rows):
    return s[:, :, :rows].transpose(1, 2)  # [batch, rows, cols]


def gemm_colmajor(ts, a):
    A, B, bias, C0 = ts
    m, n, k, ta, tb = a["m"], a["n"], a["k"], a.get("trans_a", False), a.get("trans_b", False)
    opa = colmajor(A, k if ta else m)
    opa = opa.transpose(1, 2) if ta else opa
    opb = colmajor(B, n if tb else k)
    opb = opb.transpose(1, 2) if tb else opb
    c = a.get("alpha", 1.0) * torch.matmul(opa, opb)
    if a.get("beta", 0.0) != 0:
        c = c + a["beta"] * colmajor(C0, m)
    if a.get("epilogue", 0) == 1:
        c = c + bias.view(1, m, 1)
    out = torch.full_like(C0, float("nan"))
    out[:, :, :m] = c.transpose(1, 2)  # the padding rows stay NaN: nobody writes them
    return out


def gemm_linear(name, dtype, rows, fin, fout, seed):
    g = gen(seed)
    W, x, b = uniform(g, [fout, fin], dtype), uniform(g, [rows, fin], dtype), uniform(g, [fout], dtype)
    c0 = uniform(g, [1, rows, fout], dtype)
    attrs = {"m": fout, "n": rows, "k": fin, "trans_a": True, "epilogue": 1}
    return Case(name, "gemm", dtype, [("A=weight[out,in]", W.unsqueeze(0)), ("B=input[rows,in]", x.unsqueeze(0)),
                                      ("bias", b), ("C0", c0)],
                lambda ts: [("C=output[rows,out]", F.linear(ts[1][0], ts[0][0], ts[2]).unsqueeze(0))],
                attrs=attrs, about="F.linear(x, W, b) as gemm: m=out, n=rows, k=in, A=W transposed, bias epilogue",
                checks=[("F.linear == column-major gemm",
                         lambda ts: (F.linear(ts[1][0], ts[0][0], ts[2]).unsqueeze(0), gemm_colmajor(ts, attrs)))])


def gemm_matmul(name, dtype, batch, r, kk, c, seed):
    g = gen(seed)
    X, Y = uniform(g, [batch, r, kk], dtype), uniform(g, [batch, kk, c], dtype)
    bias, c0 = uniform(g, [c], dtype), uniform(g, [batch, r, c], dtype)
    attrs = {"m": c, "n": r, "k": kk, "batch": batch}
    # Row-major Z = X @ Y is column-major Z^T = Y^T X^T: A is Y's memory, B is X's.
    return Case(name, "gemm", dtype, [("A=Y[b,k,c]", Y), ("B=X[b,r,k]", X), ("bias", bias), ("C0", c0)],
                lambda ts: [("C=Z[b,r,c]", torch.matmul(ts[1], ts[0]))],
                attrs=attrs, about="torch.matmul(X, Y) batched, as a strided-batch gemm (A=Y, B=X)",
                checks=[("torch.matmul == column-major gemm",
                         lambda ts: (torch.matmul(ts[1], ts[0]), gemm_colmajor(ts, attrs)))])


def gemm_padded(name, dtype, seed):
    g = gen(seed)
    m, n, k, pad = 9, 6, 11, 3
    attrs = {"m": m, "n": n, "k": k, "trans_b": True, "alpha": 0.5, "beta": 0.75}

    def padded(rows, cols):
        s = uniform(g, [1, cols, rows + pad], dtype)
        s[:, :, rows:] = float("nan")  # padding a kernel must not read
        return s

    A, B, bias, C0 = padded(m, k), padded(n, k), uniform(g, [m], dtype), padded(m, n)
    return Case(name, "gemm", dtype, [("A", A), ("B", B), ("bias", bias), ("C0", C0)],
                lambda ts: [("C", gemm_colmajor(ts, attrs))], attrs=attrs, strided=True,
                about="C = 0.5 A op(B)^T + 0.75 C, leading dimensions padded by 3 (NaN padding)")


# ---- elementwise


def binary(name, op, dtype, sa, sb, seed, strided=False):
    g = gen(seed)
    fn = {"add": torch.add, "mul": torch.mul}[op]
    return Case(name, op, dtype, [("a", uniform(g, sa, dtype)), ("b", uniform(g, sb, dtype))],
                lambda ts: [("out", fn(ts[0], ts[1]))], strided=strided,
                about="torch.%s, broadcast %s with %s" % (op, sa, sb))


def gelu(name, dtype, shape, seed, strided=False):
    g = gen(seed)
    return Case(name, "gelu", dtype, [("x", uniform(g, shape, dtype, -4, 4))],
                lambda ts: [("out", F.gelu(ts[0], approximate="tanh"))], strided=strided,
                about="F.gelu(x, approximate='tanh')")


def gelu_backward(name, dtype, shape, seed):
    g = gen(seed)

    def run(ts):
        x = ts[1].detach().clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(F.gelu(x, approximate="tanh"), x, ts[0])
        return [("grad_x", gx)]

    return Case(name, "gelu_backward", dtype, [("grad", uniform(g, shape, dtype)),
                                                ("x", uniform(g, shape, dtype, -4, 4))], run,
                about="autograd of F.gelu(x, approximate='tanh')")


# ---- softmax


def softmax(name, dtype, shape, dim, seed):
    g = gen(seed)
    return Case(name, "softmax", dtype, [("x", uniform(g, shape, dtype, -4, 4))],
                lambda ts: [("out", F.softmax(ts[0], dim=dim))], attrs={"dim": dim}, about="F.softmax")


def softmax_backward(name, dtype, shape, dim, seed):
    g = gen(seed)
    x = uniform(g, shape, "f32", -4, 4).to(torch.float64)
    out = F.softmax(x, dim=dim).to(torch_dtype(dtype))
    grad = uniform(g, shape, dtype)

    def run(ts):  # PyTorch's softmax backward from (grad, out), as Loom's kernel gets them
        return [("grad_input", torch._softmax_backward_data(ts[0], ts[1], dim, ts[1].dtype))]

    def via_autograd(ts):
        xs = x.detach().clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(F.softmax(xs, dim=dim), xs, ts[0])
        return run(ts)[0][1], gx

    return Case(name, "softmax_backward", dtype, [("grad", grad), ("out=softmax(x)", out)], run, attrs={"dim": dim},
                about="torch._softmax_backward_data(grad, out) with out = softmax(x)",
                # out is rounded to f32, so autograd through the exact x agrees to f32 precision only
                checks=[("softmax backward == autograd through x", via_autograd, (1e-5, 1e-7))])


# ---- layer norm and RMS norm


def ln_stats(x, eps):
    mean = x.mean(dim=-1)
    var = ((x - mean.unsqueeze(-1)) ** 2).mean(dim=-1)
    return mean, 1.0 / torch.sqrt(var + eps)


def layer_norm(name, dtype, shape, eps, seed):
    g = gen(seed)
    C = shape[-1]

    def run(ts):
        x, w, b = ts
        mean, rstd = ln_stats(x, eps)
        return [("out", F.layer_norm(x, (C,), w, b, eps)), ("mean", mean), ("rstd", rstd)]

    def manual(ts):
        x, w, b = ts
        mean, rstd = ln_stats(x, eps)
        return run(ts)[0][1], (x - mean.unsqueeze(-1)) * rstd.unsqueeze(-1) * w + b

    return Case(name, "layer_norm", dtype, [("x", uniform(g, shape, dtype, -2, 2)),
                                             ("weight", uniform(g, [C], dtype, 0.5, 1.5)),
                                             ("bias", uniform(g, [C], dtype, -0.5, 0.5))], run, attrs={"eps": eps},
                about="F.layer_norm over the last dim; mean and rstd = 1/sqrt(var + eps)",
                checks=[("F.layer_norm == (x - mean) rstd w + b", manual)])


def layer_norm_backward(name, dtype, shape, eps, seed):
    g = gen(seed)
    C = shape[-1]
    x, w = uniform(g, shape, dtype, -2, 2), uniform(g, [C], dtype, 0.5, 1.5)
    mean, rstd = ln_stats(x.to(torch.float64), eps)

    def run(ts):
        grad = ts[0]
        x = ts[1].detach().clone().requires_grad_(True)
        w = ts[2].detach().clone().requires_grad_(True)
        b = torch.zeros_like(w).requires_grad_(True)
        gx, gw, gb = torch.autograd.grad(F.layer_norm(x, (C,), w, b, eps), (x, w, b), grad.to(x.dtype))
        return [("grad_input", gx), ("grad_weight", gw), ("grad_bias", gb)]

    return Case(name, "layer_norm_backward", dtype,
                [("grad", uniform(g, shape, dtype)), ("x", x), ("weight", w), ("mean", mean.to(torch.float32)),
                 ("rstd", rstd.to(torch.float32))], run, attrs={"eps": eps},
                about="autograd of F.layer_norm (eps %g); mean and rstd f32 from the float64 forward" % eps)


def rms(x, w, eps):
    rstd = torch.rsqrt((x * x).mean(dim=-1) + eps)
    return x * rstd.unsqueeze(-1) * w, rstd


def rms_norm_fn(x, w, eps):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return rms(x, w, eps)[0]


def rms_norm(name, dtype, shape, eps, seed):
    g = gen(seed)
    C = shape[-1]

    def run(ts):
        return [("out", rms_norm_fn(ts[0], ts[1], eps)), ("rstd", rms(ts[0], ts[1], eps)[1])]

    return Case(name, "rms_norm", dtype, [("x", uniform(g, shape, dtype, -2, 2)),
                                           ("weight", uniform(g, [C], dtype, 0.5, 1.5))], run, attrs={"eps": eps},
                about="F.rms_norm over the last dim; rstd = 1/sqrt(mean(x^2) + eps)",
                checks=[("F.rms_norm == x rstd w", lambda ts: (run(ts)[0][1], rms(ts[0], ts[1], eps)[0]))])


def rms_norm_backward(name, dtype, shape, eps, seed):
    g = gen(seed)
    C = shape[-1]
    x, w = uniform(g, shape, dtype, -2, 2), uniform(g, [C], dtype, 0.5, 1.5)
    rstd = rms(x.to(torch.float64), w.to(torch.float64), eps)[1]

    def run(ts):
        x = ts[1].detach().clone().requires_grad_(True)
        w = ts[2].detach().clone().requires_grad_(True)
        gx, gw = torch.autograd.grad(rms_norm_fn(x, w, eps), (x, w), ts[0].to(x.dtype))
        return [("grad_input", gx), ("grad_weight", gw)]

    return Case(name, "rms_norm_backward", dtype,
                [("grad", uniform(g, shape, dtype)), ("x", x), ("weight", w), ("rstd", rstd.to(torch.float32))],
                run, attrs={"eps": eps}, about="autograd of F.rms_norm (eps %g); rstd f32" % eps)


# ---- cross entropy


def cross_entropy(name, dtype, n, v, reduction, seed):
    g = gen(seed)
    logits, t = uniform(g, [n, v], dtype, -3, 3), targets_with_ignored(g, n, v)
    return Case(name, "cross_entropy", dtype, [("logits", logits), ("targets", t)],
                lambda ts: [("loss", F.cross_entropy(ts[0], ts[1], ignore_index=-100, reduction=reduction))],
                attrs={"reduction": reduction, "ignore_index": -100},
                about="F.cross_entropy(reduction=%s, ignore_index=-100), every 5th target ignored" % reduction)


def cross_entropy_backward(name, dtype, n, v, reduction, seed):
    g = gen(seed)
    gl = uniform(g, [] if reduction != "none" else [n], "f32", 0.5, 1.5)
    logits, t = uniform(g, [n, v], dtype, -3, 3), targets_with_ignored(g, n, v)

    def run(ts):
        x = ts[1].detach().clone().requires_grad_(True)
        loss = F.cross_entropy(x, ts[2], ignore_index=-100, reduction=reduction)
        (gx,) = torch.autograd.grad(loss, x, ts[0].to(loss.dtype))
        return [("grad_logits", gx)]

    return Case(name, "cross_entropy_backward", dtype, [("grad_loss", gl), ("logits", logits), ("targets", t)], run,
                attrs={"reduction": reduction, "ignore_index": -100},
                about="autograd of F.cross_entropy(reduction=%s), every 5th target ignored" % reduction)


# ---- attention: [B, H, T, D], kv heads [B, Hkv, S, D], causal aligned bottom-right


def attention_mask(T, S, device):
    t = torch.arange(T, device=device).unsqueeze(1)
    s = torch.arange(S, device=device).unsqueeze(0)
    return s <= t + (S - T)  # True: the key takes part


def sdpa(q, k, v, causal, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = attention_mask(q.shape[2], k.shape[2], q.device) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def attention_manual(q, k, v, causal, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~attention_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v), torch.logsumexp(scores, dim=-1)


def attention(name, dtype, qs, ks, causal, seed):
    g = gen(seed)
    scale = 1.0 / math.sqrt(qs[3])
    q, k, v = uniform(g, qs, dtype), uniform(g, ks, dtype), uniform(g, ks, dtype)

    def run(ts):
        return [("out", sdpa(ts[0], ts[1], ts[2], causal, scale)),
                ("lse", attention_manual(ts[0], ts[1], ts[2], causal, scale)[1])]

    return Case(name, "scaled_dot_product_attention", dtype, [("q", q), ("k", k), ("v", v)], run,
                attrs={"causal": causal, "scale": scale},
                about="F.scaled_dot_product_attention, q %s k/v %s, %s, scale 1/sqrt(D); lse = logsumexp of the "
                      "scaled, masked scores" % (qs, ks, "causal (bottom-right)" if causal else "not causal"),
                checks=[("F.scaled_dot_product_attention == softmax(q k^T s) v",
                         lambda ts: (run(ts)[0][1], attention_manual(ts[0], ts[1], ts[2], causal, scale)[0]))])


def attention_backward(name, dtype, qs, ks, causal, seed):
    g = gen(seed)
    scale = 1.0 / math.sqrt(qs[3])
    q, k, v = uniform(g, qs, dtype), uniform(g, ks, dtype), uniform(g, ks, dtype)
    out, lse = attention_manual(*f64([q, k, v]), causal, scale)

    def run(ts):
        q, k, v = (t.detach().clone().requires_grad_(True) for t in ts[1:4])
        o = sdpa(q, k, v, causal, scale)
        gq, gk, gv = torch.autograd.grad(o, (q, k, v), ts[0].to(o.dtype))
        return [("grad_q", gq), ("grad_k", gk), ("grad_v", gv)]

    return Case(name, "scaled_dot_product_attention_backward", dtype,
                [("grad_out", uniform(g, qs, dtype)), ("q", q), ("k", k), ("v", v),
                 ("out", out.to(torch_dtype(dtype))), ("lse", lse.to(torch.float32))], run,
                attrs={"causal": causal, "scale": scale},
                about="autograd of F.scaled_dot_product_attention, q %s k/v %s, %s; out and lse from the float64 "
                      "forward" % (qs, ks, "causal (bottom-right)" if causal else "not causal"))


# ---- embedding backward and AdamW


def embedding_backward(name, dtype, n, c, vocab, seed):
    g = gen(seed)

    def run(ts):
        w = torch.zeros(vocab, c, dtype=ts[0].dtype, device=ts[0].device, requires_grad=True)
        (gw,) = torch.autograd.grad(F.embedding(ts[1], w), w, ts[0])
        return [("grad_weight", gw)]

    return Case(name, "embedding_backward", dtype,
                [("grad", uniform(g, [n, c], dtype)),
                 ("indices", torch.randint(0, vocab, (n,), generator=g, dtype=torch.int64))], run,
                attrs={"vocab": vocab}, about="autograd of F.embedding: rows summed per index (vocab %d)" % vocab)


def adamw(name, dtype, shape, attrs, seed):
    g = gen(seed)

    def run(ts):
        p = torch.nn.Parameter(ts[0].detach().clone())
        p.grad = ts[1].detach().clone().to(p.dtype)
        opt = torch.optim.AdamW([p], lr=attrs["lr"], betas=(attrs["beta1"], attrs["beta2"]), eps=attrs["eps"],
                                weight_decay=attrs["weight_decay"], foreach=False)
        opt.state[p]["step"] = torch.tensor(float(attrs["step"] - 1))
        opt.state[p]["exp_avg"] = ts[2].detach().clone().to(p.dtype)
        opt.state[p]["exp_avg_sq"] = ts[3].detach().clone().to(p.dtype)
        opt.step()
        return [("param", p.detach()), ("exp_avg", opt.state[p]["exp_avg"]),
                ("exp_avg_sq", opt.state[p]["exp_avg_sq"])]

    def manual(ts):  # Loom's documented formula
        p, gr, m, v = ts
        lr, b1, b2, eps, wd, t = (attrs[x] for x in ("lr", "beta1", "beta2", "eps", "weight_decay", "step"))
        m = b1 * m + (1 - b1) * gr
        v = b2 * v + (1 - b2) * gr * gr
        p = p * (1 - lr * wd) - lr / (1 - b1 ** t) * m / (torch.sqrt(v) / math.sqrt(1 - b2 ** t) + eps)
        return run(ts)[0][1], p

    return Case(name, "adamw_update", dtype,
                [("param", uniform(g, shape, dtype)), ("grad", uniform(g, shape, dtype)),
                 ("exp_avg", uniform(g, shape, "f32", -0.1, 0.1)), ("exp_avg_sq", uniform(g, shape, "f32", 0, 0.01))],
                run, attrs=attrs, about="torch.optim.AdamW.step() from the given moments at step %d" % attrs["step"],
                checks=[("torch.optim.AdamW == Loom's documented formula", manual)])


def all_cases():
    adam = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1, "step": 5}
    return [
        gemm_linear("linear_bias_f32", "f32", 7, 19, 13, 101),
        gemm_linear("linear_bias_bf16", "bf16", 5, 33, 11, 102),
        gemm_matmul("matmul_batched_f32", "f32", 3, 6, 9, 5, 103),
        gemm_padded("gemm_padded_alpha_beta_f32", "f32", 104),
        binary("add_broadcast_f32", "add", "f32", [5, 1, 7], [3, 7], 105),
        binary("mul_strided_bf16", "mul", "bf16", [6, 9], [6, 9], 106, strided=True),
        gelu("gelu_strided_f32", "f32", [4, 37], 107, strided=True),
        gelu("gelu_bf16", "bf16", [3, 5, 7], 108),
        gelu_backward("gelu_backward_f32", "f32", [7, 13], 109),
        softmax("softmax_f32", "f32", [5, 37], -1, 110),
        softmax("softmax_dim1_bf16", "bf16", [3, 11, 4], 1, 111),
        softmax_backward("softmax_backward_f32", "f32", [6, 29], -1, 112),
        layer_norm("layer_norm_f32", "f32", [6, 33], 1e-5, 113),
        layer_norm("layer_norm_bf16", "bf16", [2, 5, 24], 1e-5, 114),
        layer_norm_backward("layer_norm_backward_f32", "f32", [7, 19], 1e-5, 115),
        rms_norm("rms_norm_f32", "f32", [5, 27], 1e-6, 116),
        rms_norm_backward("rms_norm_backward_f32", "f32", [6, 21], 1e-6, 117),
        cross_entropy("cross_entropy_mean_f32", "f32", 9, 31, "mean", 118),
        cross_entropy("cross_entropy_none_bf16", "bf16", 7, 50, "none", 119),
        cross_entropy_backward("cross_entropy_backward_mean_f32", "f32", 9, 31, "mean", 120),
        attention("attention_causal_f32", "f32", [2, 3, 7, 8], [2, 3, 7, 8], True, 121),
        attention("attention_causal_gqa_bf16", "bf16", [1, 4, 5, 16], [1, 2, 9, 16], True, 122),
        attention_backward("attention_backward_causal_gqa_f32", "f32", [2, 2, 6, 8], [2, 1, 6, 8], True, 123),
        embedding_backward("embedding_backward_f32", "f32", 23, 12, 7, 124),
        adamw("adamw_f32", "f32", [3, 41], adam, 125),
        adamw("adamw_bf16", "bf16", [37], dict(adam, step=1, weight_decay=0.0), 126),
    ]


def loom_dtype_name(t):
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float64: "f64", torch.int64: "i64"}[t.dtype]


def flat(t):
    return t.detach().to("cpu", torch.float64).reshape(-1).tolist()


def main():
    global torch, F
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "..", "..", "conformance", "reference"))
    args = parser.parse_args()
    if sys.byteorder != "little":
        sys.exit("this writer assumes a little-endian machine")
    import torch as torch_module
    import torch.nn.functional as functional
    torch, F = torch_module, functional
    torch.backends.cuda.matmul.allow_tf32 = False  # the peer run in f32 stays f32, as Loom's default
    torch.backends.cudnn.allow_tf32 = False
    peer_device = "cuda" if torch.cuda.is_available() else "cpu"
    peer_label = ("cuda (%s)" % torch.cuda.get_device_name(0)) if peer_device == "cuda" else "cpu"

    tensors, described, rows, failed_checks = [], [], [], []
    for case in all_cases():
        ins = [t for _, t in case.inputs]
        ref = case.compute(f64(ins))
        rtol, atol = case.tol
        entry = {"name": case.name, "op": case.op, "dtype": case.dtype, "attrs": case.attrs,
                 "strided": case.strided, "tolerance": {"rtol": rtol, "atol": atol}, "max_mismatch_ratio": 0,
                 "about": case.about, "inputs": [], "outputs": []}
        for role, t in case.inputs:
            name = "%s:in:%s" % (case.name, role)
            tensors.append((name, st_dtype(t), list(t.shape), tensor_bytes(t)))
            entry["inputs"].append({"tensor": name, "role": role, "dtype": loom_dtype_name(t),
                                    "shape": list(t.shape)})
        for role, t in ref:
            name = "%s:ref:%s" % (case.name, role)
            t = t.detach().to("cpu", torch.float64)
            tensors.append((name, "F64", list(t.shape), tensor_bytes(t)))
            entry["outputs"].append({"tensor": name, "role": role, "shape": list(t.shape)})

        # PyTorch's own result in the case's dtype: informative (how far PyTorch itself lands from float64).
        peer = {"device": peer_label, "outputs": []}
        try:
            got = case.compute([t.to(peer_device) for t in ins])
            worst = 0.0
            for (role, t), (_, want) in zip(got, ref):
                t = t.detach().to("cpu")
                if t.dtype not in (torch.float32, torch.bfloat16, torch.float64):
                    t = t.to(torch.float64)
                name = "%s:peer:%s" % (case.name, role)
                tensors.append((name, st_dtype(t), list(t.shape), tensor_bytes(t)))
                peer["outputs"].append(name)
                worst = max(worst, worst_error(flat(t), flat(want), rtol, atol))
            peer["worst_error"] = worst if math.isfinite(worst) else "inf"
        except Exception as e:  # noqa: BLE001 - informative only; the reference stands without it
            peer = {"device": peer_label, "error": "%s: %s" % (type(e).__name__, e)}
        entry["peer"] = peer

        for check in case.checks:
            what, fn = check[0], check[1]
            rtol_c, atol_c = check[2] if len(check) > 2 else (1e-9, 1e-12)
            got, want = fn(f64(ins))
            err = worst_error(flat(got), flat(want), rtol_c, atol_c)
            if not err <= 1:
                failed_checks.append("%s: %s: off by %.3g x (rtol %g, atol %g)" % (case.name, what, err, rtol_c,
                                                                                  atol_c))
        described.append(entry)
        shapes = " ".join("x".join(str(d) for d in t.shape) or "()" for t in ins)
        rows.append((case.name, case.op, case.dtype, shapes,
                     "%.3g" % peer["worst_error"] if isinstance(peer.get("worst_error"), float)
                     else str(peer.get("worst_error", "error"))))

    description = {"format": FORMAT, "generator": "tools/reference/make_conformance_refs.py",
                   "torch_version": torch.__version__, "peer_device": peer_label,
                   "about": "Inputs in each case's dtype and PyTorch's float64 results on them (CPU); 'peer' is "
                            "PyTorch's own result in the case's dtype, informative. Tensors are listed in the Loom "
                            "op's conformance harness order.",
                   "cases": described}
    st_path, json_path = write_reference_set(os.path.normpath(args.out), "pytorch_refs", description, tensors)

    widths = [max(len(r[i]) for r in rows + [("case", "op", "dtype", "inputs", "peer")]) for i in range(5)]
    print("%-*s  %-*s  %-*s  %-*s  %s" % (widths[0], "case", widths[1], "op", widths[2], "dtype", widths[3],
                                          "inputs", "torch %s in dtype (x tolerance)" % peer_label))
    for r in rows:
        print("%-*s  %-*s  %-*s  %-*s  %s" % (widths[0], r[0], widths[1], r[1], widths[2], r[2], widths[3], r[3],
                                              r[4]))
    size = os.path.getsize(st_path)
    print("%d cases, torch %s; wrote %s (%.1f KiB) and %s" % (len(rows), torch.__version__, st_path, size / 1024,
                                                              json_path))
    if size > 2 * 1024 * 1024:
        print("WARNING: the tensor file is over 2 MiB; keep the shapes small")
    if failed_checks:
        print("SELF-CHECKS FAILED (the references may be wrong):")
        for f in failed_checks:
            print("  " + f)
        return 1
    print("self-checks passed (F.linear/matmul vs column-major gemm, SDPA vs manual attention, norms, softmax "
          "backward, AdamW vs formula)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
