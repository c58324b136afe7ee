#!/usr/bin/env python3
"""Thousands of generated conformance cases with PyTorch's float64 results, for every op PyTorch has an equivalent
for: random awkward shapes, every attribute the op's contract takes, and value classes (plain, large, and IEEE
special values -- NaN, +-inf, -0.0, huge -- where the op's contract defines them).

    python3 tools/reference/make_conformance_sweep.py [--per-op 32] [--seed 1] [--out conformance/reference]
    python3 tools/reference/make_conformance_sweep.py --check      (no torch: plans the cases, prints the table)

Each case's inputs are drawn from its own seed in the case's dtype (f32, bf16, f16 or f64; index tensors i64),
stored in that dtype, and PyTorch computes the reference on the CPU in float64 from those stored values (upcast).
It writes pytorch_sweep.safetensors and pytorch_sweep.json in make_conformance_refs.py's format
("loom-pytorch-conformance/1"); `loom-conformance` runs them with the other stored sets (rows "op [pytorch]").
Conventions as make_conformance_refs.py: gemm matrices are stored as their column-major memory [batch, cols, ld];
a stored case's inputs are the op's read arguments in order, its outputs the written ones (gemm: pre_gelu or
bias_grad before C).

Not here: dropout, dropout_backward and random (Loom's Philox stream, which PyTorch does not draw), cat (a list
argument, which a stored case cannot give), and gemm's GELU-derivative epilogue (its pre_gelu is read through an
output slot, which a stored case cannot fill).
"""
import argparse
import collections
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_conformance_refs as refs  # noqa: E402  (imports no torch at module level)

torch = None
F = None

DTYPE_WEIGHTS = [("f32", 0.35), ("bf16", 0.3), ("f16", 0.2), ("f64", 0.15)]
ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "i64": 8, "i32": 4, "i8": 1, "u8": 1, "bool": 1}

# ---------------------------------------------------------------------------------------------------------------
# Plans: pure Python (random.Random), so that --check runs without torch. A plan is a dict: op, dtype, value class,
# sizes and attributes; the builders below turn it into tensors.

