#!/usr/bin/env python3
"""Mutation testing of the conformance suite: how many deliberately wrong kernels does loom-conformance catch?

Takes a correct kernel library written against the C ABI (include/loom/abi/loom_kernel_abi.h), makes mutants of its
kernels (one small change each, by class), builds each as a shared library with cc (as plugins/cpu_sample does),
runs `loom-conformance --provider NAME --load LIB --op OP` for each op the changed function serves (stopping at the
first op that fails), and reports the share of mutants killed. A FAIL, a crash, a hang (past --timeout) or an error
exit of loom-conformance kills a mutant; a mutant that does not compile is discarded; one that passes but declines
more cases than the original (a supports() check made stricter) is reported apart and not scored, as a library may
decline any call. Survivors that cannot be wrong (equivalent mutants) are listed with a justification in
--equivalent and left out of the score.

  tools/mutation/mutate.py --source tests/planted/planted.c --provider planted --env LOOM_PLANTED=none \\
      --skip 'plant ==' --conformance build/loom-conformance --max 200 --seed 1 -j 2 \\
      --results mutation.json --equivalent tools/mutation/equivalent_planted.txt

Mutated: the functions an op-table kernel reaches, except the op table's supports() functions and the functions they
call (declining a call is always allowed, so a mutant there mostly declines more), one-line functions, lines that report errors
(fail(...)) and lines matching --skip (the planted library's plants, and the blocks they open).
Deterministic for a --seed; --results makes a run resumable (mutants already judged by the same loom-conformance
binary are not rerun). Python 3 standard library only. docs/PROVIDERS.md ("Mutation score") has the figures.
"""
import argparse
import concurrent.futures
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

CLASSES = {
    "ROR": "comparison flipped",
    "BOUND": "loop bound off by one",
    "AOR": "arithmetic operator replaced",
    "NEG": "value negated",
    "SWAP": "operands swapped",
    "CONST": "constant changed",
    "TERM": "term dropped",
    "DEL": "statement deleted",
    "ATTR": "attribute ignored (its fallback used)",
    "STRIDE": "strides of another tensor used",
    "SIZE": "special case for one size",
}
# The sizes a SIZE mutant singles out: small ones, tile edges and long rows.
SPECIAL_SIZES = [1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 32, 33, 64, 65, 127, 128, 255, 256, 257, 1024, 4096, 4097, 8193,
                 65536]


def die(message):
    print("mutate.py: " + message, file=sys.stderr)
    sys.exit(2)


# ---- Reading the C source: code with comments and strings blanked, functions, the op table. ----

