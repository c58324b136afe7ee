#!/usr/bin/env bash
# The readers', writers' and apps' hardening tests under clang's AddressSanitizer + UndefinedBehaviorSanitizer, in the
# fuzz build dir (build-fuzz/, or $LOOM_FUZZ_DIR): libloom, the apps and loom_io_tests (tests/CMakeLists.txt lists its
# files) are compiled with both sanitizers, and the libFuzzer targets are built there too, so scripts/fuzz.sh run
# afterwards reuses the same build. Any ASan or UBSan report fails the test that triggered it. The whole suite under
# the sanitizers is scripts/sanitize.sh (not in CI, for time); this is the part of it CI runs (.ci/run).
#
# Left out, as in scripts/sanitize.sh: CUDA (ASan cannot watch device memory), MPI (Open MPI is not built with ASan;
# the tests that start mpirun skip), the DIOPI bridge, InfiniOps and the sample kernel libraries (not readers or
# writers of files). Arguments go to the test executable (a --gtest_filter, say).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh fuzz
./scripts/fetch_gpt2_vocab.sh >/dev/null || echo "warning: could not fetch the GPT-2 vocabulary; tokenizer tests will skip"
BUILD_DIR=${LOOM_FUZZ_DIR:-build-fuzz}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
start=$(date +%s)
# A fuzz-only dir (scripts/fuzz.sh's minimal configuration: no apps, no tests) is configured again with them.
if ! grep -qs '^LOOM_APPS:BOOL=ON' "$BUILD_DIR/CMakeCache.txt" || ! grep -qs '^LOOM_TESTS:BOOL=ON' "$BUILD_DIR/CMakeCache.txt"; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DLOOM_FUZZ=ON -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1" \
    -DCMAKE_CXX_FLAGS="$SAN" -DCMAKE_C_FLAGS="$SAN" \
    -DCMAKE_EXE_LINKER_FLAGS="$SAN" -DCMAKE_SHARED_LINKER_FLAGS="$SAN" -DCMAKE_MODULE_LINKER_FLAGS="$SAN" \
    -DLOOM_CUDA=OFF -DLOOM_TESTS=ON -DLOOM_APPS=ON -DLOOM_PLUGINS=OFF -DLOOM_MPI=OFF -DLOOM_DIOPI=OFF \
    -DLOOM_INFINIOPS=OFF >/dev/null
fi
cmake --build "$BUILD_DIR" --target loom_io_tests fuzz_targets -j "${LOOM_JOBS:-$(nproc)}"
built=$(date +%s)
echo "sanitize-io: built in $((built - start)) s"
# detect_leaks=0 as in scripts/sanitize.sh (registries and the OpenMP runtime are kept until exit); the fuzz targets
# check leaks. The tests run as one gtest shard per core.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:verify_asan_link_order=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
shards=${LOOM_JOBS:-$(nproc)}
pids=()
for ((i = 0; i < shards; ++i)); do
  GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i "$BUILD_DIR/tests/loom_io_tests" "$@" \
    >"$BUILD_DIR/loom_io_tests.$i.log" 2>&1 &
  pids+=($!)
done
failed=0
for ((i = 0; i < shards; ++i)); do
  if wait "${pids[$i]}"; then
    grep -E '^\[  PASSED  \]' "$BUILD_DIR/loom_io_tests.$i.log" | sed "s/^/sanitize-io: shard $i: /"
  else
    echo "sanitize-io: shard $i FAILED (log $BUILD_DIR/loom_io_tests.$i.log):"
    grep -E '^\[  FAILED  \]|ERROR: (Address|Undefined)Sanitizer|runtime error:' "$BUILD_DIR/loom_io_tests.$i.log" | head -40
    failed=1
  fi
done
echo "sanitize-io: tests ran in $(( $(date +%s) - built )) s"
exit $failed
