#!/usr/bin/env bash
# The CUDA test suite on the GPU machine (with .devdeps and .device beside the tree), by STAGE:
#   ctest     every ctest test (CPU and CUDA, MPI ranks included), -j $JOBS (16), on the GPUs the machine has.
#   sanitize  compute-sanitizer over the CUDA tests of loom_tests: TOOL (memcheck, racecheck, synccheck or initcheck;
#             default "memcheck racecheck"), the tests (FILTER, default every test whose suite names Cuda or Cudnn)
#             split round-robin into one shard per GPU, each shard one sanitized process on its own GPU within
#             SHARD_TIMEOUT s (400). A shard that runs out of time reports how far it got.
# Builds first (tools/device/build.sh, vendor bridges left out; BUILD=0 skips it on a warm machine). Logs go to
# /tmp/sanitize and come back as $OUT/sanitize_logs.tar.gz (a GPU run returns only a few files).
set -u
O=/tmp/sanitize; mkdir -p "$O"
trap 'tar -czf "${OUT:-/tmp/out}/sanitize_logs.tar.gz" -C /tmp sanitize 2>/dev/null' EXIT
export LOOM_CMAKE_ARGS="-DLOOM_INFINIOPS=OFF -DLOOM_DIOPI=OFF"
if [ "${BUILD:-1}" = 1 ]; then . tools/device/build.sh || exit 1; else
  D=$PWD/.devdeps; export LD_LIBRARY_PATH=$D/usr/lib/openblas:$D/usr/lib/pcre2:$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null):${LD_LIBRARY_PATH:-}
fi
export NCCL_NVLS_ENABLE=0
[ -f .device/cache/gpt2/encoder.json ] && export LOOM_CACHE_DIR=$PWD/.device/cache
NGPU=$(nvidia-smi -L | wc -l)
case "${STAGE:-sanitize}" in
ctest)
  (cd build-dev && timeout ${CTEST_TIMEOUT:-540} ctest -j ${JOBS:-16} --timeout 300 --output-on-failure > $O/ctest.log 2>&1)
  echo "ctest rc=$?"
  grep -E "tests passed|tests failed|\*\*\*Failed|\*\*\*Timeout|Not Run|\(Failed\)|\(Timeout\)" $O/ctest.log | head -30
  grep -c "Skipped" $O/ctest.log | sed 's/^/skipped tests: /'
  ;;
sanitize)
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  [ -n "$SAN" ] || { echo "no compute-sanitizer on this machine"; exit 1; }
  "$SAN" --version | tail -1
  build-dev/tests/loom_tests --gtest_list_tests --gtest_filter="${FILTER:-*Cuda*:*Cudnn*}" |
    awk '/^[^ ]/ {suite=$1} /^  / {print suite $1}' > $O/sanitize_tests.txt
  echo "$(wc -l < $O/sanitize_tests.txt) tests over $NGPU GPUs"
  for tool in ${TOOL:-memcheck racecheck}; do
    for ((g = 0; g < NGPU; ++g)); do
      list=$(awk -v g=$g -v n=$NGPU 'NR % n == g' $O/sanitize_tests.txt | paste -sd:)
      extra=""; [ $tool = memcheck ] && extra="--leak-check no"
      CUDA_VISIBLE_DEVICES=$g timeout ${SHARD_TIMEOUT:-400} "$SAN" --tool $tool $extra --error-exitcode 99 \
        --print-limit 20 build-dev/tests/loom_tests --gtest_filter="$list" > $O/${tool}_$g.log 2>&1 &
    done
    wait
    for ((g = 0; g < NGPU; ++g)); do
      f=$O/${tool}_$g.log
      total=$(awk -v g=$g -v n=$NGPU 'NR % n == g' $O/sanitize_tests.txt | wc -l)
      printf "%s shard %d: %s of %d tests ok, %s failed, %s; %s\n" $tool $g "$(grep -c '^\[       OK \]' $f)" $total \
        "$(grep -c '^\[  FAILED  \] [A-Z]' $f)" "$(grep -m1 -o 'ERROR SUMMARY: [0-9]* error[s]*' $f || echo 'no summary (timed out?)')" \
        "$(grep -c '^\[  SKIPPED \]' $f) skipped"
      grep -E "^========= (Invalid|Race|Barrier|Uninitialized|Program hit|Error)" $f | sort | uniq -c | head -8
    done
  done
  ;;
esac
