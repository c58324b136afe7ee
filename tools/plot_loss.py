#!/usr/bin/env python3
"""Plots train and validation loss against step from a loom-train metrics.jsonl to a PNG.

    python3 tools/plot_loss.py out/logs/metrics.jsonl -o loss.png
    python3 tools/plot_loss.py out/logs                 # the directory's metrics.jsonl, writes out/logs/loss.png
    python3 tools/plot_loss.py logs_bf16 logs_fp8 --label bf16 --label fp8 --warmup 100 -o bf16_fp8.png

Several runs are drawn on one plot, a color each (labels: --label, in order, else each run's directory name), and
each run after the first is compared with the first step by step: the largest relative difference of its train loss
after --warmup steps, and at the last step both share; with --window N also the mean of each N steps after the
warm-up (the windows ending at the last shared step), which is what two runs of one text can resolve.

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
import struct
import sys
import zlib


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

def plot_matplotlib(series, out_path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for label, xs, ys, color, markers in series:
        ax.plot(xs, ys, label=label, color=color, marker="o" if markers else None, markersize=3, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
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


def plot_builtin(series, out_path, title, width=800, height=500):
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
    c.text(6, top + ph // 2 - GLYPH_H, "loss", scale=2)
    c.text(width // 2 - c.text_width(title, 2) // 2, 10, title, scale=2)

    for label, xs, ys, color, markers in series:
        pts = [(sx(x), sy(y)) for x, y in zip(xs, ys)]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            c.line(x0, y0, x1, y1, color, width=1.6)
        if markers or len(pts) == 1:
            for x, y in pts:
                c.rect(int(round(x)) - 2, int(round(y)) - 2, int(round(x)) + 2, int(round(y)) + 2, color)

    # Legend, top right inside the plot.
    legend_w = 30 + max(c.text_width(label) for label, _, _, _, _ in series) + 16
    lx, ly = left + pw - legend_w, top + 10
    c.rect(lx - 8, ly - 6, left + pw - 8, ly + 16 * len(series) - 2, (255, 255, 255))
    for i, (label, _, _, color, _) in enumerate(series):
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


def compare_windows(first, other, warmup, window):
    """Relative differences of `other`'s mean train loss from `first`'s over windows of `window` consecutive steps
    both have after `warmup`, the windows ending at the last such step (a partial one at the start is left out), as
    [(difference, first step, last step)], oldest first. Same batches at each step make single steps swing with the
    runs' trajectories; window means are what a precision comparison can resolve."""
    steps = [s for s in sorted(set(first) & set(other)) if s > warmup]
    steps = steps[len(steps) % window:]
    out = []
    for i in range(0, len(steps), window):
        chunk = steps[i:i + window]
        a = sum(first[s] for s in chunk) / window
        b = sum(other[s] for s in chunk) / window
        out.append(((b - a) / abs(a) if a else math.inf, chunk[0], chunk[-1]))
    return out


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
    if len(paths) > len(PALETTE):
        print(f"plot_loss: error: at most {len(PALETTE)} runs on one plot ({len(paths)} given)", file=sys.stderr)
        return 1
    runs = []  # (name, {kind: {step: loss}}) with the kinds of KINDS
    for n, path in enumerate(paths):
        tables = dict(zip(KINDS, read_metrics(path)))
        if not any(tables.values()):
            print(f"plot_loss: error: {path} has no finite train/loss, val/loss or train_data/loss values",
                  file=sys.stderr)
            return 1
        name = args.label[n] if args.label else os.path.basename(os.path.dirname(os.path.abspath(path)))
        runs.append((name, tables))
    out = args.output or os.path.join(os.path.dirname(os.path.abspath(paths[0])), "loss.png")

    # (label, steps, values, color, markers): one run takes a color per kind, several runs a color each. The train
    # loss is a line (labelled by the run's name when there are several), the evaluations are points.
    series = []
    several = len(runs) > 1
    for n, (name, tables) in enumerate(runs):
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
        names = dict(zip(PALETTE, MATPLOTLIB_COLORS))
        plot_matplotlib([(l, x, y, names[c], m) for l, x, y, c, m in series], out, args.title)
    else:
        plot_builtin(series, out, args.title)
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
