#!/usr/bin/env bash
# One device call on an nvidia-h200-x2 machine (carry .devdeps): builds, runs the CUDA tests matching $TESTS, the
# distributed checks over NCCL on 2 GPUs, and short loom-train runs (1 GPU, DDP, ZeRO-1, TP=2) on a random shard,
# printing the losses side by side.
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
. tools/device/build.sh || exit 1
if [ -n "${TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-240} build-dev/tests/loom_tests --gtest_filter="$TESTS" --gtest_brief=1 > $O/tests.log 2>&1
  echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED TEST|tests ran|Failure|error" $O/tests.log | head -30
fi
timeout 240 build-dev/loom-run --nproc-per-node 2 build-dev/tests/loom_distributed_check --device cuda > $O/dist_check.log 2>&1
echo "dist_check rc=$?"; grep -v "^NCCL" $O/dist_check.log | tail -30
python3 tools/make_random_shard.py /tmp/r.bin 400000 > /dev/null
C="--device cuda --model d4 --train-data /tmp/r.bin -t 256 --total-batch-tokens 8192 --steps 12 --warmup 2 --eval-interval 0 --sample-tokens 0 --log-interval 4 ${TRAIN_ARGS:-}"
run() { local name=$1; shift; timeout 180 "$@" $C --log-dir /tmp/o_$name > $O/train_$name.log 2>&1; echo "$name rc=$?"; grep -E "^step" $O/train_$name.log | sed "s/^/  $name /" | cut -c1-110; }
run gpu1 build-dev/loom-train -b 32
run ddp build-dev/loom-run --nproc-per-node 2 build-dev/loom-train -b 16
run zero1 build-dev/loom-run --nproc-per-node 2 build-dev/loom-train -b 16 --zero1
run tp2 build-dev/loom-run --nproc-per-node 2 build-dev/loom-train -b 32 --tp 2
