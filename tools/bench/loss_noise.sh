#!/usr/bin/env bash
# How far apart two correct bf16 runs of GPT-2 can be, step by step, from the same initial weights and data: PyTorch
# compiled (bf16 autocast), PyTorch eager (bf16), PyTorch f32 (no autocast, no TF32) and Loom in bf16 and in f32, each
# for STEPS steps at batch B, printed side by side (loss and gradient norm per step). The spread between the PyTorch
# runs is the noise a Loom-vs-PyTorch difference is judged against. Run on a GPU machine after tools/device/build.sh,
# from the repository root:  B=32 STEPS=12 tools/bench/loss_noise.sh
set -uo pipefail
B=${B:-32}; T=1024; STEPS=${STEPS:-12}; DIR=${DIR:-/tmp/bench/noise}; mkdir -p "$DIR"
DATA=${DATA:-/tmp/e2e_shard.bin}; INIT=/tmp/e2e_init_noise.safetensors
[ -f "$DATA" ] || python3 tools/bench/make_shard.py "$DATA" --tokens 2000000 || exit 1
torch_run() {  # name, flags
  PYTHONUNBUFFERED=1 python3 tools/bench/pytorch_gpt2.py -b $B -t $T --steps $STEPS --data "$DATA" "${@:2}" \
    2>&1 | grep -v Warning > "$DIR/$1.log"
}
loom_run() {  # name, dtype
  timeout 200 build-dev/loom-train --model gpt2-124m --dtype $2 -b $B -t $T --steps $STEPS --device cuda \
    --eval-interval 0 --sample-tokens 0 --train-data "$DATA" --init-from "$INIT" > "$DIR/$1.log" 2>&1
}
rm -f "$INIT"
torch_run torch_compiled_bf16 --save-init "$INIT"
torch_run torch_eager_bf16 --no-compile
torch_run torch_f32 --no-compile --precision f32
loom_run loom_bf16 bf16
loom_run loom_f32 f32
python3 - "$DIR" <<'PY'
import re, sys
d = sys.argv[1]
names = ["torch_compiled_bf16", "torch_eager_bf16", "torch_f32", "loom_bf16", "loom_f32"]
runs = {}
for n in names:
    rows = []
    for line in open(f"{d}/{n}.log"):
        m = re.search(r"^step\s+(\d+)/\d+ \| loss ([\d.naninf]+) .*norm ([\d.naninf]+)", line)
        if m: rows.append((float(m.group(2)), float(m.group(3))))
    runs[n] = rows
print("loss (gradient norm) per step, GPT-2 124M, same initial weights and data")
print("step " + "".join(f"{n:>24}" for n in names))
for i in range(max(len(r) for r in runs.values())):
    cells = [f"{r[i][0]:.4f} ({r[i][1]:8.3f})" if i < len(r) else "-" for r in runs.values()]
    print(f"{i + 1:4d} " + "".join(f"{c:>24}" for c in cells))
PY