UNARY = ["neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "gelu", "silu", "relu"]
UNARY_BACKWARD = ["gelu_backward", "silu_backward", "relu_backward", "tanh_backward", "sigmoid_backward"]
BINARY = ["add", "sub", "mul", "div", "maximum", "minimum"]
SCALAR = {"add_scalar": [0.5, -2.0], "mul_scalar": [0.0, -1.5, 3.0], "div_scalar": [0.5, -3.0],
          "rsub_scalar": [1.0, -2.0], "maximum_scalar": [0.0, 0.3], "minimum_scalar": [0.0, -0.3],
          "pow_scalar": [2.0, 0.5, -1.5, 3.0]}
COMPARE = ["eq", "ne", "lt", "le", "gt", "ge"]
REDUCE = ["sum", "mean", "max", "argmax", "norm"]
# Ops whose contract is IEEE arithmetic (or says what NaN does): they get the special-value class.
SPECIAL_OK = set(UNARY + BINARY + list(SCALAR) + COMPARE + ["where", "copy", "sum", "mean", "max", "argmax",
                                                             "softmax", "log_softmax", "add_scaled"])
# Ops where large values test a stable formulation (max subtraction, statistics in float64).
LARGE_OK = set(UNARY + BINARY + ["softmax", "log_softmax", "cross_entropy", "cross_entropy_with_grad", "layer_norm",
                                 "rms_norm", "residual_layer_norm", "residual_rms_norm", "sum", "mean", "norm",
                                 "max", "argmax", "add_scaled", "swiglu"])
OPS = (UNARY + UNARY_BACKWARD + BINARY + list(SCALAR) + COMPARE + REDUCE +
       ["add_scaled", "swiglu", "swiglu_backward", "where", "softmax", "log_softmax", "softmax_backward",
        "log_softmax_backward", "column_sums", "grad_norm_squared", "cross_entropy", "cross_entropy_backward",
        "cross_entropy_with_grad", "cross_entropy_scale_grad", "layer_norm", "layer_norm_backward", "rms_norm",
        "rms_norm_backward", "residual_layer_norm", "residual_layer_norm_backward", "residual_rms_norm",
        "residual_rms_norm_backward", "scaled_dot_product_attention", "scaled_dot_product_attention_strided",
        "scaled_dot_product_attention_backward", "scaled_dot_product_attention_backward_strided", "rope",
        "rope_strided", "embedding", "embedding_backward", "gemm", "copy", "fill", "arange", "index_select",
        "gather", "scatter_add", "triangular", "adamw_update", "sgd_update"])
NOT_COVERED = {"dropout": "Loom's Philox stream", "dropout_backward": "Loom's Philox stream",
               "random": "Loom's Philox stream", "cat": "a list argument (a stored case gives one tensor a slot)"}


def pick_dtype(r):
    x, acc = r.random(), 0.0
    for name, w in DTYPE_WEIGHTS:
        acc += w
        if x < acc:
            return name
    return DTYPE_WEIGHTS[-1][0]


def size(r, hi, lo=1):
    """An awkward size: mostly small primes and odd numbers, sometimes 1 or the bound."""
    return r.choice([lo, lo, r.randint(lo, hi), r.randint(lo, hi), r.randint(lo, hi), hi])


def plan_case(op, index, r):
    p = {"op": op, "dtype": pick_dtype(r), "cls": "plain", "seed": r.getrandbits(31), "strided": r.random() < 0.5,
         "attrs": {}}
    roll = r.random()
    if op in SPECIAL_OK and roll < 0.3:
        p["cls"] = "special"
    elif op in LARGE_OK and roll < 0.45:
        p["cls"] = "large"
    a = p["attrs"]
    if op in UNARY + UNARY_BACKWARD + BINARY + COMPARE + list(SCALAR) + ["add_scaled", "where", "copy", "fill",
                                                                        "triangular", "swiglu"]:
        p["shape"] = [size(r, 4), size(r, 7), size(r, 13)]
    if op in BINARY + COMPARE + ["add_scaled"]:
        p["bshape"] = r.choice(["same", "same", "row", "col", "scalar", "lower"])
    if op in SCALAR:
        a["value"] = r.choice(SCALAR[op] + [round(r.uniform(-3, 3), 3)])
        if op == "pow_scalar" and p["cls"] != "special":
            a["value"] = r.choice(SCALAR[op])
    if op == "add_scaled":
        a["alpha"] = r.choice([1.0, -0.5, 2.5, round(r.uniform(-4, 4), 3)])
    if op == "copy":
        p["dst"] = p["dtype"] if r.random() < 0.3 else r.choice(["f32", "bf16", "f16", "f64", "i32", "i64", "i8", "u8",
                                                                  "bool"])
        p["dtype"] = r.choice(["f32", "bf16", "f16", "f64"])  # the source's
        if p["dst"] not in ("f32", "bf16", "f16", "f64") and p["cls"] == "special":
            p["cls"] = "plain"  # NaN or inf has no integer value
    if op == "fill":
        a["value"] = r.choice([0.0, -1.5, 3.0, round(r.uniform(-100, 100), 4)])
    if op == "arange":
        p["n"] = size(r, 40)
        a["start"], a["step"] = r.choice([0.0, -3.0, 2.5]), r.choice([1.0, 0.5, -2.0, 0.1])
    if op == "triangular":
        a["diagonal"], a["upper"] = r.choice([0, 1, -2, 3, -5]), r.choice([True, False])
    if op in ("swiglu_backward",):
        p["shape"] = [size(r, 9), size(r, 17)]
    if op in ("softmax", "log_softmax", "softmax_backward", "log_softmax_backward"):
        p["shape"] = [size(r, 4), size(r, 6), size(r, 33)]
        a["dim"] = r.choice([2, 2, 1, 0])
    if op in REDUCE:
        p["shape"] = [size(r, 4), size(r, 6), size(r, 17)]
        if op == "argmax":
            a["dims"] = [r.choice([0, 1, 2, 2])]
        else:
            a["dims"] = r.choice([[2], [0], [1], [0, 1], [1, 2], [0, 2], [0, 1, 2]])
        a["keepdim"] = r.random() < 0.4
    if op == "column_sums":
        p["shape"] = [size(r, 40), size(r, 20)]
    if op == "grad_norm_squared":
        p["n"] = size(r, 100)
    if op.startswith("cross_entropy"):
        n, v = size(r, 12), size(r, 40, 2)
        p["shape"] = [n, v]
        if op != "cross_entropy_scale_grad":
            limit = r.choice([-1, -1, v - r.randint(0, v - 1)])
            a["vocab_limit"] = limit
            classes = v if limit < 0 else limit
            a["ignore_index"] = r.choice([-100, -100, r.randint(0, classes - 1)])
            reductions = ["mean", "sum"] if op == "cross_entropy_with_grad" else ["mean", "sum", "none"]
            a["reduction"] = r.choice(reductions)
    if op in ("layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward", "residual_layer_norm",
              "residual_rms_norm", "residual_layer_norm_backward", "residual_rms_norm_backward"):
        # A backward's rows hold 4 columns or more: over 1 or 2 columns the layer norm's output hardly depends on x,
        # so its gradient is a cancellation to almost 0 that no float arithmetic computes to a relative tolerance
        # (the generated cases cover those sizes with independent statistics).
        p["shape"] = [size(r, 9), size(r, 65, 4 if "backward" in op else 1)]
        a["eps"] = r.choice([1e-5, 0.1, 1e-6])
        if op in ("layer_norm", "rms_norm"):
            p["affine"] = r.choice(["none", "weight", "both"] if op == "layer_norm" else ["none", "weight"])
    if op.startswith("scaled_dot_product_attention"):
        hkv, group = size(r, 3), size(r, 3)
        # Two keys or more for a backward: over one key the softmax is constant, grad_q is exactly 0, and float64's
        # rounding noise is all a reference would hold.
        s = size(r, 12, 2 if "backward" in op else 1)
        causal = r.random() < 0.6
        t = size(r, s) if causal else size(r, 12)
        p["q"] = [size(r, 2), hkv * group, t, r.choice([1, 2, 4, 8, 16, 5])]
        p["kv"] = [p["q"][0], hkv, s, p["q"][3]]
        a["causal"] = causal
        a["scale"] = r.choice([1 / math.sqrt(p["q"][3]), 0.125, 0.3, 1.0])
    if op.startswith("rope"):
        p["x"] = [size(r, 2), size(r, 3), size(r, 7), 2 * size(r, 8)]
        a["inverse"] = r.random() < 0.5
    if op.startswith("embedding"):
        p["v"], p["c"], p["n"] = size(r, 20), size(r, 12), size(r, 15)
    if op == "index_select":
        p["shape"] = [size(r, 4), size(r, 6), size(r, 9)]
        a["dim"] = r.choice([0, 1, 2])
        p["j"] = size(r, 8)
    if op in ("gather", "scatter_add"):
        p["shape"] = [size(r, 4), size(r, 6), size(r, 9)]
        a["dim"] = r.choice([2, 2, 0, 1])
        p["j"] = r.randint(1, p["shape"][2])
    if op == "gemm":
        e = r.choice([0, 0, 1, 2, 3, 4])
        m, n, k, batch = size(r, 19), size(r, 19), size(r, 23), r.choice([1, 1, 2, 3])
        ta, tb = r.random() < 0.5, r.random() < 0.5
        alpha, beta = r.choice([1.0, -0.5, 1.7]), r.choice([0.0, 0.0, 1.0, 0.75])
        if e == 4:
            tb, alpha, batch = True, 1.0, 1
        a.update({"m": m, "n": n, "k": k, "trans_a": ta, "trans_b": tb, "alpha": alpha, "beta": beta,
                  "epilogue": e})
        p["batch"] = batch
        p["pad"] = r.choice([0, 0, 3]) if e != 4 else 0
        if e == 4:
            p["dtype"] = r.choice(["f32", "bf16", "f64"])
    if op == "adamw_update":
        p["n"] = size(r, 70)
        a.update({"lr": r.choice([1e-3, 0.1, 3e-4]), "beta1": r.choice([0.9, 0.8]), "beta2": r.choice([0.999, 0.95]),
                  "eps": r.choice([1e-8, 1e-6]), "weight_decay": r.choice([0.0, 0.1]), "step": r.choice([1, 2, 7, 100])})
        p["grad_dtype"] = r.choice([p["dtype"], "f32", "bf16"])
    if op == "sgd_update":
        p["n"] = size(r, 70)
        a.update({"lr": r.choice([1e-2, 0.5]), "momentum": r.choice([0.0, 0.9, 0.5]),
                  "weight_decay": r.choice([0.0, 0.1]), "first_step": r.random() < 0.3})
        p["grad_dtype"] = r.choice([p["dtype"], "f32", "bf16"])
    if op == "where":
        p["bshape"] = r.choice(["same", "row", "col"])
    p["name"] = "%s.%d.%s.%s" % (op, index, p["dtype"] if op != "copy" else p["dtype"] + "-" + p["dst"], p["cls"])
    return p


def plan_all(per_op, seed):
    r = random.Random(seed)
    plans = []
    for op in OPS:
        for k in range(per_op):
            plans.append(plan_case(op, k, r))
    return plans


# ---------------------------------------------------------------------------------------------------------------
# Builders (torch): each returns (inputs [(role, tensor in its stored dtype)], outputs [(role, float64 tensor)]).

def tdt(name):
    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64,
            "i64": torch.int64, "i32": torch.int32, "i8": torch.int8, "u8": torch.uint8, "bool": torch.bool}[name]


