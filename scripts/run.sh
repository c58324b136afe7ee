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
# The settings are configs/gpt2-shakespeare-run.toml's; flags on the command line win over it. Its 20 warmup steps
# are cut to a shorter run's length (LOOM_STEPS=10 for a quick look).
STEPS=${LOOM_STEPS:-200}
"$BIN/loom-train" --config configs/gpt2-shakespeare-run.toml --steps "$STEPS" --warmup $((STEPS < 20 ? STEPS : 20)) \
  --device "${LOOM_DEVICE:-cpu}"
