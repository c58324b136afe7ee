#!/usr/bin/env bash
# Hugging Face export, import and loom-generate against transformers, on the GPU machine (torch, transformers and
# safetensors installed; .devdeps beside the tree):
# builds Loom with CUDA into build-dev/ (tools/device/build.sh) unless BUILD=0, then runs tools/reference/hf_check.py:
# Loom's `loom-export --hf` directories of a tiny GPT-2 and a tiny LLaMA loaded by transformers' from_pretrained with
# equal logits (f32, 1e-5 relative) and equal greedy tokens, and random sharded LLaMAs/GPT-2 saved by transformers
# loaded by Loom with equal logits. Loom runs on the CPU and on CUDA. Prints a PASS/FAIL table; the JSON goes to $OUT.
#   tools/device/hf_check.sh            (DEVICES=cpu,cuda TOL=1e-5 BUILD=1)
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
if [ "${BUILD:-1}" = 1 ]; then
  . tools/device/build.sh || exit 1
else
  D=$PWD/.devdeps
  export LD_LIBRARY_PATH=$D/usr/lib/openblas:${LD_LIBRARY_PATH:-}
fi
python3 -c "import torch, transformers, safetensors" 2>/dev/null ||
  { echo "hf_check: this machine lacks torch, transformers or safetensors"; exit 2; }
# The GPT-2 tokenizer export needs GPT-2's vocabulary, which the machine cannot fetch: before the call,
# `mkdir -p .device/cache && cp -r ~/.cache/loom/gpt2 .device/cache/` here and carry ".device" (without it the
# tokenizer row fails and says so).
[ -f .device/cache/gpt2/encoder.json ] && export LOOM_CACHE_DIR=$PWD/.device/cache
python3 tools/reference/hf_check.py --bin build-dev --work /tmp/hf_check --devices "${DEVICES:-cpu,cuda}" \
  --tol "${TOL:-1e-5}" --out "$O" 2>&1 | tee "$O/hf_check.log"
exit ${PIPESTATUS[0]}
