#!/usr/bin/env bash
# Data-parallel scaling of GPT-2 training on one node: loom-train on 1 GPU, then `loom-run --nproc-per-node N` with
# the same per-GPU batch (so the global batch grows N-fold), and the ratio of the world's tokens/s (median of the
# steps after the fifth, from each run's metrics.jsonl). Run from the repository root on a machine with N GPUs after
# tools/device/build.sh. Environment: NPROC (2), B (16 per GPU), STEPS (30), MODEL (124m), DATA (an llm.c shard;
# default: the synthetic shard of tools/bench/make_shard.py), EXTRA (more loom-train flags, e.g. --zero1).
set -uo pipefail
NPROC=${NPROC:-2}; B=${B:-16}; T=1024; STEPS=${STEPS:-30}; MODEL=${MODEL:-124m}
DIR=${DIR:-${OUT:-/tmp}/scaling}; mkdir -p "$DIR"
DATA=${DATA:-/tmp/e2e_shard.bin}
[ -f "$DATA" ] || python3 tools/bench/make_shard.py "$DATA" --tokens $(( (STEPS + 2) * B * T * NPROC + 1 )) || exit 1
common="--model gpt2-$MODEL --dtype bf16 -b $B -t $T --steps $STEPS --device cuda --eval-interval 0 --sample-tokens 0
  --train-data $DATA ${EXTRA:-}"
echo "== 1 GPU: gpt2-$MODEL B=$B"
timeout ${LOOM_TIMEOUT:-240} build-dev/loom-train $common --log-dir "$DIR/gpu1" > "$DIR/gpu1.log" 2>&1 || tail -5 "$DIR/gpu1.log"
echo "== $NPROC GPUs: gpt2-$MODEL B=$B per GPU ${EXTRA:-}"
timeout ${LOOM_TIMEOUT:-240} build-dev/loom-run --nproc-per-node $NPROC build-dev/loom-train $common \
  --total-batch-tokens $(( B * T * NPROC )) --log-dir "$DIR/gpu$NPROC" > "$DIR/gpu$NPROC.log" 2>&1 || tail -5 "$DIR/gpu$NPROC.log"
python3 - "$DIR/gpu1/metrics.jsonl" "$DIR/gpu$NPROC/metrics.jsonl" $NPROC <<'PY'
import json, statistics, sys, os
def tok(path):
    if not os.path.exists(path): return None, []
    v, loss = [], []
    for line in open(path):
        j = json.loads(line)
        if j.get("perf/tokens_per_second") is not None:
            v.append(j["perf/tokens_per_second"]); loss.append(j.get("train/loss"))
    return (statistics.median(v[5:] or v) if v else None), loss
one, l1 = tok(sys.argv[1]); many, ln = tok(sys.argv[2]); n = int(sys.argv[3])
print(f"{'GPUs':>5}{'tokens/s':>12}{'per GPU':>12}")
if one: print(f"{1:>5}{one:12.0f}{one:12.0f}")
if many: print(f"{n:>5}{many:12.0f}{many / n:12.0f}")
if one and many: print(f"scaling {many / one:.3f}x on {n} GPUs ({many / one / n * 100:.1f}% efficiency)")
if l1 and ln: print("loss at the last step: 1 GPU %.4f, %d GPUs %.4f (different global batches)" % (l1[-1], n, ln[-1]))
PY
