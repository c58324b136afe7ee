#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/, clang with ASan + UBSan, build-fuzz/ or $LOOM_FUZZ_DIR) and runs each
# from its seed corpus (tests/fuzz/corpus/<target>/) for LOOM_FUZZ_SECONDS seconds (default 45). A crash, a sanitizer
# report, a leak, an uncaught non-loom exception or a timeout fails the script; the reproducer is left in
# $LOOM_FUZZ_DIR/findings/. Arguments: target names to run (default: all). docs/FUZZING.md has the details.
#
# Time: the runs take (number of targets) x LOOM_FUZZ_SECONDS; the build, when not shared with
# scripts/sanitize.sh, is libloom and the targets with clang (.ci/run's header has the measured figures).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh fuzz
BUILD_DIR=${LOOM_FUZZ_DIR:-build-fuzz}
SECONDS_EACH=${LOOM_FUZZ_SECONDS:-45}
start=$(date +%s)
# A build dir already configured for the fuzz targets (scripts/sanitize.sh's, which CI uses) is reused as it is;
# otherwise a minimal one (libloom and the targets only) is configured.
if ! grep -qs '^LOOM_FUZZ:BOOL=ON' "$BUILD_DIR/CMakeCache.txt"; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DLOOM_FUZZ=ON -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
    -DLOOM_CUDA=OFF -DLOOM_TESTS=OFF -DLOOM_APPS=OFF -DLOOM_PLUGINS=OFF -DLOOM_MPI=OFF -DLOOM_DIOPI=OFF \
    -DLOOM_INFINIOPS=OFF >/dev/null
fi
cmake --build "$BUILD_DIR" --target fuzz_targets -j "${LOOM_JOBS:-$(nproc)}"
echo "fuzz: built in $(( $(date +%s) - start )) s"
targets=("$@")
if ((${#targets[@]} == 0)); then
  for src in tests/fuzz/fuzz_*.cc; do targets+=("$(basename "$src" .cc)"); done
fi
# Leaks are findings too; UBSan stops at the first report.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
findings="$BUILD_DIR/findings"
mkdir -p "$findings"
failed=()
for t in "${targets[@]}"; do
  work="$BUILD_DIR/corpus/$t"  # new inputs go here; the committed seeds stay as they are
  mkdir -p "$work"
  t0=$(date +%s)
  if "$BUILD_DIR/$t" -max_total_time="$SECONDS_EACH" -timeout=20 -rss_limit_mb=4096 -max_len=65536 \
       -artifact_prefix="$findings/$t-" -print_final_stats=1 "$work" "tests/fuzz/corpus/$t" \
       >"$BUILD_DIR/$t.log" 2>&1; then
    echo "fuzz: $t ran $(( $(date +%s) - t0 )) s without a finding ($(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$BUILD_DIR/$t.log" | grep -o '[0-9]*$') runs)"
  else
    echo "fuzz: $t FOUND A PROBLEM after $(( $(date +%s) - t0 )) s; log $BUILD_DIR/$t.log, reproducer in $findings/"
    tail -40 "$BUILD_DIR/$t.log"
    failed+=("$t")
  fi
done
((${#failed[@]} == 0)) || { echo "fuzz: findings in ${failed[*]}"; exit 1; }
echo "fuzz: all ${#targets[@]} targets clean ($(( $(date +%s) - start )) s in all)"
