#!/usr/bin/env bash
# One run's worth of performance work, from the repository root on the GPU machine (with .devdeps beside the tree):
# builds Loom (tools/device/build.sh) while a short PyTorch run fills torch.compile's cache in the background, runs
# the CUDA tests matching $TESTS, then the end-to-end benchmark (tools/bench/e2e_gpt2.sh) for each model in $MODELS
# (default 124m; GPT-2 sizes or llama3-1b, as e2e_gpt2.sh's MODEL) and each batch size: $BATCHES for GPT-2 (default 16,
# T = 1024), $LLAMA_BATCHES for LLaMA (default 4, T = $LLAMA_T: default 2048, 256 for llama3-tiny), with Loom's per-op
# breakdown for the batch sizes in $PROFILE_BATCHES (default 16), and packs the logs into $OUT/bench.tgz. With a LLaMA
# model in $MODELS, a short PyTorch LLaMA run at its first batch size also fills torch.compile's cache during the
# build. E2E_TIMEOUT: seconds per benchmark (default 300 for GPT-2, 420 for LLaMA). SAME_INIT=1 starts Loom from
# PyTorch's initial weights (see e2e_gpt2.sh) for step-by-step loss comparison.
# CONFORMANCE='...' also runs `loom-conformance --provider native --device cuda ...` with those flags (CONF_TIMEOUT
# seconds, default 240) after the tests; MODELS=none skips the benchmarks.
#   TESTS='Cuda*' BATCHES='16 32' MODELS='124m' tools/bench/device_session.sh
#   TESTS='*Cuda*' CONFORMANCE='--fuzz 20' MODELS=none tools/bench/device_session.sh
#   MODELS='124m llama3-1b' BATCHES=16 LLAMA_BATCHES=4 STEPS=20 SAME_INIT=1 tools/bench/device_session.sh
# FP8='all' (or 'linear all', FP8_FLAGS='--fp8-amax-history 16') also runs Loom with --dtype bf16 --fp8 SCOPE after its
# bf16 run, in the same call, and reports FP8 beside bf16 (tokens/s, ratios, the loss difference; e2e_gpt2.sh):
#   TESTS='CudaFp8*' FP8=all MODELS='124m' BATCHES=32 STEPS=30 tools/bench/device_session.sh
# DATA: a token shard for every model instead of the synthetic Markov chain (tools/bench/make_shard.py), which is
# fine for speed but no test of a loss: its loss drops suddenly at a step that varies between runs. For FP8's loss,
# text (loom-prepare's shards; LOOM_FLAGS='--val-data VAL.bin' adds a validation loss):
#   DATA=data/tinyshakespeare/tinyshakespeare_train_000000.bin SKIP_TORCH=1 FP8=all STEPS=1000 BATCHES=32 tools/bench/device_session.sh
# GRAPH=1 also runs Loom's bf16 step as a CUDA graph (--cuda-graph) and reports it beside eager (e2e_gpt2.sh):
#   TESTS='CudaGraph*' GRAPH=1 FP8=all MODELS='124m llama3-1b' BATCHES=32 LLAMA_BATCHES=8 tools/bench/device_session.sh
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"; W=/tmp/bench; mkdir -p $W
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee $W/gpu.txt
python3 tools/bench/make_shard.py /tmp/e2e_shard.bin --tokens ${SHARD_TOKENS:-2000000} > $W/shard.log 2>&1 &
is_llama() { case "$1" in llama*|mixtral*) return 0;; esac; return 1; }  # the LLaMA family (Mixtral too)
gpt2_models=0; llama_warm=""
for m in ${MODELS:-124m}; do
  if ! is_llama $m; then gpt2_models=1; elif [ -z "$llama_warm" ] && [ "${m%-tiny}" = "$m" ]; then llama_warm=$m; fi
done
read -r llama_b0 _ <<< "${LLAMA_BATCHES:-4}"
[ "${MODELS:-124m}" = none ] && gpt2_models=0
[ "${SKIP_TORCH:-0}" = 1 ] && { gpt2_models=0; llama_warm=""; }  # no PyTorch run to warm
(if [ $gpt2_models = 1 ]; then
   PYTHONUNBUFFERED=1 timeout 300 python3 tools/bench/pytorch_gpt2.py -b 16 --steps 2 > $W/torch_warm.log 2>&1
 fi
 if [ -n "$llama_warm" ]; then
   PYTHONUNBUFFERED=1 timeout 300 python3 tools/bench/pytorch_llama.py --model $llama_warm -b $llama_b0 \
     -t ${LLAMA_T:-2048} --steps 2 > $W/torch_warm_llama.log 2>&1
 fi) &
warm=$!
stamp "building"
. tools/device/build.sh || { cp build-dev.log $O/; exit 1; }
cp build-dev.log $W/
stamp "built"
if [ -n "${TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-150} build-dev/tests/loom_tests --gtest_filter="$TESTS" --gtest_brief=1 > $W/tests.log 2>&1
  echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED) |FAILED TEST|tests ran" $W/tests.log | head -30
  stamp "tests done"
fi
if [ -n "${CONFORMANCE:-}" ]; then
  stamp "conformance"
  timeout ${CONF_TIMEOUT:-240} build-dev/loom-conformance --provider native --device cuda $CONFORMANCE \
    --json $W/conformance.json > $W/conformance.txt 2>&1
  echo "conformance rc=$?"; grep -v " pass " $W/conformance.txt | head -40; grep -c " pass " $W/conformance.txt
  stamp "conformance done"
fi
[ "${MODELS:-124m}" = none ] && { tar czf $O/bench.tgz -C /tmp bench; stamp "done"; exit 0; }
wait; tail -2 $W/torch_warm.log 2>/dev/null; tail -2 $W/torch_warm_llama.log 2>/dev/null
for m in ${MODELS:-124m}; do
  if is_llama $m; then batches=${LLAMA_BATCHES:-4}; t=${LLAMA_T:-2048}; limit=${E2E_TIMEOUT:-420}
    [ "${m%-tiny}" != "$m" ] && t=${LLAMA_T:-256}  # its context
  else batches=${BATCHES:-16}; t=1024; limit=${E2E_TIMEOUT:-300}; fi
  data=/tmp/e2e_shard.bin; case $m in *-tiny|mixtral*) data= ;; esac  # e2e_gpt2.sh makes a shard of their vocabulary
  [ -n "${DATA:-}" ] && data=$DATA
  for b in $batches; do
    stamp "e2e $m B=$b T=$t"
    prof=0; case " ${PROFILE_BATCHES:-16} " in *" $b "*) prof=1;; esac
    DIR=$W MODEL=$m B=$b T=$t PROFILE=$prof STEPS=${STEPS:-30} DATA=$data SAME_INIT=${SAME_INIT:-0} \
      timeout $limit tools/bench/e2e_gpt2.sh > $W/e2e_${m}_b$b.txt 2>&1
    grep -v "^step" $W/e2e_${m}_b$b.txt | tail -${TAIL:-60}
  done
done
tar czf $O/bench.tgz -C /tmp bench
stamp "done"
