#!/usr/bin/env bash
# Writes tests/fixtures/former_checkpoints/: checkpoints of a tiny GPT-2 at step 2 as the trainer in
# ${LOOM_BUILD_DIR:-build} writes them (sharded by ZeRO-3 over 2 ranks, a single file from one process, a single file
# with per-rank optimizer files from ZeRO-1 over 2 ranks), and expected.json: the losses and gradient norms that trainer
# gives uninterrupted and resumed from them. Kept so that later trainers are held to load what earlier ones wrote
# (tests/checkpoint_fixture_test.cc, tests/distributed/dist_check.cc). The committed files were written by the trainer
# that came before the mesh and the plan: regenerating them would hold the trainer to itself only.
set -euo pipefail
ROOT=$(realpath "$(dirname "$0")/../..")
BIN=$(realpath "$ROOT/${LOOM_BUILD_DIR:-build}/loom-train")
OUT=$ROOT/tests/fixtures/former_checkpoints
rm -rf "$OUT"; mkdir -p "$OUT"
cd "$OUT"
python3 $ROOT/tools/bench/make_shard.py train.bin --tokens 4096 --vocab 64 --seed 5 > /dev/null
cat > model.json <<'J'
{"family": "gpt2", "vocab_size": 64, "padded_vocab_size": 64, "max_seq_len": 16, "n_layer": 2, "n_head": 2, "n_embd": 16}
J
MPI="mpirun --oversubscribe --allow-run-as-root -x OMP_NUM_THREADS=1"
COMMON="--model model.json --train-data train.bin -b 2 -t 8 --total-batch-tokens 64 --lr 1e-2 --warmup 1 --eval-interval 0 --sample-tokens 0 --seed 7"
W=$(mktemp -d)
# The checkpoints: ZeRO-3 over 2 ranks (sharded) and one process (a single file), at step 2.
$MPI -np 2 $BIN $COMMON --steps 2 --zero 3 --checkpoint-dir zero3_x2 > $W/a.txt
$BIN $COMMON --steps 2 --checkpoint-dir single --checkpoint-format single > $W/b.txt
$MPI -np 2 $BIN $COMMON --steps 2 --zero 1 --checkpoint-dir zero1_x2_single --checkpoint-format single > $W/c.txt
rm -f zero3_x2/.loom_write_probe single/.loom_write_probe zero1_x2_single/.loom_write_probe
# What the former trainer gives: uninterrupted to step 4, and resumed from the checkpoints.
metrics() { python3 -c '
import json,sys
out=[]
for l in open(sys.argv[1]):
    j=json.loads(l)
    if "train/loss" in j: out.append([j["step"], j["train/loss"], j["train/grad_norm"]])
print(json.dumps(out))' "$1"; }
$MPI -np 2 $BIN $COMMON --steps 4 --zero 3 --log-dir $W/u2 > /dev/null
$BIN $COMMON --steps 4 --log-dir $W/u1 > /dev/null
cp -r zero3_x2 $W/r; cp -r single $W/s; cp -r zero1_x2_single $W/z
$BIN --resume $W/r/step_000002 --train-data train.bin --steps 4 --checkpoint-dir $W/x1 --log-dir $W/r1 > /dev/null
$MPI -np 4 $BIN --resume $W/r/step_000002 --train-data train.bin --steps 4 --zero 3 --checkpoint-dir $W/x4 --log-dir $W/r4 > /dev/null
$MPI -np 2 $BIN --resume $W/r/step_000002 --train-data train.bin --steps 4 --zero 3 --checkpoint-dir $W/x2 --log-dir $W/r2 > /dev/null
$BIN --resume $W/s/step_000002.safetensors --train-data train.bin --steps 4 --checkpoint-dir $W/y1 --log-dir $W/s1 > /dev/null
$MPI -np 2 $BIN --resume $W/z/step_000002.safetensors --train-data train.bin --steps 4 --zero 1 --checkpoint-dir $W/z2 --log-dir $W/z2l > /dev/null
cat > expected.json <<J
{"uninterrupted_zero3_x2": $(metrics $W/u2/metrics.jsonl),
 "uninterrupted_one_rank": $(metrics $W/u1/metrics.jsonl),
 "zero3_x2_resumed_by_one_rank": $(metrics $W/r1/metrics.jsonl),
 "zero3_x2_resumed_by_zero3_x2": $(metrics $W/r2/metrics.jsonl),
 "zero3_x2_resumed_by_zero3_x4": $(metrics $W/r4/metrics.jsonl),
 "single_resumed_by_one_rank": $(metrics $W/s1/metrics.jsonl),
 "zero1_x2_single_resumed_by_zero1_x2": $(metrics $W/z2l/metrics.jsonl)}
J
rm -rf $W
cat expected.json
