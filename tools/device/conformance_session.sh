#!/usr/bin/env bash
# On the GPU machine (carry .devdeps; .device for the GPT-2 vocabulary): the conformance suite over the native CUDA
# kernels, PyTorch's float64 sweep set, op traces of real training steps replayed on the GPU, and the CUDA tests, by
# STAGE (a list, run in order; default "conf sweep"):
#   conf      loom-conformance --provider native --device cuda --jobs $(nproc) (generated cases, stored sets; the
#             target is 3 minutes on one H200 with 16 cores)
#   sweep     tools/reference/make_conformance_sweep.py: writes pytorch_sweep.{json,safetensors} to $OUT
#   trace     loom-train --trace-ops on GPT-2 124M and LLaMA-3 1B (bf16, synthetic shards), each trace replayed with
#             loom-conformance --trace --jobs $(nproc) on the native CUDA kernels (target: 2 minutes each)
#   tests     the CUDA tests of loom_tests (suites naming Cuda or Cudnn), on one GPU
#   sanitize  compute-sanitizer racecheck and synccheck over those tests (tools/device/cuda_sanitize.sh)
# Builds first (tools/device/build.sh, vendor bridges left out; BUILD=0 skips it on a warm machine). Logs go to
# /tmp/conf and come back as $OUT/conf_logs.tar.gz; a short table is printed last.
set -u
O=/tmp/conf; mkdir -p "$O"; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
trap 'tar -czf "$OUT/conf_logs.tar.gz" -C /tmp conf 2>/dev/null' EXIT
export LOOM_CMAKE_ARGS="-DLOOM_INFINIOPS=OFF -DLOOM_DIOPI=OFF"
t0=$(date +%s)
if [ "${BUILD:-1}" = 1 ]; then . tools/device/build.sh || exit 1; else
  D=$PWD/.devdeps; export LD_LIBRARY_PATH=$D/usr/lib/openblas:$D/usr/lib/pcre2:$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null):${LD_LIBRARY_PATH:-}
fi
echo "build: $(( $(date +%s) - t0 )) s"
[ -f .device/cache/gpt2/encoder.json ] && export LOOM_CACHE_DIR=$PWD/.device/cache
summary=()
for stage in ${STAGE:-conf sweep}; do
  s0=$(date +%s)
  case $stage in
  conf)
    timeout 420 build-dev/loom-conformance --provider native --device cuda --jobs $(nproc) > $O/conf_cuda.log 2> $O/conf_cuda.progress
    rc=$?
    grep -E "FAIL|error" $O/conf_cuda.log | head -40
    tail -3 $O/conf_cuda.progress
    summary+=("conf cuda: rc=$rc, $(grep -c ' pass ' $O/conf_cuda.log) pass rows, $(grep -c 'FAIL' $O/conf_cuda.log) FAIL lines, $(( $(date +%s) - s0 )) s")
    ;;
  sweep)
    timeout 420 python3 tools/reference/make_conformance_sweep.py --out "$OUT" > $O/sweep.log 2>&1
    rc=$?
    tail -5 $O/sweep.log
    summary+=("sweep: rc=$rc, $(ls -la $OUT/pytorch_sweep.* 2>/dev/null | awk '{print $5}' | paste -sd/) bytes, $(( $(date +%s) - s0 )) s")
    ;;
  trace)
    python3 tools/bench/make_shard.py /tmp/gpt2.bin --tokens 400000 > /dev/null
    python3 tools/bench/make_shard.py /tmp/llama.bin --tokens 400000 --vocab 128256 > /dev/null
    for m in gpt2-124M:gpt2:1024:4 llama3-1B:llama:1024:1; do
      IFS=: read model shard T B <<< "$m"
      timeout 200 build-dev/loom-train --model $model --device cuda --dtype bf16 --train-data /tmp/$shard.bin \
        -t $T -b $B --steps 2 --eval-interval 0 --sample-tokens 0 --warmup 1 --trace-ops $O/trace_$shard.json > $O/train_$shard.log 2>&1
      rc1=$?
      r0=$(date +%s)
      timeout 300 build-dev/loom-conformance --trace $O/trace_$shard.json --provider native --device cuda --jobs $(nproc) \
        > $O/replay_$shard.log 2> $O/replay_$shard.progress
      rc2=$?
      tail -25 $O/replay_$shard.log
      summary+=("trace $model: train rc=$rc1, replay rc=$rc2 in $(( $(date +%s) - r0 )) s, $(grep -c ' pass ' $O/replay_$shard.log) pass rows, $(grep -c FAIL $O/replay_$shard.log) FAIL lines")
    done
    ;;
  tests)
    timeout 400 build-dev/tests/loom_tests --gtest_filter='*Cuda*:*Cudnn*' > $O/cuda_tests.log 2>&1
    rc=$?
    grep -E "^\[  FAILED  \]" $O/cuda_tests.log | head -20
    summary+=("cuda tests: rc=$rc, $(grep -m1 -E '^\[  PASSED  \]' $O/cuda_tests.log) $(grep -c '^\[  FAILED  \] [A-Z]' $O/cuda_tests.log) failed, $(( $(date +%s) - s0 )) s")
    ;;
  sanitize)
    BUILD=0 TOOL="racecheck synccheck" SHARD_TIMEOUT=${SHARD_TIMEOUT:-240} bash tools/device/cuda_sanitize.sh 2>&1 | tail -30
    cp /tmp/sanitize/*.log $O/ 2>/dev/null
    summary+=("sanitize: $(( $(date +%s) - s0 )) s")
    ;;
  esac
done
echo "==== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%F)"
printf '%s\n' "${summary[@]}"