class Draw:
    def __init__(self, plan):
        self.g = torch.Generator()
        self.g.manual_seed(plan["seed"])
        self.plan = plan
        self.dt = plan["dtype"]

    def u(self, shape, lo=-1.0, hi=1.0, dtype=None, special=None):
        """Uniform in [lo, hi), in the stored dtype; the plan's value class scales or sprinkles special values."""
        dtype = dtype or self.dt
        x = torch.rand(tuple(shape), generator=self.g, dtype=torch.float64) * (hi - lo) + lo
        cls = self.plan["cls"]
        if cls == "large":
            x = x * 300.0 if dtype in ("f16",) else x * 3000.0
        if cls == "special" and special is not False and x.numel():
            huge = 6e4 if dtype == "f16" else 1e30
            values = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-30]
            if self.plan["op"] not in ("sum", "mean"):  # huge terms that cancel leave a sum only its rounding
                values += [huge, -huge]
            pool = torch.tensor(values, dtype=torch.float64)
            mask = torch.rand(tuple(shape), generator=self.g, dtype=torch.float64) < 0.25
            picks = pool[torch.randint(0, len(pool), tuple(shape), generator=self.g)]
            x = torch.where(mask, picks, x)
        return x.to(tdt(dtype))

    def idx(self, shape, bound):
        return torch.randint(0, bound, tuple(shape), generator=self.g, dtype=torch.int64)


def up(t):
    return t.to(torch.float64) if t.is_floating_point() else t


def b_shape(shape, kind):
    if kind == "row":
        return [1, 1, shape[2]]
    if kind == "col":
        return [shape[0], shape[1], 1]
    if kind == "scalar":
        return [1]
    if kind == "lower":
        return shape[1:]
    return list(shape)


def gelu_t(x):
    return F.gelu(x, approximate="tanh")


def unary_ref(op, x):
    return {"neg": lambda: -x, "abs": lambda: torch.abs(x), "exp": lambda: torch.exp(x), "log": lambda: torch.log(x),
            "sqrt": lambda: torch.sqrt(x), "rsqrt": lambda: torch.rsqrt(x), "tanh": lambda: torch.tanh(x),
            "sigmoid": lambda: torch.sigmoid(x), "gelu": lambda: gelu_t(x), "silu": lambda: F.silu(x),
            "relu": lambda: torch.relu(x)}[op]()


def binary_ref(op, a, b):
    fn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
          "minimum": torch.minimum, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le,
          "gt": torch.gt, "ge": torch.ge}[op]
    return fn(a, b)


def unary_backward_ref(op, grad, saved):
    aten = torch.ops.aten
    if op == "gelu_backward":
        return aten.gelu_backward(grad, saved, approximate="tanh")
    if op == "silu_backward":
        return aten.silu_backward(grad, saved)
    if op == "relu_backward":
        return aten.threshold_backward(grad, saved, 0)
    if op == "tanh_backward":
        return aten.tanh_backward(grad, saved)
    return aten.sigmoid_backward(grad, saved)


def scalar_ref(op, x, v):
    return {"add_scalar": lambda: x + v, "mul_scalar": lambda: x * v, "div_scalar": lambda: x / v,
            "rsub_scalar": lambda: v - x, "maximum_scalar": lambda: torch.clamp_min(x, v),
            "minimum_scalar": lambda: torch.clamp_max(x, v), "pow_scalar": lambda: torch.pow(x, v)}[op]()


def ln_ref(x, w, b, eps, centered):
    mean = x.mean(-1) if centered else torch.zeros(x.shape[:-1], dtype=x.dtype)
    xc = x - mean.unsqueeze(-1)
    var = (xc * xc).mean(-1)
    rstd = 1 / torch.sqrt(var + eps)
    out = xc * rstd.unsqueeze(-1)
    if w is not None:
        out = out * w
    if b is not None:
        out = out + b
    return out, mean, rstd