def blank_comments_and_strings(text):
    """The text with comments replaced by spaces and string/char literal contents by 'x' (lengths and newlines kept),
    so that positions match the original and no mutation lands inside them."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + "x" * (min(j, n) - i - 1) + (c if j < n else ""))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


FUNC_HEAD = re.compile(r"^(?:static\s+|inline\s+|LOOM_PROVIDER_EXPORT\s+)*[A-Za-z_][\w\s\*]*?\b(\w+)\s*\(")


def find_functions(code_lines):
    """[(name, first line, body start line, last line)] (0-based) of top-level function definitions: a head at column 0,
    a body opened by '{' before any ';', closed by a '}' at column 0."""
    funcs = []
    i = 0
    while i < len(code_lines):
        line = code_lines[i]
        m = FUNC_HEAD.match(line)
        if m and not line.startswith(("typedef", "struct", "enum", "#")) and m.group(1) not in ("if", "for", "while"):
            j = i
            while j < len(code_lines) and "{" not in code_lines[j] and ";" not in code_lines[j]:
                j += 1
            if j < len(code_lines) and "{" in code_lines[j] and "=" not in code_lines[i].split("(")[0]:
                if code_lines[j].count("{") == code_lines[j].count("}"):  # a one-line function: not mutated
                    i = j + 1
                    continue
                k = j + 1
                while k < len(code_lines) and not code_lines[k].startswith("}"):
                    k += 1
                funcs.append((m.group(1), i, j, k))
                i = k + 1
                continue
        i += 1
    return funcs


OP_ENTRY = re.compile(r"\{\s*sizeof\s*\(\s*LoomOpEntry\s*\)\s*,\s*[^,]+,\s*\"(\w+)\"\s*,\s*[^,]+,\s*[^,]+,\s*(\w+)\s*,"
                      r"\s*(\w+)\s*,")


def op_table(text):
    """{kernel function: [ops]} and the set of supports() functions, from the LoomOpEntry initializers."""
    kernels, supports = {}, set()
    for op, fn, sup in OP_ENTRY.findall(text):
        if op.startswith("sample_frobnicate"):
            continue
        kernels.setdefault(fn, [])
        if op not in kernels[fn]:
            kernels[fn].append(op)
        if sup != "NULL":
            supports.add(sup)
    return kernels, supports


def reachable_ops(funcs, code_lines, kernels):
    """{function: [ops whose kernel reaches it]}, through calls by name."""
    names = {f[0] for f in funcs}
    calls = {}
    for name, first, body, last in funcs:
        body_text = "\n".join(code_lines[body:last + 1])
        calls[name] = {c for c in re.findall(r"\b(\w+)\s*\(", body_text) if c in names and c != name}
    reach = {}
    for kernel, ops in kernels.items():
        seen, stack = set(), [kernel]
        while stack:
            f = stack.pop()
            if f in seen or f not in calls:
                continue
            seen.add(f)
            stack.extend(calls[f])
        for f in seen:
            for op in ops:
                reach.setdefault(f, [])
                if op not in reach[f]:
                    reach[f].append(op)
    return reach


# ---- Mutation operators: each yields (class, start column, end column, replacement) on one line of code. ----

TOKEN = re.compile(r"\s+|0[xX][0-9a-fA-F]+[uUlL]*|\d+\.\d*(?:[eE][-+]?\d+)?[fF]?|\d+[eE][-+]?\d+[fF]?|\d+[uUlL]*"
                   r"|[A-Za-z_]\w*|->|\+\+|--|<<=|>>=|<=|>=|==|!=|&&|\|\||\+=|-=|\*=|/=|%=|<<|>>|.")
DECL_START = re.compile(r"^\s*(?:const\s+)?(?:unsigned\s+|signed\s+)?(?:int|int64_t|int32_t|uint16_t|uint32_t|"
                        r"uint64_t|double|float|char|size_t|uintptr_t|Loom\w+|static|void)\b")


def tokens(line):
    out, pos = [], 0
    for m in TOKEN.finditer(line):
        if not m.group().isspace():
            out.append((m.group(), m.start(), m.end()))
    return out


def is_operand_end(tok):
    return tok is not None and (re.match(r"^[\w.]+$", tok) is not None or tok in (")", "]"))


def simple_operand_right(toks, i):
    """The end index (exclusive) of a simple operand starting at toks[i]: a name or number, optionally followed by
    one call or index group without nesting, or one parenthesized group without nesting."""
    if i >= len(toks):
        return None
    t = toks[i][0]
    if t == "(":
        j = i + 1
        while j < len(toks) and toks[j][0] not in ("(", ")"):
            j += 1
        return j + 1 if j < len(toks) and toks[j][0] == ")" else None
    if not re.match(r"^[\w.]+$", t):
        return None
    j = i + 1
    while j + 1 < len(toks) and toks[j][0] == "->" and re.match(r"^\w+$", toks[j + 1][0]):
        j += 2
    if j < len(toks) and toks[j][0] in ("(", "["):
        close = ")" if toks[j][0] == "(" else "]"
        k = j + 1
        while k < len(toks) and toks[k][0] not in ("(", ")", "[", "]"):
            k += 1
        if k < len(toks) and toks[k][0] == close:
            return k + 1
        return None
    return j


def simple_operand_left(toks, i):
    """The start index of a simple operand ending at toks[i] (inclusive), or None."""
    t = toks[i][0]
    if t in (")", "]"):
        open_ = "(" if t == ")" else "["
        k = i - 1
        while k >= 0 and toks[k][0] not in ("(", ")", "[", "]"):
            k -= 1
        if k < 0 or toks[k][0] != open_:
            return None
        if open_ == "(" and k > 0 and re.match(r"^\w+$", toks[k - 1][0]) and toks[k - 1][0] not in ("if", "for",
                                                                                                      "while", "return"):
            k -= 1
        elif open_ == "[" and k > 0 and re.match(r"^\w+$", toks[k - 1][0]):
            k -= 1
        else:
            return k if open_ == "(" else None
        while k >= 2 and toks[k - 1][0] == "->" and re.match(r"^\w+$", toks[k - 2][0]):
            k -= 2
        return k
    if re.match(r"^[\w.]+$", t) and t not in ("return", "if", "for", "while", "else"):
        k = i
        while k >= 2 and toks[k - 1][0] == "->" and re.match(r"^\w+$", toks[k - 2][0]):
            k -= 2
        return k
    return None


def const_replacements(lit):
    m = re.match(r"^(0[xX][0-9a-fA-F]+|\d+)([uUlL]*)$", lit)
    if m:
        v = int(m.group(1), 0)
        reps = [v + 1] + ([v - 1] if v > 0 else [])
        fmt = (lambda x: hex(x)) if m.group(1).lower().startswith("0x") else str
        return [fmt(r) + m.group(2) for r in reps]
    try:
        v = float(lit.rstrip("fF"))
    except ValueError:
        return []
    suffix = "f" if lit.endswith(("f", "F")) else ""
    return [repr(0.0) + suffix if v != 0 else "1.0" + suffix, repr(v * 2) + suffix]


def line_mutants(code, func_code_text, tensor_names, rng, original=None):
    """Every mutation of one line of code (comments and strings blanked). Text a mutation moves (SWAP's operands,
    NEG's value) is taken from the original line at the same positions, so that a string in it is kept."""
    original = code if original is None else original
    toks = tokens(code)
    stripped = code.strip()
    out = []
    if not toks or stripped.startswith("#"):
        return out
    is_for = toks[0][0] == "for"
    is_decl_only = DECL_START.match(code) is not None and "=" not in code
    prev = None
    for i, (t, s, e) in enumerate(toks):
        nxt = toks[i + 1][0] if i + 1 < len(toks) else None
        # ROR: comparisons flipped (and boundaries moved).
        ror = {"<": ["<=", ">="], "<=": ["<", ">"], ">": [">=", "<="], ">=": [">", "<"], "==": ["!="], "!=": ["=="]}
        if t in ror and is_operand_end(prev):
            for r in ror[t]:
                out.append(("ROR", s, e, r))
        # AOR: +, -, *, / (binary, after an operand) and their compound assignments.
        aor = {"+": "-", "-": "+", "*": "/", "/": "*", "+=": "-=", "-=": "+=", "*=": "/=", "/=": "*="}
        if t in aor and (t.endswith("=") or is_operand_end(prev)) and not (t == "*" and is_decl_only):
            out.append(("AOR", s, e, aor[t]))
        # TERM: "x + term" / "x - term" / "x * term" drops the term (a simple right operand).
        if t in ("+", "-", "*") and is_operand_end(prev):
            end = simple_operand_right(toks, i + 1)
            if end is not None:
                out.append(("TERM", s, toks[end - 1][2], ""))
        # SWAP: "a - b", "a / b", "a < b" become "b - a" ... (simple operands on both sides).
        if t in ("-", "/", "<", ">", "<=", ">=") and is_operand_end(prev):
            left = simple_operand_left(toks, i - 1)
            end = simple_operand_right(toks, i + 1)
            if left is not None and end is not None:
                a = original[toks[left][1]:toks[i - 1][2]]
                b = original[toks[i + 1][1]:toks[end - 1][2]]
                if a != b:
                    out.append(("SWAP", toks[left][1], toks[end - 1][2], b + " " + t + " " + a))
        # CONST: numeric literals moved.
        if re.match(r"^(0[xX]|\d)", t) and not (prev == "[" and is_decl_only):
            for r in const_replacements(t):
                out.append(("CONST", s, e, r))
        # ATTR: an attribute read replaced by its fallback.
        if t in ("loom_attr_int", "loom_attr_float") and nxt == "(":
            m = re.match(r"loom_attr_(?:int|float)\(\s*\w+\s*,\s*\w+\s*,\s*\"x*\"\s*,\s*([^()]+?)\s*\)", code[s:])
            if m:
                out.append(("ATTR", s, s + m.end(), "(" + m.group(1) + ")"))
        # STRIDE: X->strides read as another tensor's strides.
        if t == "->" and nxt == "strides" and prev in tensor_names:
            ps = toks[i - 1][1]
            for other in sorted(tensor_names):
                if other != prev:
                    out.append(("STRIDE", ps, e, other + "->"))
        prev = t
    # BOUND and SIZE: a for loop's "i < E" bound: one short, or one short only at one size.
    if is_for:
        m = re.match(r"^(\s*for\s*\([^;]*;\s*)(\w+)\s*(<|<=)\s*([^;]+?)(\s*;)", code)
        if m:
            s, e = m.start(4), m.end(4)
            bound = m.group(4)
            out.append(("BOUND", s, e, "(" + bound + ") - 1"))
            size = rng.choice(SPECIAL_SIZES)
            out.append(("SIZE", s, e, "((" + bound + ") == " + str(size) + " ? (" + bound + ") - 1 : (" + bound + "))"))
    # NEG: an assignment's value negated.
    m = re.match(r"^(\s*(?:const\s+)?(?:double|float)?\s*[\w\[\]>\-\.]+(?:\s*\[[^\]]*\])?\s*(?:=|\+=|-=)\s*)([^;=]+?)"
                 r"(\s*;)\s*$", code)
    if m and not is_for and "==" not in m.group(2):
        out.append(("NEG", m.start(2), m.end(2), "-(" + original[m.start(2):m.end(2)] + ")"))
    # DEL: a statement on one line deleted (not a declaration, return, loop head or brace).
    if (stripped.endswith(";") and not stripped.startswith(("return", "for", "}", "{", "else", "case", "break"))
            and DECL_START.match(code) is None and code.count("(") == code.count(")") and "{" not in code
            and "}" not in code):
        lead = len(code) - len(code.lstrip())
        out.append(("DEL", lead, len(code.rstrip()), ";"))
    return out


def make_mutants(path, text, seed, skip=None):
    code = blank_comments_and_strings(text)
    code_lines = code.split("\n")
    lines = text.split("\n")
    funcs = find_functions(code_lines)
    kernels, supports = op_table(text)
    if not kernels:
        die(path + ": no LoomOpEntry table found (expected {sizeof(LoomOpEntry), device, \"op\", dtypes, priority, "
            "fn, supports, ...} entries)")
    reach = reachable_ops(funcs, code_lines, kernels)
    # Functions a supports() reaches decide which calls are declined, which a library may do for any call.
    declining = set(reachable_ops(funcs, code_lines, {s: ["-"] for s in supports}))
    mutants = []
    for name, first, body, last in funcs:
        if name not in reach or name in supports or name in declining:
            continue
        func_text = "\n".join(code_lines[body:last + 1])
        tensor_names = set(re.findall(r"\b(\w+)\s*->\s*(?:strides|shape|data|dtype|rank)\b", func_text))
        depth = 0  # > 0: inside a block opened by a skipped line
        for ln in range(body + 1, last):
            line_code = code_lines[ln]
            if depth > 0 or (skip and re.search(skip, line_code)):
                depth = max(0, depth + line_code.count("{") - line_code.count("}"))
                continue
            if "fail(" in line_code or not line_code.strip() or re.match(r"^\s*\(void\)\w+;\s*$", line_code):
                continue
            rng = random.Random("%d:%s:%s" % (seed, name, lines[ln].strip()))
            seen = set()
            for cls, s, e, rep in line_mutants(code_lines[ln], func_text, tensor_names, rng, lines[ln]):
                new_line = lines[ln][:s] + rep + lines[ln][e:]
                if new_line == lines[ln] or new_line in seen:
                    continue
                seen.add(new_line)
                key = "\0".join([name, lines[ln].strip(), new_line.strip()])
                mid = hashlib.sha1(key.encode()).hexdigest()[:10]
                mutants.append({"id": mid, "file": path, "line": ln + 1, "function": name, "class": cls,
                                "original": lines[ln].strip(), "mutated": new_line.strip(), "ops": reach[name]})
    # Ids are unique unless a line repeats within a function with the same change: keep the first.
    unique, ids = [], set()
    for m in mutants:
        if m["id"] not in ids:
            ids.add(m["id"])
            unique.append(m)
    return unique


# ---- Building and judging. ----

def build(source_text, mutant, workdir, args):
    lines = source_text.split("\n")
    if mutant is not None:
        ln = mutant["line"] - 1
        indent = lines[ln][:len(lines[ln]) - len(lines[ln].lstrip())]
        lines[ln] = indent + mutant["mutated"]
    src = os.path.join(workdir, os.path.basename(args.source))
    with open(src, "w") as f:
        f.write("\n".join(lines))
    lib = os.path.join(workdir, "libmutant.so")
    cmd = [args.cc, "-std=" + args.std, "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-w", "-I", args.include,
           src, "-o", lib, "-lm"]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True)
    return lib if r.returncode == 0 else None, r.stdout


