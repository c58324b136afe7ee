#!/usr/bin/env python3
"""Plots train and validation loss against step from a loom-train metrics.jsonl to a PNG.

    python3 tools/plot_loss.py out/logs/metrics.jsonl -o loss.png
    python3 tools/plot_loss.py out/logs                 # the directory's metrics.jsonl, writes out/logs/loss.png
    python3 tools/plot_loss.py logs_bf16 logs_fp8 --label bf16 --label fp8 --warmup 100 -o bf16_fp8.png
    python3 tools/plot_loss.py a.log b.log c.log d.log --label bf16 --label bf16 --label fp8 --label fp8 --window 50

Several runs are drawn on one plot, a color each (labels: --label, in order, else each run's directory name), and
each run after the first is compared with the first step by step: the largest relative difference of its train loss
after --warmup steps, and at the last step both share; with --window N also the mean of each N steps after the
warm-up (the windows ending at the last shared step), which is what two runs of one text can resolve.

Runs given the same label are repeats of one recipe, a group drawn in one color. The GPU's step is not bit for bit
repeatable, so two runs of one recipe part as training goes on (on a small text read many times, by several percent);
a difference between recipes means something only beside that spread. With repeats, the first label's runs are the
reference: their own spread around their mean is printed, and each other group's mean against the reference mean,
window by window (--window, default a twentieth of the steps), with the windows where the group's mean lies outside
the range of the reference's runs counted. The last validation losses are given per group as mean and range.

A run is a metrics.jsonl, its directory, or the text loom-train printed (its "step N/M | loss ..." and "step N: val
loss ..." lines: four decimals, where metrics.jsonl keeps every bit).

Each line of metrics.jsonl is a JSON object {"step": s, "time": t, "train/loss": ..., ...} or, after an evaluation,
{"step": s, "time": t, "val/loss": ...} (src/io/metrics_log.cc); a run without --val-data evaluates on the training
data and logs "train_data/loss", drawn as "train data (eval)". Runs given the same --log-dir append to one file,
each after a line {"run_start": true, "step": s, ...}, with "resumed_from" when it resumed at step s: the plot is of the
newest fresh run and the resumes after it. Uses matplotlib when it is installed; otherwise a built-in renderer draws
the plot and writes the PNG with zlib alone, so it works with a bare python3.
"""

import argparse
import json
import math
import os
import re
import struct
import sys
import zlib


PRINTED_STEP = re.compile(r"^step\s+(\d+)/\d+ \| loss (\S+) ")
PRINTED_EVAL = re.compile(r"^step (\d+): (val|train-data) loss (?:\(no --val-data\) )?(\S+)$")


def read_metrics(path):
    """Returns ({step: train loss}, {step: val loss}, {step: evaluation loss on the training data}) of the newest
    fresh run: a fresh run's start mark drops what came before; a resume's drops the steps after the one it resumed
    at, which it trains again."""
    train, val, train_eval = {}, {}, {}
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if not line.startswith("{"):  # loom-train's printed lines
                m = PRINTED_STEP.match(line)
                if m and math.isfinite(float(m.group(2))):
                    train[int(m.group(1))] = float(m.group(2))
                m = PRINTED_EVAL.match(line)
                if m and math.isfinite(float(m.group(3))):
                    (val if m.group(2) == "val" else train_eval)[int(m.group(1))] = float(m.group(3))
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                # A crash can leave the last line half-written; anything else is worth a warning too.
                print(f"plot_loss: {path}:{lineno}: skipping a malformed line ({e})", file=sys.stderr)
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("step"), (int, float)):
                continue
            step = obj["step"]
            if obj.get("run_start") is True:
                for table in (train, val, train_eval):
                    for k in [k for k in table if "resumed_from" not in obj or k > step]:
                        del table[k]
                continue
            for key, table in (("train/loss", train), ("val/loss", val), ("train_data/loss", train_eval)):
                v = obj.get(key)
                if isinstance(v, (int, float)) and math.isfinite(v):
                    table[step] = float(v)
    return train, val, train_eval


