#!/usr/bin/env bash
# FP8's own effect on a small model's loss, seed by seed: a byte-level GPT-2 (2 layers, width 128, 446K parameters)
# trained STEPS (1500) steps at B = 16, T = 128 on the first 32K bytes of tiny Shakespeare (about 90 passes, so it
# memorizes them; validation on 20K bytes from elsewhere in the text), for each seed in SEEDS in bf16 and under each
# FP8 recipe in RECIPES. One seed gives every run of it the same initial weights and batches, so a recipe's
# difference from that seed's bf16 run is FP8's doing; on the CPU the runs are bit-reproducible and the difference is
# exact, on a GPU it carries the GPU's run-to-run spread too. Different seeds show how far trajectories part anyway.
# TRAIN_BYTES (32769) sets how much text it trains on: 1000000 is about 3 passes, so a run learns the text rather
# than memorizing it.
#
#   tools/bench/fp8_loss_pairs.sh                                  # the CPU (each run one thread, JOBS at once)
#   DEVICE=cuda RECIPES='current delayed16 current_none delayed16_none' tools/bench/fp8_loss_pairs.sh
#
# RECIPES, from: current (--fp8 all), delayed16 (--fp8 all --fp8-amax-history 16), and either with _none
# (--fp8-fast-accumulation none; the CPU's products have no fast accumulator, so there they equal the first two).
# LOOM (build/loom-train, else build-dev/loom-train), TEXT (tiny Shakespeare's text: data/tinyshakespeare/ or
# ../shared/data/), JOBS (the cores, on the CPU), DIR (where the data, logs and summary go; default /tmp/fp8_pairs).
# Prints, per seed and recipe, the last 50-step window's mean loss against bf16's, and the validation loss at the end
# and at its lowest; then each recipe's mean over the seeds.
set -uo pipefail
DEVICE=${DEVICE:-cpu}; STEPS=${STEPS:-1500}; SEEDS=${SEEDS:-1 2 3}; RECIPES=${RECIPES:-current delayed16}
DIR=${DIR:-/tmp/fp8_pairs}; TRAIN_BYTES=${TRAIN_BYTES:-32769}
LOOM=${LOOM:-}
if [ -z "$LOOM" ]; then
  for candidate in build/loom-train build-dev/loom-train; do [ -x "$candidate" ] && LOOM=$candidate && break; done
fi
if [ -z "$LOOM" ] || [ ! -x "$LOOM" ]; then
  echo "fp8_loss_pairs.sh: no loom-train (build it, or set LOOM)" >&2; exit 2
fi
TEXT=${TEXT:-}
if [ -z "$TEXT" ]; then
  for candidate in data/tinyshakespeare/tinyshakespeare.txt ../shared/data/tinyshakespeare.txt; do
    [ -f "$candidate" ] && TEXT=$candidate && break
  done
fi
if [ -z "$TEXT" ] || [ ! -f "$TEXT" ]; then
  echo "fp8_loss_pairs.sh: no tiny Shakespeare text (set TEXT)" >&2; exit 2
fi
if ! [[ $STEPS =~ ^[1-9][0-9]*$ ]] || [ "$STEPS" -lt 200 ]; then
  echo "fp8_loss_pairs.sh: STEPS must be a whole number of 200 or more, not '$STEPS'" >&2; exit 2
fi
if ! [[ $TRAIN_BYTES =~ ^[1-9][0-9]*$ ]] || [ "$TRAIN_BYTES" -lt 2049 ] || [ "$TRAIN_BYTES" -gt 1000000 ]; then
  echo "fp8_loss_pairs.sh: TRAIN_BYTES must be a whole number from 2049 to 1000000, not '$TRAIN_BYTES'" >&2; exit 2
fi
flags_of() {
  case $1 in
    current) echo "--fp8 all" ;;
    delayed16) echo "--fp8 all --fp8-amax-history 16" ;;
    current_none) echo "--fp8 all --fp8-fast-accumulation none" ;;
    delayed16_none) echo "--fp8 all --fp8-amax-history 16 --fp8-fast-accumulation none" ;;
    *) return 1 ;;
  esac
}
for recipe in $RECIPES; do
  flags_of "$recipe" > /dev/null ||
    { echo "fp8_loss_pairs.sh: unknown recipe '$recipe' (current, delayed16, current_none, delayed16_none)" >&2
      exit 2; }
done
for seed in $SEEDS; do
  [[ $seed =~ ^[0-9]+$ ]] || { echo "fp8_loss_pairs.sh: a seed must be a whole number, not '$seed'" >&2; exit 2; }