DECLINED = re.compile(r"(\d+) declined|declined (\d+)")


def count_declined(output):
    """The declined cases over a loom-conformance table's rows."""
    n = 0
    for line in output.splitlines():
        m = DECLINED.search(line)
        if m and not line.startswith(" "):
            n += int(m.group(1) or m.group(2))
    return n


def run_in_group(cmd, env, timeout):
    """subprocess.run of cmd in a process group of its own, the whole group killed past timeout (then
    TimeoutExpired): a hung mutant's loom-conformance has worker processes, stuck in the mutant as well."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, env=env,
                         errors="replace", start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out)


def judge(lib, ops, args, env, baseline=None):
    """('killed', how) at the first op (and --dtype) whose conformance run fails, crashes, hangs or errors; else
    ('declines', how) when it passes but declines more cases than the original (baseline: {(op, dtype): declined}),
    else ('survived', ''). Without a baseline, (status, how, {(op, dtype): declined})."""
    declined = {}
    more = []
    for op, dtype in [(op, dt) for op in ops for dt in (args.dtypes or [None])]:
        cmd = [args.conformance, "--provider", args.provider, "--load", lib, "--op", op] + args.suite_args
        if dtype:
            cmd += ["--dtype", dtype]
        try:
            r = run_in_group(cmd, env, args.timeout)
        except subprocess.TimeoutExpired:
            how = op + ": hang (over %d s)" % args.timeout
            return ("killed", how) if baseline is not None else ("killed", how, declined)
        if r.returncode == 0:
            declined[(op, dtype)] = count_declined(r.stdout)
            if baseline is not None and declined[(op, dtype)] > baseline.get((op, dtype), 0):
                more.append("%s%s: %d declined, %d before" % (op, " " + dtype if dtype else "", declined[(op, dtype)],
                                                              baseline.get((op, dtype), 0)))
            continue
        if r.returncode < 0:
            how = op + ": crash (signal %d)" % -r.returncode
        elif r.returncode == 1:
            rows = [l.split()[:4] for l in r.stdout.splitlines() if " FAIL " in " " + l + " "]
            how = op + ": " + (" ".join(rows[0]) if rows else "FAIL")
        else:
            tail = r.stdout.strip().splitlines()[-1:] or [""]
            how = op + ": error exit %d (%s)" % (r.returncode, tail[0][:120])
        return ("killed", how) if baseline is not None else ("killed", how, declined)
    if baseline is None:
        return "survived", "", declined
    if more:
        return "declines", "; ".join(more)
    return "survived", ""


def suite_fingerprint(exe, env):
    """A hash of loom-conformance and the Loom libraries it loads (the suite lives in libloom): results made with
    another build are judged again."""
    files = [exe]
    try:
        r = subprocess.run(["ldd", exe], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, universal_newlines=True,
                           env=env)
        files += sorted(m for m in re.findall(r"=>\s*(\S*libloom\S*)", r.stdout))
    except OSError:
        pass
    h = hashlib.sha1()
    for path in files:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def read_equivalent(path):
    """{id: justification} from lines 'ID  justification' (# starts a comment line)."""
    eq = {}
    if not path:
        return eq
    if not os.path.exists(path):
        die("--equivalent: " + path + " does not exist")
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(None, 1)
            if not re.match(r"^[0-9a-f]{10}$", parts[0]) or len(parts) < 2:
                die("%s:%d: expected 'MUTANT_ID  justification', got '%s'" % (path, n, line[:80]))
            eq[parts[0]] = parts[1]
    return eq


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--source", required=True, help="the kernel library's C file")
    p.add_argument("--provider", required=True, help="the provider name the library registers")
    p.add_argument("--conformance", default=os.path.join(root, "build", "loom-conformance"),
                   help="the loom-conformance executable (default: build/loom-conformance)")
    p.add_argument("--include", default=os.path.join(root, "include", "loom", "abi"),
                   help="the folder of loom_kernel_abi.h")
    p.add_argument("--cc", default=os.environ.get("CC", "cc"), help="the C compiler (default: $CC or cc)")
    p.add_argument("--std", default="c99", help="the C standard to build with (default c99; c11 for cpu_sample)")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="environment for loom-conformance")
    p.add_argument("--suite-arg", action="append", default=[], dest="suite_args", metavar="ARG",
                   help="an extra loom-conformance argument (repeatable), e.g. --suite-arg=--reference=none")
    p.add_argument("--skip", metavar="REGEX",
                   help="lines of code matching REGEX, and the blocks they open, are not mutated (the planted "
                        "library's plants: --skip 'plant ==')")
    p.add_argument("--dtype", action="append", default=[], dest="dtypes", metavar="DTYPE",
                   help="run each op's cases for this dtype alone, in the order given (repeatable): a mutant killed "
                        "in the first is not run in the next (default: every dtype in one run)")
    p.add_argument("--seed", type=int, default=1, help="the sample and the SIZE mutants' sizes (default 1)")
    p.add_argument("--max", type=int, default=0, help="run a sample of this many mutants (default 0: all)")
    p.add_argument("--function", action="append", default=[], help="only mutants in this function (repeatable)")
    p.add_argument("--class", action="append", default=[], dest="classes", choices=sorted(CLASSES),
                   help="only mutants of this class (repeatable)")
    p.add_argument("--only", action="append", default=[], metavar="ID", help="only this mutant (repeatable)")
    p.add_argument("-j", "--jobs", type=int, default=1, help="mutants judged at once (default 1)")
    p.add_argument("--timeout", type=int, default=120, help="seconds per loom-conformance run (default 120)")
    p.add_argument("--equivalent", help="file of 'MUTANT_ID  justification' lines: survivors that cannot be wrong")
    p.add_argument("--results", help="JSON file of every mutant's result; an existing one is resumed")
    p.add_argument("--fresh", action="store_true", help="ignore the results already in --results")
    p.add_argument("--list", action="store_true", help="list the selected mutants and exit")
    p.add_argument("--fail-under", type=float, default=None, metavar="PCT",
                   help="exit 1 when the share killed (of the non-equivalent mutants) is under PCT")
    args = p.parse_args()

    if not os.path.isfile(args.source):
        die("--source: " + args.source + " does not exist")
    if args.jobs < 1:
        die("-j: must be at least 1")
    for kv in args.env:
        if "=" not in kv:
            die("--env: expected K=V, got '" + kv + "'")
    with open(args.source) as f:
        text = f.read()
    rel = os.path.relpath(os.path.abspath(args.source), root)
    try:
        skip = re.compile(args.skip) if args.skip else None
    except re.error as e:
        die("--skip: not a regular expression: " + str(e))
    mutants = make_mutants(rel, text, args.seed, skip)
    total_made = len(mutants)
    if args.function:
        unknown = set(args.function) - {m["function"] for m in mutants}
        if unknown:
            die("--function: no mutants in " + ", ".join(sorted(unknown)) + " (functions a kernel reaches, "
                "not supports())")
        mutants = [m for m in mutants if m["function"] in args.function]
    if args.classes:
        mutants = [m for m in mutants if m["class"] in args.classes]
    if args.only:
        unknown = set(args.only) - {m["id"] for m in mutants}
        if unknown:
            die("--only: no mutant " + ", ".join(sorted(unknown)) + " in " + rel)
        mutants = [m for m in mutants if m["id"] in args.only]
    if args.max and len(mutants) > args.max:
        # A seeded order of all the selected mutants, cut at --max: a larger --max takes the same ones and more.
        order = sorted(mutants, key=lambda m: hashlib.sha1(("%d:%s" % (args.seed, m["id"])).encode()).hexdigest())
        keep = {m["id"] for m in order[:args.max]}
        mutants = [m for m in mutants if m["id"] in keep]
    if args.list:
        for m in mutants:
            print("%s %s:%d %-6s %s: %s  ->  %s" % (m["id"], m["file"], m["line"], m["class"], ",".join(m["ops"]),
                                                   m["original"], m["mutated"]))
        print("%d of %d mutants" % (len(mutants), total_made))
        return 0
    if not mutants:
        die("no mutants selected")
    if not (os.path.isfile(args.conformance) and os.access(args.conformance, os.X_OK)):
        die("--conformance: " + args.conformance + " is not an executable (build the loom-conformance target)")
    if shutil.which(args.cc) is None:
        die("--cc: no compiler '" + args.cc + "'")
    equivalent = read_equivalent(args.equivalent)
    env = dict(os.environ)
    for kv in args.env:
        k, v = kv.split("=", 1)
        env[k] = v
    suite = suite_fingerprint(args.conformance, env)

    previous = {}
    if args.results and os.path.exists(args.results) and not args.fresh:
        try:
            with open(args.results) as f:
                old = json.load(f)
            if old.get("conformance_sha1") == suite:
                previous = {r["id"]: r for r in old.get("mutants", []) if r.get("status")}
            else:
                print("(%s was made with another loom-conformance: judging again)" % args.results)
        except (ValueError, KeyError, OSError) as e:
            die("--results: " + args.results + " is not a results file of this tool (" + str(e) + "); use --fresh")

    tmp = tempfile.mkdtemp(prefix="loom-mutation-")
    try:
        # The unmutated library must build and pass every op the mutants touch, else nothing can be judged.
        ops = sorted({op for m in mutants for op in m["ops"]})
        base_dir = os.path.join(tmp, "original")
        os.mkdir(base_dir)
        lib, log = build(text, None, base_dir, args)
        if lib is None:
            die(rel + " does not build:\n" + log)
        seconds, baseline = {}, {}
        for op in ops:
            start = time.time()
            status, how, declined = judge(lib, [op], args, env)
            baseline.update(declined)
            if status != "survived":
                die("the unmutated library fails the suite (" + how + "): mutants cannot be judged. Rerun: " +
                    " ".join([args.conformance, "--provider", args.provider, "--load", lib, "--op", op]))
            seconds[op] = time.time() - start
        # A mutant's ops are tried fastest first: most mutants of a shared helper die in the first.
        for m in mutants:
            m["ops"] = sorted(m["ops"], key=lambda op: seconds[op])
        print("original %s passes %s; %d mutants to judge (of %d made), -j %d" %
              (rel, ", ".join("%s (%.1f s)" % (op, seconds[op]) for op in ops), len(mutants), total_made,
               args.jobs), flush=True)

        lock = threading.Lock()
        results = {}

        def save():
            if not args.results:
                return
            doc = {"source": rel, "provider": args.provider, "seed": args.seed, "conformance_sha1": suite,
                   "mutants": [results[m["id"]] for m in mutants if m["id"] in results]}
            tmp_path = args.results + ".tmp"
            with open(tmp_path, "w") as f:
                json.dump(doc, f, indent=1)
            os.replace(tmp_path, args.results)

        def run_one(m):
            if m["id"] in previous and previous[m["id"]].get("mutated") == m["mutated"] and \
                    (previous[m["id"]]["status"] != "survived" or previous[m["id"]].get("declines_checked")):
                r = dict(previous[m["id"]])
                r.update({"line": m["line"], "file": m["file"]})
                return r
            d = os.path.join(tmp, m["id"])
            os.mkdir(d)
            t0 = time.time()
            lib, _ = build(text, m, d, args)
            r = dict(m)
            if lib is None:
                r.update({"status": "discarded", "how": "does not compile"})
            else:
                st, how = judge(lib, m["ops"], args, env, baseline)
                r.update({"status": st, "how": how, "declines_checked": True})
            r["seconds"] = round(time.time() - t0, 1)
            shutil.rmtree(d, ignore_errors=True)
            return r

        done = 0
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for r in pool.map(run_one, mutants):
                with lock:
                    results[r["id"]] = r
                    done += 1
                    save()
                if r["status"] != "discarded":
                    print("[%d/%d] %s %s:%d %s %s%s" % (done, len(mutants), r["status"], r["file"], r["line"],
                                                        r["class"], r["mutated"][:70],
                                                        "  (" + r["how"] + ")" if r["how"] else ""), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    judged = [results[m["id"]] for m in mutants]
    killed = [r for r in judged if r["status"] == "killed"]
    survived = [r for r in judged if r["status"] == "survived"]
    discarded = [r for r in judged if r["status"] == "discarded"]
    declines = [r for r in judged if r["status"] == "declines"]
    eq_survivors = [r for r in survived if r["id"] in equivalent]
    live = [r for r in survived if r["id"] not in equivalent]
    for r in killed:
        if r["id"] in equivalent:
            print("note: %s is listed as equivalent but was killed (%s): drop it from %s" %
                  (r["id"], r["how"], args.equivalent))
    scored = len(killed) + len(live)
    score = 100.0 * len(killed) / scored if scored else 100.0
    print()
    print("mutation score of %s against %s: %.1f%% (%d killed of %d non-equivalent mutants; %d equivalent, "
          "%d only decline more calls; %d discarded as not compiling; %d of %d mutants made, seed %d)" %
          (rel, os.path.basename(args.conformance), score, len(killed), scored, len(eq_survivors), len(declines),
           len(discarded), len(mutants), total_made, args.seed))
    by_class = {}
    for r in killed + live:
        k = by_class.setdefault(r["class"], [0, 0])
        k[0 if r["status"] == "killed" else 1] += 1
    print("by class: " + ", ".join("%s %d/%d" % (c, v[0], v[0] + v[1]) for c, v in sorted(by_class.items())))
    if live:
        print("survivors (file:line, class, ops, the change):")
        for r in sorted(live, key=lambda r: r["line"]):
            print("  %s %s:%d %s [%s] %s  ->  %s" % (r["id"], r["file"], r["line"], r["class"], ",".join(r["ops"]),
                                                    r["original"], r["mutated"]))
    if declines:
        print("only decline more calls (not scored: supports() may decline any call; the rows say 'declined'):")
        for r in sorted(declines, key=lambda r: r["line"]):
            print("  %s %s:%d %s: %s  ->  %s  (%s)" % (r["id"], r["file"], r["line"], r["class"], r["original"],
                                                      r["mutated"], r["how"]))
    if eq_survivors:
        print("equivalent (not scored):")
        for r in sorted(eq_survivors, key=lambda r: r["line"]):
            print("  %s %s:%d %s: %s" % (r["id"], r["file"], r["line"], r["class"], equivalent[r["id"]]))
    if args.fail_under is not None and score < args.fail_under:
        print("mutation score %.1f%% is under --fail-under %.1f%%" % (score, args.fail_under))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