def ema(values, alpha):
    """Exponential moving average (alpha = weight of the past), as TensorBoard's smoothing slider."""
    out, acc = [], None
    for v in values:
        acc = v if acc is None else alpha * acc + (1 - alpha) * v
        out.append(acc)
    return out


# ----------------------------------------------------------------------------------------------- matplotlib backend

def plot_matplotlib(series, out_path, title, ylabel="loss"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for label, xs, ys, color, markers in series:
        ax.plot(xs, ys, label=label if label is not None else "_nolegend_", color=color,
                marker="o" if markers else None, markersize=3, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)


# -------------------------------------------------------------------------------------------------- builtin backend

# 5x7 bitmap glyphs for the characters the plot writes (tick labels, axis names, legend, titles).
FONT = {
    "0": ["01110", "10001", "10011", "10101", "11001", "10001", "01110"],
    "1": ["00100", "01100", "00100", "00100", "00100", "00100", "01110"],
    "2": ["01110", "10001", "00001", "00010", "00100", "01000", "11111"],
    "3": ["11110", "00001", "00001", "01110", "00001", "00001", "11110"],
    "4": ["00010", "00110", "01010", "10010", "11111", "00010", "00010"],
    "5": ["11111", "10000", "11110", "00001", "00001", "10001", "01110"],
    "6": ["00110", "01000", "10000", "11110", "10001", "10001", "01110"],
    "7": ["11111", "00001", "00010", "00100", "01000", "01000", "01000"],
    "8": ["01110", "10001", "10001", "01110", "10001", "10001", "01110"],
    "9": ["01110", "10001", "10001", "01111", "00001", "00010", "01100"],
    ".": ["00000", "00000", "00000", "00000", "00000", "01100", "01100"],
    "%": ["11001", "11010", "00010", "00100", "01000", "01011", "10011"],
    "-": ["00000", "00000", "00000", "11111", "00000", "00000", "00000"],
    "+": ["00000", "00100", "00100", "11111", "00100", "00100", "00000"],
    "/": ["00001", "00010", "00010", "00100", "01000", "01000", "10000"],
    "_": ["00000", "00000", "00000", "00000", "00000", "00000", "11111"],
    ":": ["00000", "01100", "01100", "00000", "01100", "01100", "00000"],
    "(": ["00010", "00100", "01000", "01000", "01000", "00100", "00010"],
    ")": ["01000", "00100", "00010", "00010", "00010", "00100", "01000"],
    " ": ["00000"] * 7,
    "a": ["00000", "00000", "01110", "00001", "01111", "10001", "01111"],
    "b": ["10000", "10000", "10110", "11001", "10001", "10001", "11110"],
    "c": ["00000", "00000", "01110", "10000", "10000", "10001", "01110"],
    "d": ["00001", "00001", "01101", "10011", "10001", "10001", "01111"],
    "e": ["00000", "00000", "01110", "10001", "11111", "10000", "01110"],
    "f": ["00110", "01001", "01000", "11100", "01000", "01000", "01000"],
    "g": ["00000", "01111", "10001", "10001", "01111", "00001", "01110"],
    "h": ["10000", "10000", "10110", "11001", "10001", "10001", "10001"],
    "i": ["00100", "00000", "01100", "00100", "00100", "00100", "01110"],
    "j": ["00010", "00000", "00110", "00010", "00010", "10010", "01100"],
    "k": ["10000", "10000", "10010", "10100", "11000", "10100", "10010"],
    "l": ["01100", "00100", "00100", "00100", "00100", "00100", "01110"],
    "m": ["00000", "00000", "11010", "10101", "10101", "10001", "10001"],
    "n": ["00000", "00000", "10110", "11001", "10001", "10001", "10001"],
    "o": ["00000", "00000", "01110", "10001", "10001", "10001", "01110"],
    "p": ["00000", "00000", "11110", "10001", "11110", "10000", "10000"],
    "q": ["00000", "00000", "01101", "10011", "01111", "00001", "00001"],
    "r": ["00000", "00000", "10110", "11001", "10000", "10000", "10000"],
    "s": ["00000", "00000", "01110", "10000", "01110", "00001", "11110"],
    "t": ["01000", "01000", "11100", "01000", "01000", "01001", "00110"],
    "u": ["00000", "00000", "10001", "10001", "10001", "10011", "01101"],
    "v": ["00000", "00000", "10001", "10001", "10001", "01010", "00100"],
    "w": ["00000", "00000", "10001", "10001", "10101", "10101", "01010"],
    "x": ["00000", "00000", "10001", "01010", "00100", "01010", "10001"],
    "y": ["00000", "00000", "10001", "10001", "01111", "00001", "01110"],
    "z": ["00000", "00000", "11111", "00010", "00100", "01000", "11111"],
}
GLYPH_W, GLYPH_H = 5, 7


class Canvas:
    def __init__(self, width, height, background=(255, 255, 255)):
        self.w, self.h = width, height
        self.px = bytearray(bytes(background) * (width * height))

    def set(self, x, y, color):
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(color)

    def blend(self, x, y, color, alpha):
        if 0 <= x < self.w and 0 <= y < self.h and alpha > 0:
            i = 3 * (y * self.w + x)
            for c in range(3):
                self.px[i + c] = int(round(self.px[i + c] * (1 - alpha) + color[c] * alpha))

    def rect(self, x0, y0, x1, y1, color):
        for y in range(max(0, y0), min(self.h, y1 + 1)):
            for x in range(max(0, x0), min(self.w, x1 + 1)):
                self.set(x, y, color)

    def line(self, x0, y0, x1, y1, color, width=1.0):
        """Anti-aliased line: samples along the segment, coverage by distance to the centre line."""
        dx, dy = x1 - x0, y1 - y0
        length = math.hypot(dx, dy)
        half = width / 2.0
        xmin, xmax = int(math.floor(min(x0, x1) - half - 1)), int(math.ceil(max(x0, x1) + half + 1))
        ymin, ymax = int(math.floor(min(y0, y1) - half - 1)), int(math.ceil(max(y0, y1) + half + 1))
        for y in range(max(0, ymin), min(self.h, ymax + 1)):
            for x in range(max(0, xmin), min(self.w, xmax + 1)):
                if length == 0:
                    d = math.hypot(x - x0, y - y0)
                else:
                    t = max(0.0, min(1.0, ((x - x0) * dx + (y - y0) * dy) / (length * length)))
                    d = math.hypot(x - (x0 + t * dx), y - (y0 + t * dy))
                coverage = max(0.0, min(1.0, half + 0.5 - d))
                self.blend(x, y, color, coverage)

    def text(self, x, y, s, color=(0, 0, 0), scale=1):
        for ch in s:
            glyph = FONT.get(ch, FONT.get(ch.lower(), FONT[" "]))
            for gy, row in enumerate(glyph):
                for gx, bit in enumerate(row):
                    if bit == "1":
                        self.rect(x + gx * scale, y + gy * scale, x + (gx + 1) * scale - 1, y + (gy + 1) * scale - 1,
                                  color)
            x += (GLYPH_W + 1) * scale

    @staticmethod
    def text_width(s, scale=1):
        return len(s) * (GLYPH_W + 1) * scale - scale

    def png(self):
        raw = b"".join(b"\x00" + bytes(self.px[3 * y * self.w:3 * (y + 1) * self.w]) for y in range(self.h))

        def chunk(kind, data):
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        ihdr = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def nice_ticks(lo, hi, target=6):
    """Round tick values (1, 2 or 5 times a power of ten) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, v = [], first
    while v <= hi + 1e-9 * step:
        ticks.append(v)
        v += step
    return ticks, step


def tick_label(v, step):
    if step >= 1 and abs(v) < 1e7:
        return str(int(round(v)))
    decimals = max(0, -int(math.floor(math.log10(step))))
    return f"{v:.{decimals}f}"


def plot_builtin(series, out_path, title, ylabel="loss", width=800, height=500):
    c = Canvas(width, height)
    left, right, top, bottom = 70, 20, 36, 50
    pw, ph = width - left - right, height - top - bottom
    xs_all = [x for _, xs, _, _, _ in series for x in xs]
    ys_all = [y for _, _, ys, _, _ in series for y in ys]
    x_lo, x_hi = min(xs_all), max(xs_all)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_lo, y_hi = min(ys_all), max(ys_all)
    pad = (y_hi - y_lo) * 0.05 or max(abs(y_hi) * 0.05, 0.05)
    y_lo, y_hi = y_lo - pad, y_hi + pad

    def sx(x):
        return left + (x - x_lo) / (x_hi - x_lo) * pw

    def sy(y):
        return top + (y_hi - y) / (y_hi - y_lo) * ph

    grid, axis = (225, 225, 225), (0, 0, 0)
    xticks, xstep = nice_ticks(x_lo, x_hi)
    yticks, ystep = nice_ticks(y_lo, y_hi)
    for t in xticks:
        px = int(round(sx(t)))
        c.rect(px, top, px, top + ph, grid)
        label = tick_label(t, xstep)
        c.rect(px, top + ph, px, top + ph + 4, axis)
        c.text(px - c.text_width(label) // 2, top + ph + 8, label)
    for t in yticks:
        py = int(round(sy(t)))
        c.rect(left, py, left + pw, py, grid)
        label = tick_label(t, ystep)
        c.rect(left - 4, py, left, py, axis)
        c.text(left - 8 - c.text_width(label), py - GLYPH_H // 2, label)
    c.rect(left, top, left, top + ph, axis)
    c.rect(left, top + ph, left + pw, top + ph, axis)
    c.rect(left, top, left + pw, top, axis)
    c.rect(left + pw, top, left + pw, top + ph, axis)
    c.text(left + pw // 2 - c.text_width("step", 2) // 2, height - 20, "step", scale=2)
    c.text(6, top + ph // 2 - GLYPH_H, ylabel, scale=2)
    c.text(width // 2 - c.text_width(title, 2) // 2, 10, title, scale=2)

    for label, xs, ys, color, markers in series:
        pts = [(sx(x), sy(y)) for x, y in zip(xs, ys)]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            c.line(x0, y0, x1, y1, color, width=1.6)
        if markers or len(pts) == 1:
            for x, y in pts:
                c.rect(int(round(x)) - 2, int(round(y)) - 2, int(round(x)) + 2, int(round(y)) + 2, color)

    # Legend, top right inside the plot; a group's repeats (label None) share its first run's entry.
    legend = [(label, color) for label, _, _, color, _ in series if label is not None]
    legend_w = 30 + max(c.text_width(label) for label, _ in legend) + 16
    lx, ly = left + pw - legend_w, top + 10
    c.rect(lx - 8, ly - 6, left + pw - 8, ly + 16 * len(legend) - 2, (255, 255, 255))
    for i, (label, color) in enumerate(legend):
        y = ly + 16 * i + 3
        c.line(lx, y, lx + 22, y, color, width=2.0)
        c.text(lx + 30, y - GLYPH_H // 2, label)

    with open(out_path, "wb") as f:
        f.write(c.png())


# ---------------------------------------------------------------------------------------------------------- main

KINDS = ("train", "val", "train data (eval)")  # read_metrics's three tables, in its order
PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127)]
MATPLOTLIB_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
                     "tab:gray"]


def compare(first, other, warmup):
    """The largest relative difference of `other`'s train loss from `first`'s over the steps both have after
    `warmup`, as (difference, step), and at the last step both have, as (difference, step, other's, first's)."""
    steps = sorted(set(first) & set(other))
    if not steps:
        return None, None
    rel = lambda s: abs(other[s] - first[s]) / abs(first[s]) if first[s] else math.inf
    after = [s for s in steps if s > warmup]
    worst = max(((rel(s), s) for s in after), default=None)
    last = steps[-1]
    return worst, (rel(last), last, other[last], first[last])


def group_windows(groups, warmup, window):
    """Window means of each run of each group over the train steps every run has after `warmup`, windows of `window`
    steps ending at the last such step (a partial one at the start left out): ([(first step, last step)], [[[mean of
    window w of run r] for r] for group]). Empty when the runs share fewer than `window` steps."""
    shared = set.intersection(*(set(t) for _, tables in groups for t in tables))
    steps = sorted(s for s in shared if s > warmup)
    steps = steps[len(steps) % window:]
    chunks = [steps[i:i + window] for i in range(0, len(steps), window)]
    means = [[[sum(t[s] for s in c) / window for c in chunks] for t in tables] for _, tables in groups]
    return [(c[0], c[-1]) for c in chunks], means


def mean_of_runs(runs):
    """The window-by-window mean of several runs' window means."""
    return [sum(window) / len(runs) for window in zip(*runs)]


def percent(a, b):
    """a's difference from b in percent of b."""
    return (a - b) / abs(b) * 100 if b else math.inf


def compare_windows(first, other, warmup, window):
    """Relative differences of `other`'s mean train loss from `first`'s over windows of `window` consecutive steps
    both have after `warmup`, the windows ending at the last such step (a partial one at the start is left out), as
    [(difference, first step, last step)], oldest first. Same batches at each step make single steps swing with the
    runs' trajectories; window means are what a precision comparison can resolve."""
    spans, ((a,), (b,)) = group_windows([("first", [first]), ("other", [other])], warmup, window)
    return [((y - x) / abs(x) if x else math.inf, lo, hi) for x, y, (lo, hi) in zip(a, b, spans)]


def report_groups(groups, vals, warmup, window):
    """Prints the reference group's spread and each other group against it (see the module's docstring)."""
    spans, means = group_windows(groups, warmup, window)
    named = [f"{name} ({len(tables)} run{'s' if len(tables) > 1 else ''})" for name, tables in groups]
    if not spans:
        print(f"plot_loss: the runs share fewer than {window} train steps after step {warmup}: no window to compare")
        return
    ref_runs = means[0]
    ref = mean_of_runs(ref_runs)
    head = f"{window}-step means after step {warmup}"
    if len(ref_runs) > 1:
        spread = [max(abs(percent(r[w], ref[w])) for r in ref_runs) for w in range(len(spans))]
        apart = [percent(max(r[w] for r in ref_runs), min(r[w] for r in ref_runs)) for w in range(len(spans))]
        w = max(range(len(spans)), key=lambda i: spread[i])
        print(f"plot_loss: {named[0]}, {head}: each run within {spread[w]:.2f}% of their mean (steps "
              f"{spans[w][0]}-{spans[w][1]}), the runs up to {max(apart):.2f}% apart; last window "
              f"{min(r[-1] for r in ref_runs):.4f} to {max(r[-1] for r in ref_runs):.4f} (within {spread[-1]:.2f}%)")
    for g in range(1, len(groups)):
        runs = means[g]
        group = mean_of_runs(runs)
        diff = [percent(m, r) for m, r in zip(group, ref)]
        w = max(range(len(spans)), key=lambda i: abs(diff[i]))
        outside = [i for i in range(len(spans))
                   if not min(r[i] for r in ref_runs) <= group[i] <= max(r[i] for r in ref_runs)]
        text = (f"plot_loss: {named[g]} against {named[0]}, {head}: {'the mean' if len(runs) > 1 else 'the run'} "
                f"largest {diff[w]:+.2f}% (steps {spans[w][0]}-{spans[w][1]}), last {diff[-1]:+.2f}% "
                f"(steps {spans[-1][0]}-{spans[-1][1]})")
        if len(ref_runs) > 1:
            text += (f"; outside the range of {groups[0][0]}'s runs in {len(outside)} of {len(spans)} windows"
                     + (", the last included" if outside and outside[-1] == len(spans) - 1 else ""))
        if len(runs) > 1:
            text += "; each run's last window " + " ".join(f"{percent(r[-1], ref[-1]):+.2f}%" for r in runs)
        print(text + "; all: " + " ".join(f"{d:+.2f}" for d in diff))
    parts = []
    for (name, _), runs in zip(groups, vals):
        last = [t[max(t)] for t in runs if t]
        if not last:
            continue
        at = sorted({max(t) for t in runs if t})
        where = f"step {at[0]}" if len(at) == 1 else f"steps {at[0]}-{at[-1]}"
        parts.append(f"{name} {sum(last) / len(last):.4f}" + (f" ({min(last):.4f} to {max(last):.4f}, "
                                                              f"{len(last)} runs)" if len(last) > 1 else "")
                     + f" at {where}")
    if parts:
        print("plot_loss: last validation loss: " + "; ".join(parts))


def default_names(paths):
    """Each run's name without --label: its directory's, else (runs of one directory) its file's, else numbered; never
    the same twice, since only a label given twice makes a group."""
    names = [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in paths]
    if len(set(names)) < len(names):
        names = [os.path.basename(p) for p in paths]
    if len(set(names)) < len(names):
        names = [f"{name} #{i + 1}" for i, name in enumerate(names)]
    return names


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", nargs="+",
                    help="metrics.jsonl written by loom-train --log-dir, or that directory; several: one plot")
    ap.add_argument("-o", "--output", help="PNG to write (default: loss.png beside the first metrics file)")
    ap.add_argument("--label", action="append", default=[],
                    help="a run's name in the legend, once per metrics file in order (default: its directory)")
    ap.add_argument("--title", default="loss", help="plot title")
    ap.add_argument("--smooth", type=float, default=0.0,
                    help="EMA smoothing of the train loss in [0, 1) (0 = none; TensorBoard's slider)")
    ap.add_argument("--warmup", type=int, default=0,
                    help="with several runs: steps left out of the largest difference from the first run (default 0)")
    ap.add_argument("--window", type=int, default=0,
                    help="with several runs: also compare the mean train loss of each N steps after the warm-up "
                         "(default 0: step by step only)")
    ap.add_argument("--relative", action="store_true",
                    help="draw each run's train loss as window means (--window) in percent from the first "
                         "label's (the mean of its runs when it is repeated), where a few percent shows, in place of "
                         "the losses")
    ap.add_argument("--backend", choices=["auto", "matplotlib", "builtin"], default="auto",
                    help="auto: matplotlib if installed, else the built-in renderer")
    args = ap.parse_args(argv)

    paths = [os.path.join(p, "metrics.jsonl") if os.path.isdir(p) else p for p in args.metrics]
    for path in paths:
        if not os.path.isfile(path):
            print(f"plot_loss: error: {path} does not exist", file=sys.stderr)
            return 1
    if args.label and len(args.label) != len(paths):
        print(f"plot_loss: error: {len(args.label)} --label for {len(paths)} metrics files (give one per file, or none)",
              file=sys.stderr)
        return 1
    if not 0.0 <= args.smooth < 1.0:
        print("plot_loss: error: --smooth must be in [0, 1)", file=sys.stderr)
        return 1
    if args.warmup < 0:
        print("plot_loss: error: --warmup must be 0 or more", file=sys.stderr)
        return 1
    if args.window < 0:
        print("plot_loss: error: --window must be 0 or more", file=sys.stderr)
        return 1
    names = args.label or default_names(paths)
    group_of = {}  # label -> group index, in order of first appearance; a repeated label makes a group
    for name in names:
        group_of.setdefault(name, len(group_of))
    if len(group_of) > len(PALETTE):
        print(f"plot_loss: error: at most {len(PALETTE)} runs or groups of runs on one plot ({len(group_of)} given)",
              file=sys.stderr)
        return 1
    runs = []  # (name, {kind: {step: loss}}) with the kinds of KINDS
    for n, path in enumerate(paths):
        tables = dict(zip(KINDS, read_metrics(path)))
        if not any(tables.values()):
            print(f"plot_loss: error: {path} has no finite train/loss, val/loss or train_data/loss values",
                  file=sys.stderr)
            return 1
        runs.append((names[n], tables))
    out = args.output or os.path.join(os.path.dirname(os.path.abspath(paths[0])), "loss.png")

    # (label, steps, values, color, markers): one run takes a color per kind, several runs a color each (a group's
    # repeats its color, unlabelled). The train loss is a line (labelled by the run's name when there are several),
    # the evaluations are points.
    series = []
    several = len(runs) > 1
    seen = set()
    # Without --window, repeats and --relative compare means of a twentieth of the shortest run's train steps.
    window = args.window or max(1, min((max(t["train"]) for _, t in runs if t["train"]), default=0) // 20)
    if args.relative:  # one line per run: its window means against the reference's, in percent
        spans, means = group_windows([(name, [t["train"]]) for name, t in runs], args.warmup, window)
        if not spans:
            print(f"plot_loss: error: --relative: the runs share fewer than {window} train steps after step "
                  f"{args.warmup}", file=sys.stderr)
            return 1
        ref = mean_of_runs([m[0] for (name, _), m in zip(runs, means) if name == runs[0][0]])
        for (name, _), m in zip(runs, means):
            series.append((None if name in seen else name, [b for _, b in spans],
                           [percent(v, r) for v, r in zip(m[0], ref)], PALETTE[group_of[name]], False))
            seen.add(name)
        runs_to_draw = []
    else:
        runs_to_draw = runs
    for name, tables in runs_to_draw:
        n = group_of[name]
        repeat = name in seen
        seen.add(name)
        for i, kind in enumerate(KINDS):
            table = tables[kind]
            if not table:
                continue
            steps = sorted(table)
            ys = [table[s] for s in steps]
            label = (name if kind == "train" else f"{name} {kind}") if several else kind
            if kind == "train" and args.smooth > 0:
                ys = ema(ys, args.smooth)
                label += f" (ema {args.smooth:g})"
            if repeat:
                label = None
            series.append((label, steps, ys, PALETTE[n] if several else PALETTE[i], kind != "train"))

    backend = args.backend
    if backend == "auto":
        try:
            import matplotlib  # noqa: F401

            backend = "matplotlib"
        except ImportError:
            backend = "builtin"
    elif backend == "matplotlib":
        try:
            import matplotlib  # noqa: F401,F811
        except ImportError:
            print("plot_loss: error: matplotlib is not installed (pip install matplotlib, or --backend builtin: "
                  "no dependency)", file=sys.stderr)
            return 1
    if backend == "matplotlib":
        colors = dict(zip(PALETTE, MATPLOTLIB_COLORS))
        plot_matplotlib([(l, x, y, colors[c], m) for l, x, y, c, m in series], out, args.title,
                        "train loss against the first label's mean (%)" if args.relative else "loss")
    else:
        plot_builtin(series, out, args.title, "%" if args.relative else "loss")
    if len(group_of) < len(runs):  # repeats: the groups against the first one's spread
        plural = "s" if len(group_of) > 1 else ""
        print(f"plot_loss: wrote {out} ({backend}; {len(runs)} runs in {len(group_of)} group{plural})")
        groups = [(name, [t["train"] for n, t in runs if n == name]) for name in group_of]
        vals = [[t["val"] for n, t in runs if n == name] for name in group_of]
        report_groups(groups, vals, args.warmup, window)
        return 0
    lines = []
    for name, tables in runs:
        summary = ", ".join(f"{kind} {t[max(t)]:.4f} at step {max(t)}" for kind, t in tables.items() if t)
        lines.append((name + ": " if several else "") + summary)
    print(f"plot_loss: wrote {out} ({backend}; last: {'; '.join(lines)})")
    first_name, first_train = runs[0][0], runs[0][1]["train"]
    for name, tables in runs[1:]:
        worst, last = compare(first_train, tables["train"], args.warmup)
        if last is None:
            print(f"plot_loss: {name} and {first_name} share no train step")
            continue
        text = f"plot_loss: {name} against {first_name}: "
        if worst:
            text += f"largest relative difference after step {args.warmup} {worst[0] * 100:.2f}% (step {worst[1]}), "
        text += f"at the last shared step {last[1]} {last[0] * 100:.2f}% ({last[2]:.4f} against {last[3]:.4f})"
        print(text)
        if args.window:
            windows = compare_windows(first_train, tables["train"], args.warmup, args.window)
            text = f"plot_loss: {name} against {first_name}, {args.window}-step means after step {args.warmup}: "
            if not windows:
                print(text + f"fewer than {args.window} shared steps")
                continue
            worst = max(windows, key=lambda w: abs(w[0]))
            last_window = windows[-1]
            print(text + f"largest {worst[0] * 100:+.2f}% (steps {worst[1]}-{worst[2]}), "
                  f"last {last_window[0] * 100:+.2f}% (steps {last_window[1]}-{last_window[2]}); all: "
                  + " ".join(f"{w[0] * 100:+.2f}" for w in windows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
