#!/usr/bin/env bash
# The distributed GPU checks in one run on a 2-GPU machine (with .devdeps beside the tree):
#   1. builds (tools/device/build.sh) and runs the CUDA tests matching $TESTS, if set;
#   2. the distributed checks over NCCL: `loom-run --nproc-per-node 2 loom_distributed_check --device cuda`;
#   3. short loom-train runs of GPT-2 d4 and LLaMA-3 tiny at one global batch (8192 tokens per step): one GPU, DDP,
#      ZeRO-1 and TP=2, their logged losses and gradient norms printed side by side (they should agree);
#   4. unless SCALING=0, GPT-2 124M data-parallel scaling (tools/bench/scaling_gpt2.sh, B=$SCALING_B per GPU,
#      default 32, as the single-GPU benchmark) with f32 and with bf16 gradient reduction.
# Logs go to $OUT. TRAIN_ARGS: more loom-train flags for step 3.
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
nvidia-smi -L
. tools/device/build.sh || exit 1
if [ -n "${TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-240} build-dev/tests/loom_tests --gtest_filter="$TESTS" --gtest_brief=1 > $O/tests.log 2>&1
  echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED TEST|tests ran|Failure|error" $O/tests.log | head -30
fi
timeout 240 build-dev/loom-run --nproc-per-node 2 build-dev/tests/loom_distributed_check --device cuda > $O/dist_check.log 2>&1
echo "dist_check rc=$?"; grep -v "^NCCL" $O/dist_check.log | tail -30

python3 tools/bench/make_shard.py /tmp/gpt2_shard.bin --tokens 400000 > /dev/null
python3 tools/bench/make_shard.py /tmp/v512_shard.bin --tokens 400000 --vocab 512 > /dev/null
train() {  # model shard name launcher... -- per-run flags
  local model=$1 shard=$2 name=$3; shift 3
  local C="--device cuda --model $model --train-data $shard -t 256 --total-batch-tokens 8192 --steps 12 --warmup 2
    --eval-interval 0 --sample-tokens 0 --log-interval 4 ${TRAIN_ARGS:-}"
  timeout 180 "$@" $C --log-dir /tmp/o_${model}_$name > $O/train_${model}_$name.log 2>&1
  echo "$model $name rc=$?"
  grep -E "^(\[rank 0\] )?step" $O/train_${model}_$name.log | sed -e "s/^\[rank 0\] //" -e "s/^/  $name /" | cut -c1-110
}
for spec in "d4 /tmp/gpt2_shard.bin" "llama3-tiny /tmp/v512_shard.bin"; do
  set -- $spec
  train $1 $2 gpu1 build-dev/loom-train -b 32
  train $1 $2 ddp build-dev/loom-run --nproc-per-node 2 build-dev/loom-train -b 16
  train $1 $2 zero1 build-dev/loom-run --nproc-per-node 2 build-dev/loom-train -b 16 --zero1
  train $1 $2 tp2 build-dev/loom-run --nproc-per-node 2 build-dev/loom-train -b 32 --tp 2
done

if [ "${SCALING:-1}" != 0 ]; then
  for reduce in f32 bf16; do
    echo "== scaling, GPT-2 124M, B=${SCALING_B:-32} per GPU, $reduce gradient reduction"
    DIR=$O/scaling_$reduce B=${SCALING_B:-32} STEPS=${STEPS:-20} EXTRA="--reduce-dtype $reduce" \
      tools/bench/scaling_gpt2.sh 2>&1 | tail -6
  done
fi
