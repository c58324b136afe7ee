#!/usr/bin/env bash
# The main job: installs what is missing, builds Loom, prepares tiny Shakespeare into GPT-2 token shards, trains a
# small GPT-2 on the CPU for a few minutes (validation loss printed as it falls), prints a generated sample and saves
# a checkpoint under out/. Environment: LOOM_DATA_DIR (where tinyshakespeare.txt is), LOOM_STEPS, LOOM_DEVICE.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/fetch_gpt2_vocab.sh
./scripts/build.sh
BIN=${LOOM_BUILD_DIR:-build}
DATA_DIR=data/tinyshakespeare
if [ ! -f "$DATA_DIR/tinyshakespeare_train_000000.bin" ]; then
  "$BIN/loom-prepare" --input tinyshakespeare.txt --output-dir "$DATA_DIR"
fi
"$BIN/loom-train" --model configs/gpt2-shakespeare.json \
  --train-data "$DATA_DIR/tinyshakespeare_train_*.bin" --val-data "$DATA_DIR/tinyshakespeare_val_*.bin" \
  --batch-size 8 --seq-len 128 --steps "${LOOM_STEPS:-200}" --lr 1e-3 --warmup 20 --decay cosine \
  --eval-interval 50 --eval-batches 8 --sample-tokens 96 --sample-prompt "ROMEO:" \
  --device "${LOOM_DEVICE:-cpu}" --log-dir out/shakespeare --checkpoint-dir out/shakespeare/checkpoints \
  --overwrite-checkpoints --log-interval 10   # a second run of the demo replaces its checkpoints