def norm_backward_ref(grad, x, w, mean, rstd, centered):
    """The norm backward's contract in float64 from the statistics it is given (mean, rstd: what the op reads, rounded
    to their stored dtype), not recomputed ones: (grad_input, grad_weight, grad_bias)."""
    xhat = (x - mean.unsqueeze(-1) if centered else x) * rstd.unsqueeze(-1)
    gw = grad * w
    centered_gw = gw - gw.mean(-1, keepdim=True) if centered else gw
    grad_input = rstd.unsqueeze(-1) * (centered_gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    return grad_input, (grad * xhat).sum(0), grad.sum(0)


def checked_against_autograd(grads, x, w, eps, centered, grad, what):
    """The contract's formula (with exact statistics) against PyTorch's own gradient of F.layer_norm / F.rms_norm."""
    _, mean, rstd = ln_ref(x, None, None, eps, centered)
    formula = norm_backward_ref(grad, x, w, mean, rstd, centered)
    for got, want in zip(formula, grads):
        scale = max(float(want.abs().max()), 1e-300)
        if float((got - want).abs().max()) > 1e-9 * scale + 1e-12:
            raise AssertionError("%s: the backward formula disagrees with autograd" % what)


def norm_fn(x, w, b, eps, centered):
    if centered:
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return ln_ref(x, w, None, eps, False)[0]


def stats_dtype(dt):
    return "f64" if dt == "f64" else "f32"


def colmajor(s, rows):
    return s[:, :, :rows].transpose(1, 2)


def build(p):
    """Returns (inputs, outputs, attrs, case dtype name) for plan p."""
    op, a, d = p["op"], dict(p["attrs"]), Draw(p)
    dt = p["dtype"]
    if op in UNARY:
        lo, hi = (0.05, 3.0) if op in ("log", "sqrt", "rsqrt") else (-4.0, 4.0)
        x = d.u(p["shape"], lo, hi)
        return [("x", x)], [("out", unary_ref(op, up(x)))], a, dt
    if op in UNARY_BACKWARD:
        grad = d.u(p["shape"])
        if op in ("tanh_backward", "sigmoid_backward"):  # saved is the forward's output
            fn = torch.tanh if op == "tanh_backward" else torch.sigmoid
            saved = fn(up(d.u(p["shape"], -3, 3))).to(tdt(dt))
        else:
            saved = d.u(p["shape"], -4, 4)
        return [("grad", grad), ("saved", saved)], [("grad_x", unary_backward_ref(op, up(grad), up(saved)))], a, dt
    if op in BINARY + COMPARE + ["add_scaled"]:
        x = d.u(p["shape"], -2, 2)
        y = d.u(b_shape(p["shape"], p["bshape"]), -2, 2)
        if op in COMPARE and p["cls"] == "plain":  # values on a coarse grid, so that ties happen
            x, y = (torch.round(up(t) * 2) / 2 for t in (x, y))
            x, y = x.to(tdt(dt)), y.to(tdt(dt))
        if op == "div" and p["cls"] == "plain":
            y = (torch.sign(up(y)) * (0.5 + up(y).abs())).to(tdt(dt))
        if op == "add_scaled":
            out = up(x) + a["alpha"] * up(y)
        else:
            out = binary_ref(op, up(x), up(y))
        return [("a", x), ("b", y)], [("out", up(out))], a, dt
    if op in SCALAR:
        lo, hi = (0.05, 3.0) if op == "pow_scalar" else (-3.0, 3.0)
        x = d.u(p["shape"], lo, hi)
        return [("x", x)], [("out", scalar_ref(op, up(x), a["value"]))], a, dt
    if op == "where":
        cond = torch.rand(tuple(b_shape(p["shape"], p["bshape"])), generator=d.g) < 0.5
        x, y = d.u(p["shape"]), d.u(b_shape(p["shape"], p["bshape"]))
        return [("cond", cond), ("a", x), ("b", y)], [("out", torch.where(cond, up(x), up(y)))], a, dt
    if op == "swiglu":
        gate, upv = d.u(p["shape"], -4, 4), d.u(p["shape"])
        return [("gate", gate), ("up", upv)], [("out", F.silu(up(gate)) * up(upv))], a, dt
    if op == "swiglu_backward":
        grad, gate, upv = d.u(p["shape"]), d.u(p["shape"], -4, 4), d.u(p["shape"])
        gg, uu = up(gate).requires_grad_(True), up(upv).requires_grad_(True)
        g_gate, g_up = torch.autograd.grad(F.silu(gg) * uu, (gg, uu), up(grad))
        return [("grad", grad), ("gate", gate), ("up", upv)], [("grad_gate", g_gate), ("grad_up", g_up)], a, dt
    if op in ("softmax", "log_softmax"):
        x = d.u(p["shape"], -4, 4)
        fn = torch.softmax if op == "softmax" else torch.log_softmax
        return [("x", x)], [("out", fn(up(x), a["dim"]))], a, dt
    if op in ("softmax_backward", "log_softmax_backward"):
        x = up(d.u(p["shape"], -4, 4))
        grad = d.u(p["shape"])
        if op == "softmax_backward":
            out = torch.softmax(x, a["dim"]).to(tdt(dt))
            ref = torch._softmax_backward_data(up(grad), up(out), a["dim"], torch.float64)
        else:
            out = torch.log_softmax(x, a["dim"]).to(tdt(dt))
            ref = torch._log_softmax_backward_data(up(grad), up(out), a["dim"], torch.float64)
        return [("grad", grad), ("out", out)], [("grad_input", ref)], a, dt
    if op in REDUCE:
        x = d.u(p["shape"], -2, 2)
        dims, keep = a["dims"], a["keepdim"]
        xx = up(x)
        if op == "sum":
            out = xx.sum(dims, keepdim=keep)
        elif op == "mean":
            out = xx.mean(dims, keepdim=keep)
        elif op == "max":
            out = torch.amax(xx, dims, keepdim=keep)
        elif op == "argmax":
            out = torch.argmax(xx, dims[0], keepdim=keep).to(torch.float64)
        else:
            out = torch.linalg.vector_norm(xx, 2, dims, keepdim=keep)
        return [("x", x)], [("out", out)], a, dt
    if op == "column_sums":
        m = d.u(p["shape"])
        return [("matrix", m)], [("out", up(m).sum(0))], a, dt
    if op == "grad_norm_squared":
        x = d.u([p["n"]], -3, 3)
        return [("x", x)], [("out", (up(x) ** 2).sum().reshape(1))], a, dt
    if op.startswith("cross_entropy"):
        n, v = p["shape"]
        if op == "cross_entropy_scale_grad":
            scale = d.u([1], 0.5, 2.0, dtype=stats_dtype(dt), special=False)
            gl = d.u([n, v])
            return [("scale", scale), ("grad_logits", gl)], [("grad_logits", up(gl) * up(scale))], a, dt
        limit, ignore, red = a["vocab_limit"], a["ignore_index"], a["reduction"]
        classes = v if limit < 0 else limit
        logits = d.u([n, v], -3, 3)
        t = d.idx([n], classes)
        if ignore < 0:
            t[torch.rand(n, generator=d.g) < 0.2] = ignore
        lg = up(logits).requires_grad_(True)
        loss = F.cross_entropy(lg[:, :classes], t, ignore_index=ignore, reduction=red)
        if op == "cross_entropy":
            return [("logits", logits), ("targets", t)], [("loss", loss.detach())], a, dt
        if op == "cross_entropy_with_grad":
            (g,) = torch.autograd.grad(loss, lg)
            return [("logits", logits), ("targets", t)], [("loss", loss.detach()), ("grad_logits", g)], a, dt
        gl = d.u([n] if red == "none" else [], 0.5, 1.5, dtype=stats_dtype(dt), special=False)
        (g,) = torch.autograd.grad(loss, lg, up(gl))
        return [("grad_loss", gl), ("logits", logits), ("targets", t)], [("grad_logits", g)], a, dt
    if op in ("layer_norm", "rms_norm"):
        rows, c = p["shape"]
        centered = op == "layer_norm"
        x = d.u([rows, c], -2, 2)
        if p["cls"] == "large":
            # A common offset 100 times the spread: two-pass statistics (mean, then centered squares) keep it in f32,
            # a one-pass E[x^2] - E[x]^2 loses it. (An offset a million times the spread is beyond f32 arithmetic.)
            x = (up(d.u([rows, c], -1, 1)) + 100.0).to(tdt(dt)) if dt != "f16" else x
        w = d.u([c], 0.5, 1.5) if p["affine"] != "none" else None
        b = d.u([c], -0.5, 0.5) if p["affine"] == "both" else None
        out, mean, rstd = ln_ref(up(x), None if w is None else up(w), None if b is None else up(b), a["eps"],
                                 centered)
        ins = [("x", x)] + ([("weight", w)] if w is not None else []) + ([("bias", b)] if b is not None else [])
        outs = [("out", out)] + ([("mean", mean)] if centered else []) + [("rstd", rstd)]
        # F.layer_norm / F.rms_norm are the reference; the manual statistics only give mean and rstd.
        outs[0] = ("out", norm_fn(up(x), None if w is None else up(w), None if b is None else up(b), a["eps"],
                                  centered))
        return ins, outs, a, dt
    if op in ("layer_norm_backward", "rms_norm_backward"):
        rows, c = p["shape"]
        centered = op == "layer_norm_backward"
        x, w, grad = d.u([rows, c], -2, 2), d.u([c], 0.5, 1.5), d.u([rows, c])
        _, mean, rstd = ln_ref(up(x), None, None, a["eps"], centered)
        xx, ww = up(x).requires_grad_(True), up(w).requires_grad_(True)
        bb = torch.zeros(c, dtype=torch.float64, requires_grad=True)
        wrt = (xx, ww, bb) if centered else (xx, ww)
        grads = torch.autograd.grad(norm_fn(xx, ww, bb if centered else None, a["eps"], centered), wrt, up(grad))
        checked_against_autograd(grads, up(x), up(w), a["eps"], centered, up(grad), op)
        st = tdt(stats_dtype(dt))
        mean_s, rstd_s = mean.to(st), rstd.to(st)
        ref = norm_backward_ref(up(grad), up(x), up(w), up(mean_s), up(rstd_s), centered)
        names = ["grad_input", "grad_weight", "grad_bias"][:3 if centered else 2]
        ins = [("grad", grad), ("x", x), ("weight", w)] + ([("mean", mean_s)] if centered else []) + [("rstd", rstd_s)]
        return ins, list(zip(names, ref)), a, dt
    if op in ("residual_layer_norm", "residual_rms_norm"):
        rows, c = p["shape"]
        centered = op == "residual_layer_norm"
        x, delta = d.u([rows, c], -2, 2), d.u([rows, c], -1, 1)
        w, b = d.u([c], 0.5, 1.5), d.u([c], -0.5, 0.5)
        residual = (up(x) + up(delta)).to(tdt(dt))  # rounded to x's dtype before it is normalized
        out = norm_fn(up(residual), up(w), up(b) if centered else None, a["eps"], centered)
        _, mean, rstd = ln_ref(up(residual), None, None, a["eps"], centered)
        ins = [("x", x), ("delta", delta), ("weight", w)] + ([("bias", b)] if centered else [])
        outs = [("residual", up(residual)), ("out", out)] + ([("mean", mean)] if centered else []) + [("rstd", rstd)]
        return ins, outs, a, dt
    if op in ("residual_layer_norm_backward", "residual_rms_norm_backward"):
        rows, c = p["shape"]
        centered = op == "residual_layer_norm_backward"
        grad_out, grad_res = d.u([rows, c]), d.u([rows, c])
        residual, w = d.u([rows, c], -2, 2), d.u([c], 0.5, 1.5)
        _, mean, rstd = ln_ref(up(residual), None, None, a["eps"], centered)
        rr, ww = up(residual).requires_grad_(True), up(w).requires_grad_(True)
        bb = torch.zeros(c, dtype=torch.float64, requires_grad=True)
        wrt = (rr, ww, bb) if centered else (rr, ww)
        grads = torch.autograd.grad(norm_fn(rr, ww, bb if centered else None, a["eps"], centered), wrt, up(grad_out))
        checked_against_autograd(grads, up(residual), up(w), a["eps"], centered, up(grad_out), op)
        st = tdt(stats_dtype(dt))
        mean_s, rstd_s = mean.to(st), rstd.to(st)
        ref = norm_backward_ref(up(grad_out), up(residual), up(w), up(mean_s), up(rstd_s), centered)
        gx = ref[0] + up(grad_res)
        ins = [("grad_out", grad_out), ("grad_residual", grad_res), ("residual", residual), ("weight", w)]
        ins += ([("mean", mean_s)] if centered else []) + [("rstd", rstd_s)]
        outs = [("grad_x", gx), ("grad_delta", gx), ("grad_weight", ref[1])] + (
            [("grad_bias", ref[2])] if centered else [])
        return ins, outs, a, dt
    if op.startswith("scaled_dot_product_attention"):
        q, k, v = d.u(p["q"]), d.u(p["kv"]), d.u(p["kv"])
        causal, scale = a["causal"], a["scale"]
        if "backward" not in op:
            out, lse = attention_ref(up(q), up(k), up(v), causal, scale)
            return [("q", q), ("k", k), ("v", v)], [("out", out), ("lse", lse)], a, dt
        out, lse = attention_ref(up(q), up(k), up(v), causal, scale)
        out_s, lse_s = out.to(tdt(dt)), lse.to(tdt(stats_dtype(dt)))
        grad = d.u(p["q"])
        qq, kk, vv = (up(t).requires_grad_(True) for t in (q, k, v))
        o = sdpa_ref(qq, kk, vv, causal, scale)
        grads = torch.autograd.grad(o, (qq, kk, vv), up(grad))
        # The contract's formula with the exact forward outputs is PyTorch's own gradient; the reference takes the
        # stored (rounded) ones, which the op reads.
        exact = attention_backward_ref(up(grad), up(q), up(k), up(v), out, lse, causal, scale)
        for got, want in zip(exact, grads):
            if float((got - want).abs().max()) > 1e-9 * max(float(want.abs().max()), 1e-300) + 1e-12:
                raise AssertionError("%s: the backward formula disagrees with autograd" % op)
        gq, gk, gv = attention_backward_ref(up(grad), up(q), up(k), up(v), up(out_s), up(lse_s), causal, scale)
        return ([("grad_out", grad), ("q", q), ("k", k), ("v", v), ("out", out_s), ("lse", lse_s)],
                [("grad_q", gq), ("grad_k", gk), ("grad_v", gv)], a, dt)
    if op.startswith("rope"):
        B, H, T, D = p["x"]
        x = d.u(p["x"])
        angle = torch.rand(T, D // 2, generator=d.g, dtype=torch.float64) * 2 * math.pi
        cos, sin = torch.cos(angle).to(torch.float32), torch.sin(angle).to(torch.float32)
        s = -up(sin) if a["inverse"] else up(sin)
        cos_full, sin_full = torch.cat([up(cos), up(cos)], -1), torch.cat([s, s], -1)
        xx = up(x)
        rotated = torch.cat([-xx[..., D // 2:], xx[..., :D // 2]], -1)  # transformers' rotate_half
        return [("x", x), ("cos", cos), ("sin", sin)], [("out", xx * cos_full + rotated * sin_full)], a, dt
    if op == "embedding":
        w, ids = d.u([p["v"], p["c"]]), d.idx([p["n"]], p["v"])
        return [("weight", w), ("indices", ids)], [("out", F.embedding(ids, up(w)))], a, dt
    if op == "embedding_backward":
        grad, ids = d.u([p["n"], p["c"]]), d.idx([p["n"]], p["v"])
        w = torch.zeros(p["v"], p["c"], dtype=torch.float64, requires_grad=True)
        (gw,) = torch.autograd.grad(F.embedding(ids, w), w, up(grad))
        a["v"] = p["v"]
        return [("grad", grad), ("indices", ids)], [("grad_weight", gw)], a, dt
    if op == "copy":
        src = d.u(p["shape"], 0 if p["dst"] in ("u8", "bool") else -100, 100, special=None)
        if p["dst"] == "bool":
            src = (torch.round(up(src) / 60) * up(src)).to(tdt(dt))  # zeros too
        ref = up(src).to(tdt(p["dst"])).to(torch.float64)
        return [("src", src)], [("dst", ref)], a, p["dst"]
    if op == "fill":
        return [], [("out", torch.full(p["shape"], a["value"], dtype=tdt(dt)).to(torch.float64))], a, dt
    if op == "arange":
        ref = (a["start"] + a["step"] * torch.arange(p["n"], dtype=torch.float64)).to(tdt(dt)).to(torch.float64)
        return [], [("out", ref)], a, dt
    if op == "index_select":
        x = d.u(p["shape"])
        ids = d.idx([p["j"]], p["shape"][a["dim"]])
        return [("x", x), ("index", ids)], [("out", torch.index_select(up(x), a["dim"], ids))], a, dt
    if op == "gather":
        x = d.u(p["shape"])
        ishape = p["shape"][:2] + [p["j"]]
        ids = d.idx(ishape, p["shape"][a["dim"]])
        return [("x", x), ("index", ids)], [("out", torch.gather(up(x), a["dim"], ids))], a, dt
    if op == "scatter_add":
        shape = p["shape"]
        ishape = shape[:2] + [p["j"]]
        ids, src, out = d.idx(ishape, shape[a["dim"]]), d.u(ishape), d.u(shape)
        return ([("index", ids), ("src", src), ("out", out)],
                [("out", torch.scatter_add(up(out), a["dim"], ids, up(src)))], a, dt)
    if op == "triangular":
        x = d.u(p["shape"])
        fn = torch.triu if a["upper"] else torch.tril
        return [("x", x)], [("out", fn(up(x), a["diagonal"]))], a, dt
    if op == "gemm":
        return gemm_case(p, d, a)
    if op == "adamw_update":
        n = p["n"]
        param, grad = d.u([n]), d.u([n], dtype=p["grad_dtype"])
        st = stats_dtype(dt)
        m0, v0 = d.u([n], -0.1, 0.1, dtype=st), d.u([n], 0, 0.01, dtype=st)
        pp = torch.nn.Parameter(up(param).clone())
        pp.grad = up(grad).clone()
        opt = torch.optim.AdamW([pp], lr=a["lr"], betas=(a["beta1"], a["beta2"]), eps=a["eps"],
                                weight_decay=a["weight_decay"], foreach=False)
        opt.state[pp]["step"] = torch.tensor(float(a["step"] - 1), dtype=torch.float64)
        opt.state[pp]["exp_avg"], opt.state[pp]["exp_avg_sq"] = up(m0).clone(), up(v0).clone()
        opt.step()
        return ([("param", param), ("grad", grad), ("exp_avg", m0), ("exp_avg_sq", v0)],
                [("param", pp.detach()), ("exp_avg", opt.state[pp]["exp_avg"]),
                 ("exp_avg_sq", opt.state[pp]["exp_avg_sq"])], a, dt)
    if op == "sgd_update":
        n = p["n"]
        param, grad = d.u([n]), d.u([n], dtype=p["grad_dtype"])
        buf = d.u([n], dtype=stats_dtype(dt))
        pp = torch.nn.Parameter(up(param).clone())
        pp.grad = up(grad).clone()
        opt = torch.optim.SGD([pp], lr=a["lr"], momentum=a["momentum"], weight_decay=a["weight_decay"],
                              foreach=False)
        if a["momentum"] != 0 and not a["first_step"]:
            opt.state[pp]["momentum_buffer"] = up(buf).clone()
        opt.step()
        ins = [("param", param), ("grad", grad)]
        outs = [("param", pp.detach())]
        if a["momentum"] != 0:
            ins.append(("momentum_buffer", buf))
            outs.append(("momentum_buffer", opt.state[pp]["momentum_buffer"]))
        return ins, outs, a, dt
    raise ValueError("no builder for " + op)


def sdpa_ref(q, k, v, causal, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    mask = None
    if causal:
        t = torch.arange(q.shape[2]).unsqueeze(1)
        s = torch.arange(k.shape[2]).unsqueeze(0)
        mask = s <= t + (k.shape[2] - q.shape[2])  # the last query sees the last key
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def attention_backward_ref(grad, q, k, v, out, lse, causal, scale):
    """The attention backward's contract in float64 from the forward's outputs it is given (out and lse, rounded to
    their stored dtypes), as FlashAttention's backward reads them: P = exp(scale q k^T - lse), dV = P^T dO,
    dS = P (dO v^T - rowsum(dO out)), dQ = scale dS k, dK = scale dS^T q; a group's heads summed for dK and dV."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, kk.transpose(-1, -2)) * scale
    if causal:
        t = torch.arange(q.shape[2]).unsqueeze(1)
        s = torch.arange(k.shape[2]).unsqueeze(0)
        scores = scores.masked_fill(~(s <= t + (k.shape[2] - q.shape[2])), float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1))
    ds = p * (torch.matmul(grad, vv.transpose(-1, -2)) - (grad * out).sum(-1, keepdim=True))
    gq = scale * torch.matmul(ds, kk)
    gk = scale * torch.matmul(ds.transpose(-1, -2), q)
    gv = torch.matmul(p.transpose(-1, -2), grad)
    b, h, s_len, d = gk.shape
    fold = lambda t: t.view(b, h // rep, rep, s_len, d).sum(2)  # noqa: E731 - the group's heads
    return gq, fold(gk), fold(gv)


def attention_ref(q, k, v, causal, scale):
    out = sdpa_ref(q, k, v, causal, scale)
    rep = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, kk.transpose(-1, -2)) * scale
    if causal:
        t = torch.arange(q.shape[2]).unsqueeze(1)
        s = torch.arange(k.shape[2]).unsqueeze(0)
        scores = scores.masked_fill(~(s <= t + (k.shape[2] - q.shape[2])), float("-inf"))
    return out, torch.logsumexp(scores, dim=-1)


def gemm_case(p, d, a):
    """Column-major: C[m x n] = alpha op(A) op(B) + beta C (+ bias[i]; GELU; or the bias gradient of B). Each
    matrix is stored as its memory [batch, cols, ld], padding rows NaN."""
    dt, batch, pad = p["dtype"], p["batch"], p["pad"]
    m, n, k, ta, tb, e = a["m"], a["n"], a["k"], a["trans_a"], a["trans_b"], a["epilogue"]

    def stored(rows, cols, dense=False):
        s = d.u([batch, cols, rows + (0 if dense else pad)])
        if pad and not dense:
            s[:, :, rows:] = float("nan")
        return s

    A = stored(k if ta else m, m if ta else k)
    B = stored(n if tb else k, k if tb else n, dense=e == 4)
    bias = d.u([m])
    C0 = stored(m, n)
    opa = colmajor(up(A), k if ta else m)
    opa = opa.transpose(1, 2) if ta else opa
    opb = colmajor(up(B), n if tb else k)
    opb = opb.transpose(1, 2) if tb else opb
    c = a["alpha"] * torch.matmul(opa, opb)
    if a["beta"] != 0:
        c = c + a["beta"] * colmajor(up(C0), m)
    if e in (1, 3):
        c = c + up(bias).view(1, m, 1)
    pre = c
    if e in (2, 3):
        c = gelu_t(c)

    def memory(x):  # [batch, m, n] -> [batch, n, ld] with NaN padding
        mem = torch.full((batch, n, m + pad), float("nan"), dtype=torch.float64)
        mem[:, :, :m] = x.transpose(1, 2)
        return mem

    outs = []
    if e in (2, 3):
        outs.append(("pre_gelu", memory(pre)))
    if e == 4:
        outs.append(("bias_grad", opb[0].sum(0)))
    outs.append(("c", memory(c)))
    return [("a", A), ("b", B), ("bias", bias), ("c", C0)], outs, a, dt


# ---------------------------------------------------------------------------------------------------------------


def estimate_bytes(p):
    """A rough size of a plan's stored tensors (inputs in their dtype, outputs f64), for --check."""
    op = p["op"]
    shape = p.get("shape") or p.get("x") or p.get("q") or [p.get("n", 1)]
    n = 1
    for s in shape:
        n *= s
    if op == "gemm":
        a = p["attrs"]
        n = p["batch"] * (a["m"] * a["k"] + a["k"] * a["n"] + 2 * a["m"] * a["n"])
    return n * (2 * ITEMSIZE.get(p["dtype"], 4) + 8) + 200


def main():
    global torch, F
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--out", default=os.path.join(here, "..", "..", "conformance", "reference"))
    parser.add_argument("--per-op", type=int, default=32, help="cases per op (default 32)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--check", action="store_true",
                        help="plan the cases without torch and print the table and the estimated size")
    args = parser.parse_args()
    if args.per_op < 1:
        sys.exit("--per-op must be at least 1")
    plans = plan_all(args.per_op, args.seed)
    names = [p["name"] for p in plans]
    if len(set(names)) != len(names):
        sys.exit("internal error: duplicate case names")

    if args.check:
        table = collections.OrderedDict()
        for p in plans:
            row = table.setdefault(p["op"], collections.Counter())
            row[p["dtype"]] += 1
            row[p["cls"]] += 1
        print("%-46s %5s  %s" % ("op", "cases", "dtypes and value classes"))
        for op, row in table.items():
            total = sum(row[x] for x in ("f32", "bf16", "f16", "f64"))
            print("%-46s %5d  %s" % (op, total, " ".join("%s:%d" % kv for kv in sorted(row.items()))))
        est = sum(estimate_bytes(p) for p in plans)
        print("%d cases over %d ops (not covered: %s); about %.1f MiB of tensors" % (
            len(plans), len(table), ", ".join("%s (%s)" % kv for kv in NOT_COVERED.items()), est / 2 ** 20))
        return 0

    if sys.byteorder != "little":
        sys.exit("this writer assumes a little-endian machine")
    import torch as torch_module
    import torch.nn.functional as functional
    torch, F = torch_module, functional
    refs.torch, refs.F = torch, F  # the shared writer and builders use the module's own names
    torch.set_default_dtype(torch.float64)

    tensors, described = [], []
    counts = collections.OrderedDict()
    failures = []
    for p in plans:
        try:
            ins, outs, attrs, case_dtype = build(p)
        except Exception as e:  # noqa: BLE001 - a builder bug: reported in the summary, the case left out
            failures.append("%s: %s: %s" % (p["name"], type(e).__name__, e))
            continue
        name = p["name"]
        entry = {"name": name, "op": p["op"], "dtype": case_dtype, "attrs": attrs, "strided": p["strided"],
                 "inputs": [], "outputs": []}
        for q, (role, t) in enumerate(ins):
            tname = "%s:i%d" % (name, q)
            tensors.append((tname, refs.st_dtype(t) if t.dtype != torch.bool else "BOOL", list(t.shape),
                            refs.tensor_bytes(t)))
            entry["inputs"].append({"tensor": tname})
        for q, (role, t) in enumerate(outs):
            tname = "%s:o%d" % (name, q)
            t = t.detach().to("cpu", torch.float64).contiguous()
            tensors.append((tname, "F64", list(t.shape), refs.tensor_bytes(t)))
            entry["outputs"].append({"tensor": tname})
        described.append(entry)
        row = counts.setdefault(p["op"], collections.Counter())
        row[case_dtype] += 1
        row[p["cls"]] += 1
        row["nonfinite"] += sum(int((~torch.isfinite(t.detach().to(torch.float64))).sum()) for _, t in outs)

    description = {"format": refs.FORMAT, "generator": "tools/reference/make_conformance_sweep.py",
                   "torch_version": torch.__version__, "seed": args.seed, "per_op": args.per_op,
                   "about": "Generated cases: inputs in each case's dtype, PyTorch's float64 results on them (CPU).",
                   "cases": described}
    st_path, json_path = refs.write_reference_set(os.path.normpath(args.out), "pytorch_sweep", description, tensors)
    print("%-46s %5s  %s" % ("op", "cases", "dtypes, value classes, non-finite reference elements"))
    for op, row in counts.items():
        total = sum(row[x] for x in row if x not in ("plain", "large", "special", "nonfinite"))
        print("%-46s %5d  %s" % (op, total, " ".join("%s:%d" % kv for kv in sorted(row.items()))))
    size = os.path.getsize(st_path) + os.path.getsize(json_path)
    print("%d cases, torch %s; wrote %s and %s (%.1f MiB together)" % (len(described), torch.__version__, st_path,
                                                                       json_path, size / 2 ** 20))
    print("not covered: " + ", ".join("%s (%s)" % kv for kv in NOT_COVERED.items()) +
          ", gemm epilogue 5 (pre_gelu is read through an output slot)")
    if failures:
        print("BUILDER FAILURES (cases left out):")
        for f in failures:
            print("  " + f)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
