#!/usr/bin/env bash
# Installs what is missing, builds Loom (CUDA code too when nvcc is present: compile and link only without a GPU)
# and runs the whole test suite with ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/fetch_gpt2_vocab.sh >/dev/null || echo "warning: could not fetch the GPT-2 vocabulary; tokenizer tests will skip"
./scripts/build.sh
cd "${LOOM_BUILD_DIR:-build}"
ctest --output-on-failure -j "$(nproc)" "$@"
