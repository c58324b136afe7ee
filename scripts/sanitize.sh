#!/usr/bin/env bash
# An AddressSanitizer + UndefinedBehaviorSanitizer build of the CPU library, apps and tests (gcc, CUDA off) in its
# own build dir (build-sanitize/, or $LOOM_SANITIZE_DIR), then the CPU test suite under it. Any ASan or UBSan report
# fails the test that triggered it (halt_on_error; UBSan does not recover).
#
# Time, measured on 2 cores while other builds and tests shared them (load 6-9), so an idle CI machine should do
# better: the build from a clean build-sanitize/ (cold ccache) took 40 CPU minutes (about 20 min of wall time on 2
# idle cores; 70 min across three starts under that load, as new files forced reconfigures), and the test suite 21 min (546 tests, ctest -j2, including the 10 min timeout of
# the test excluded below). About 35-40 min in all on CI.
#
# Left out, each for a reason:
#   - CUDA (LOOM_CUDA=OFF): ASan cannot watch device memory, and the CI machine has no GPU (compute-sanitizer is
#     the tool there).
#   - MPI (LOOM_MPI=OFF): Open MPI is not built with ASan, and mpirun's two ranks under it were not tried; Distributed.mpi_* stay with the normal build (scripts/test.sh).
#   - LoomTrainCli.ShardedCheckpointFromMpirun*: runs loom-train under mpirun, which needs the MPI build.
#   - Providers.NativeKernelsPassTheSuite: the whole generated conformance suite on every native kernel; under ASan
#     it runs past its 600 s timeout (it passes in the normal build; the other Providers.* tests run the
#     conformance machinery here). Not an ASan incompatibility: time.
# The package test builds its consumer without the sanitizer flags: the ASan runtime then comes in with libloom,
# not first, which verify_asan_link_order=0 allows.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/fetch_gpt2_vocab.sh >/dev/null || echo "warning: could not fetch the GPT-2 vocabulary; tokenizer tests will skip"
BUILD_DIR=${LOOM_SANITIZE_DIR:-build-sanitize}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
start=$(date +%s)
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DCMAKE_CXX_FLAGS="$SAN" -DCMAKE_C_FLAGS="$SAN" \
  -DCMAKE_EXE_LINKER_FLAGS="$SAN" -DCMAKE_SHARED_LINKER_FLAGS="$SAN" -DCMAKE_MODULE_LINKER_FLAGS="$SAN" \
  -DLOOM_CUDA=OFF -DLOOM_MPI=OFF >/dev/null
cmake --build "$BUILD_DIR" -j "${LOOM_JOBS:-$(nproc)}"
built=$(date +%s)
echo "sanitize: built in $((built - start)) s"
# detect_leaks: one-off allocations of registries and the OpenMP runtime kept until exit are not leaks worth failing
# a test for; every other ASan finding halts.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:verify_asan_link_order=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
cd "$BUILD_DIR"
ctest --output-on-failure -j "$(nproc)" -E 'ShardedCheckpointFromMpirun|^Providers\.NativeKernelsPassTheSuite$' "$@"
echo "sanitize: tests ran in $(( $(date +%s) - built )) s"