done
mkdir -p "$DIR"
# The text's bytes as tokens (an llm.c uint16 shard) and the model over 256 byte values.
python3 - "$TEXT" "$DIR" "$TRAIN_BYTES" <<'PY' || exit 1
import struct, sys
from array import array
text = open(sys.argv[1], "rb").read()
if len(text) < 1_020_000:
    sys.exit(f"fp8_loss_pairs.sh: {sys.argv[1]} has {len(text)} bytes, fewer than tiny Shakespeare's")
for name, part in (("train", text[:int(sys.argv[3])]), ("val", text[1_000_000:1_020_000])):
    tokens = array("H", list(part))
    with open(f"{sys.argv[2]}/{name}.bin", "wb") as f:
        f.write(struct.pack("<3i", 20240520, 1, len(tokens)) + bytes(4 * 253))
        tokens.tofile(f)
PY
cat > "$DIR/byte_gpt2.json" <<'JSON'
{"family": "gpt2", "vocab_size": 256, "padded_vocab_size": 256, "max_seq_len": 128, "n_layer": 2, "n_head": 4,
 "n_embd": 128, "dropout": 0.0}
JSON
THREADS=(); [ "$DEVICE" = cpu ] && THREADS=(env OMP_NUM_THREADS=1)
JOBS=${JOBS:-$([ "$DEVICE" = cpu ] && nproc || echo 1)}
run() {  # seed, recipe
  local flags=""
  [ "$2" = bf16 ] || flags=$(flags_of "$2")
  # shellcheck disable=SC2086
  "${THREADS[@]}" "$LOOM" --model "$DIR/byte_gpt2.json" --dtype bf16 -b 16 -t 128 --steps "$STEPS" --device "$DEVICE" \
    --train-data "$DIR/train.bin" --val-data "$DIR/val.bin" --eval-interval $((STEPS / 6)) --sample-tokens 0 \
    --seed "$1" $flags > "$DIR/${2}_seed$1.log" 2>&1 ||
    echo "fp8_loss_pairs.sh: run $2, seed $1 failed (see $DIR/${2}_seed$1.log)"
}
echo "== $STEPS steps of a byte-level GPT-2 on $DEVICE over $TRAIN_BYTES bytes, seeds $SEEDS: bf16 and $RECIPES" \
  "($JOBS at once; logs in $DIR)"
for seed in $SEEDS; do
  for recipe in bf16 $RECIPES; do
    run "$seed" "$recipe" &
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
  done
done
wait
python3 - "$DIR" "$STEPS" "$SEEDS" "$RECIPES" "$(dirname "$0")/../.." <<'PY' | tee "$DIR/summary.txt"
import sys
d, steps, seeds, recipes = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
sys.path.insert(0, f"{sys.argv[5]}/tools")
from plot_loss import read_metrics  # reads loom-train's printed lines too
def read(name):
    try:
        train, val, _ = read_metrics(f"{d}/{name}.log")
        return train, val
    except OSError:
        return {}, {}
last = [s for s in range(steps - 49, steps + 1)]
mean = lambda t: sum(t[s] for s in last) / len(last)
totals = {r: [] for r in recipes}
print("last 50 steps' mean loss against the same seed's bf16 run; validation loss at the end and at its lowest")
for seed in seeds:
    b_train, b_val = read(f"bf16_seed{seed}")
    if not all(s in b_train for s in last) or not b_val:
        print(f"seed {seed}: bf16 run incomplete"); continue
    print(f"seed {seed}: bf16 {mean(b_train):.4f}; validation {b_val[max(b_val)]:.4f}, "
          f"lowest {min(b_val.values()):.4f}")
    for r in recipes:
        t, v = read(f"{r}_seed{seed}")
        if not all(s in t for s in last) or not v:
            print(f"  {r:15} incomplete"); continue
        diff = (mean(t) - mean(b_train)) / mean(b_train) * 100
        totals[r].append(diff)
        print(f"  {r:15} {mean(t):.4f} ({diff:+.2f}%); validation {v[max(v)]:.4f} "
              f"({(v[max(v)] - b_val[max(b_val)]) / b_val[max(b_val)] * 100:+.2f}%), lowest {min(v.values()):.4f}")
for r, diffs in totals.items():
    if diffs:
        print(f"{r}: mean over {len(diffs)} seeds {sum(diffs) / len(diffs):+.2f}% (each: "
              + " ".join(f"{x:+.2f}%" for x in diffs) + ")")
PY
