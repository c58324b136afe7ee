#!/usr/bin/env bash
# One device call's worth of performance work, from the repository root on the GPU machine (carry .devdeps):
# builds Loom (tools/device/build.sh) while a short PyTorch run fills torch.compile's cache in the background, runs
# the CUDA tests matching $TESTS, then the end-to-end benchmark (tools/bench/e2e_gpt2.sh) for each batch size in
# $BATCHES (Loom's per-op breakdown for those in $PROFILE_BATCHES, default 16), and packs the logs into $OUT/bench.tgz.
# SAME_INIT=1 starts Loom from PyTorch's initial weights (see e2e_gpt2.sh) for step-by-step loss comparison.
#   TESTS='Cuda*' BATCHES='16 32' MODELS='124m' tools/bench/device_session.sh
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"; W=/tmp/bench; mkdir -p $W
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee $W/gpu.txt
python3 tools/bench/make_shard.py /tmp/e2e_shard.bin --tokens ${SHARD_TOKENS:-2000000} > $W/shard.log 2>&1 &
(PYTHONUNBUFFERED=1 timeout 300 python3 tools/bench/pytorch_gpt2.py -b 16 --steps 2 > $W/torch_warm.log 2>&1) &
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
wait; tail -2 $W/torch_warm.log
for m in ${MODELS:-124m}; do
  for b in ${BATCHES:-16}; do
    stamp "e2e $m B=$b"
    prof=0; case " ${PROFILE_BATCHES:-16} " in *" $b "*) prof=1;; esac
    DIR=$W MODEL=$m B=$b PROFILE=$prof STEPS=${STEPS:-30} DATA=/tmp/e2e_shard.bin SAME_INIT=${SAME_INIT:-0} \
      timeout ${E2E_TIMEOUT:-300} tools/bench/e2e_gpt2.sh > $W/e2e_${m}_b$b.txt 2>&1
    grep -v "^step" $W/e2e_${m}_b$b.txt | tail -${TAIL:-60}
  done
done
tar czf $O/bench.tgz -C /tmp bench
stamp "done"
