#!/usr/bin/env bash
# One clang AddressSanitizer + UndefinedBehaviorSanitizer build (build-sanitize/, or $LOOM_SANITIZE_DIR; CUDA off)
# serves both halves of the memory-safety checks: the CPU library, apps and test suite run under ctest, and the
# libFuzzer targets of tests/fuzz/ (LOOM_FUZZ=ON: libloom carries the fuzzer's coverage instrumentation, which
# the tests ignore). Any ASan or UBSan report fails the test that triggered it (halt_on_error; UBSan does not
# recover). With LOOM_FUZZ_SECONDS set, scripts/fuzz.sh then runs every target that long from the same build.
# CI does not run it (its time budget: .ci/run's header); run it by hand before a release.
#
# Left out of the sanitized ctest run, each for a reason (they run in the normal build, scripts/test.sh):
#   - CUDA (LOOM_CUDA=OFF): ASan cannot watch device memory, and CI has no GPU (compute-sanitizer is the tool there).
#   - MPI (LOOM_MPI=OFF): Open MPI is not built with ASan; Distributed.mpi_* and the tests that start mpirun stay
#     with the normal build.
#   - The slow tests (SLOW below): whole-suite conformance runs over every native kernel, the planted-library and
#     mutation runs (each starts loom-conformance many times) and long training runs. Under ASan they take many
#     times their normal time and exercise the same code as the faster tests around them.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh fuzz
./scripts/fetch_gpt2_vocab.sh >/dev/null || echo "warning: could not fetch the GPT-2 vocabulary; tokenizer tests will skip"
BUILD_DIR=${LOOM_SANITIZE_DIR:-build-sanitize}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
SLOW='ShardedCheckpointFromMpirun|^Providers\.NativeKernelsPassTheSuite$|^Providers\.ConformanceChecksTheStridedAttentionOpsAgainstThePlainOnes$|^Diopi\.ConformanceThroughTheBridge$|^ConformanceCoverage\.ALibraryWrongInOneRegionFails$|^PlantedBugs|^mutation\.|^check_calls\.|^InfiniOps\.loom_conformance_cpu$|^diopi\.conformance_sample$'
start=$(date +%s)
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DCMAKE_CXX_FLAGS="$SAN" -DCMAKE_C_FLAGS="$SAN" \
  -DCMAKE_EXE_LINKER_FLAGS="$SAN" -DCMAKE_SHARED_LINKER_FLAGS="$SAN" -DCMAKE_MODULE_LINKER_FLAGS="$SAN" \
  -DLOOM_CUDA=OFF -DLOOM_MPI=OFF -DLOOM_FUZZ=ON >/dev/null
cmake --build "$BUILD_DIR" -j "${LOOM_JOBS:-$(nproc)}"
cmake --build "$BUILD_DIR" --target fuzz_targets -j "${LOOM_JOBS:-$(nproc)}"
built=$(date +%s)
echo "sanitize: built in $((built - start)) s"
# detect_leaks: one-off allocations of registries and the OpenMP runtime kept until exit are not leaks worth failing
# a test for; every other ASan finding halts. (The fuzz targets check leaks: scripts/fuzz.sh.)
(
  export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:verify_asan_link_order=0"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
  cd "$BUILD_DIR"
  ctest --output-on-failure -j "$(nproc)" -E "$SLOW" "$@"
)
echo "sanitize: tests ran in $(( $(date +%s) - built )) s"
if [ -n "${LOOM_FUZZ_SECONDS:-}" ]; then
  LOOM_FUZZ_DIR="$BUILD_DIR" ./scripts/fuzz.sh
fi
