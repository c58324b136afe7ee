#!/usr/bin/env bash
# The ZeRO-2/3 and LLaMA-3 8B GPU checks on a 2-GPU machine (with .devdeps beside the tree), by STAGE:
#   check   the distributed checks over NCCL (`loom-run --nproc-per-node 2 loom_distributed_check --device cuda`:
#           DDP, ZeRO-1/2/3 with and without recomputation, bf16 gathers, TP), and $TESTS of the CUDA suite if set.
#   parity  short loom-train runs of GPT-2 d4 and LLaMA-3 tiny at one global batch (one GPU, ZeRO-2, ZeRO-3 with
#           full and selective recomputation, TP=2 with recomputation, TP=2 with sequence parallelism, PP=2 1F1B and
#           interleaved over 4 micro-batches), their losses side by side.
# Every stage first builds (tools/device/build.sh, vendor bridges left out; a warm machine keeps build-dev).
#   bench   LLaMA-3 8B, T=2048, B=1 per GPU on both GPUs: loom-train --zero 3 --recompute full --dtype bf16, then
#           PyTorch FSDP2 (tools/bench/pytorch_fsdp_llama.py: fully_shard per layer, bf16 parameters, f32 reduction,
#           per-layer checkpointing) in the same call; tokens/s per GPU, MFU, peak memory.
# Logs go to $OUT. STEPS (bench, default 10).
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
nvidia-smi -L
export LOOM_CMAKE_ARGS="-DLOOM_INFINIOPS=OFF -DLOOM_DIOPI=OFF"
. tools/device/build.sh || exit 1
export NCCL_NVLS_ENABLE=0
case "${STAGE:-check}" in
check)
  timeout 300 build-dev/loom-run --nproc-per-node 2 build-dev/tests/loom_distributed_check --device cuda \
    > $O/dist_check.log 2>&1
  echo "dist_check rc=$?"; grep -v "^NCCL" $O/dist_check.log | grep -E "^ok|FAIL|^  " | head -40
  if [ -n "${TESTS:-}" ]; then
    [ -f .device/cache/gpt2/encoder.json ] && export LOOM_CACHE_DIR=$PWD/.device/cache
    timeout ${TEST_TIMEOUT:-240} build-dev/tests/loom_tests --gtest_filter="$TESTS" --gtest_brief=1 > $O/tests.log 2>&1
    echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED TEST|tests ran|Failure" $O/tests.log | head -30
  fi
  ;;
parity)
  python3 tools/bench/make_shard.py /tmp/gpt2_shard.bin --tokens 400000 > /dev/null
  python3 tools/bench/make_shard.py /tmp/v512_shard.bin --tokens 400000 --vocab 512 > /dev/null
  train() {  # model shard name launcher... -- per-run flags
    local model=$1 shard=$2 name=$3; shift 3
    local C="--device cuda --dtype bf16 --model $model --train-data $shard -t 256 --total-batch-tokens 8192 --steps 12
      --warmup 2 --eval-interval 0 --sample-tokens 0 --log-interval 4"
    timeout 180 "$@" $C > $O/train_${model}_$name.log 2>&1
    echo "$model $name rc=$?"
    grep -E "^(\[rank 0\] )?step" $O/train_${model}_$name.log | sed -e "s/^\[rank 0\] //" -e "s/^/  $name /" | cut -c1-100
  }
  for spec in "d4 /tmp/gpt2_shard.bin" "llama3-tiny /tmp/v512_shard.bin"; do
    set -- $spec
    train $1 $2 gpu1 build-dev/loom-train -b 32
    train $1 $2 zero2 build-dev/loom-run --nproc-per-node 2 build-dev/loom-train -b 16 --zero 2
    train $1 $2 zero3-full build-dev/loom-run --nproc-per-node 2 build-dev/loom-train -b 16 --zero 3 --recompute full
    train $1 $2 zero3-sel build-dev/loom-run --nproc-per-node 2 build-dev/loom-train -b 16 --zero 3 --recompute selective
    train $1 $2 tp2-full build-dev/loom-run --nproc-per-node 2 build-dev/loom-train -b 32 --tp 2 --recompute full
    train $1 $2 tp2-sp build-dev/loom-run --nproc-per-node 2 build-dev/loom-train -b 32 --tp 2 --sp
    train $1 $2 pp2-1f1b build-dev/loom-run --nproc-per-node 2 build-dev/loom-train -b 8 --pp 2
    train $1 $2 pp2-interleaved build-dev/loom-run --nproc-per-node 2 build-dev/loom-train -b 8 --pp 2 \
      --pp-schedule interleaved --virtual-stages 2
  done
  ;;
bench)
  python3 tools/bench/make_shard.py /tmp/llama_shard.bin --tokens 300000 --vocab 128256 > /dev/null
  timeout ${LOOM_TIMEOUT:-320} build-dev/loom-run --nproc-per-node 2 build-dev/loom-train --device cuda --dtype bf16 --model llama3-8b \
    --train-data /tmp/llama_shard.bin -b 1 -t 2048 --steps ${STEPS:-10} --warmup 2 --eval-interval 0 --sample-tokens 0 \
    --zero 3 --recompute full --log-interval 1 > $O/loom_8b.log 2>&1
  echo "loom 8b rc=$?"; grep -v "^NCCL" $O/loom_8b.log | grep -E "step|memory|layout|error|model" | cut -c1-140 | tail -16
  timeout ${TORCH_TIMEOUT:-250} torchrun --nproc-per-node 2 tools/bench/pytorch_fsdp_llama.py --model llama3-8b -b 1 -t 2048 \
    --steps ${STEPS:-10} > $O/pytorch_8b.log 2>&1
  echo "pytorch 8b rc=$?"; grep -E "step|pytorch|Error|error" $O/pytorch_8b.log | tail -14
  ;;
esac
