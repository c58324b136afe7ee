#!/usr/bin/env bash
# Loom's GPU session: one script for a fresh GPU machine (tools/device/README.md). Before the first call, on the
# build machine: `tools/device/make_devdeps.sh` (fills .devdeps/, git-ignored). Then on the GPU machine, from the
# repository root with .devdeps carried beside the tree:
#
#   tools/device/session.sh [STAGE...]       (default: build tests suite traces sanitize)
#
# Stages, run in the order given:
#   build     configure once, then an incremental build into build-dev/ (kept while the machine stays warm)
#   tests     the CUDA tests of loom_tests (TESTS, default every suite naming Cuda or Cudnn) in SHARDS processes
#   suite     loom-conformance --provider native --device cuda: the generated cases and the stored PyTorch sets
#             (SUITE_PROVIDER another provider, SUITE_FLAGS more flags: '--op grouped_gemm' for cutlass's)
#   traces    one training step of GPT-2 124M (B=4, T=1024) and of LLaMA-3 1B (B=1, T=2048) recorded with
#             loom-train --trace-ops, each replayed with loom-conformance --trace on the native CUDA kernels;
#             TRACE_MODELS (gpt2 llama) picks them, TRAIN_FLAGS adds loom-train flags (--fp8 all: the FP8 ops at a
#             training step's shapes)
#   sanitize  compute-sanitizer's memcheck and synccheck (SANITIZERS) over every test of `tests`, both tools at once,
#             each tool's tests split over SAN_SHARDS (5) processes of about equal time (by
#             tools/device/sanitizer_seconds.tsv), within SAN_TIMEOUT s (500)
#   initcheck initcheck over every test of `tests`, one process per test (SAN_JOBS at once, default the cores less
#             one); a test listed in tools/device/initcheck_vendor_writes.tsv is counted apart
#   racecheck racecheck the same way, Loom's kernels instrumented; a test stopped by a hardware exception in cuBLASLt
#             is counted apart
#   suite_initcheck  initcheck over the CUDA suite's ops (inputs and outputs copied from and to
#             the host, so every report is Loom's), SAN_JOBS worker processes (the cores less one), within
#             SAN_TIMEOUT s (500)
#   suite_racecheck  racecheck the same way over the ops whose CUDA kernels use shared memory (RACE_OPS), in
#             RACE_DTYPES (f32,bf16), RACE_SAMPLE (12) cases per op and dtype, Loom's kernels instrumented
#   reference transformers and PEFT on this machine: tools/reference/hf_check.py (Loom's GPT-2, LLaMA and Mixtral
#             exports loaded by transformers, its PEFT adapter directory loaded by peft, HF models loaded by Loom, on
#             the CPU and CUDA) and the Mixtral fixture (tools/reference/make_mixtral_fixture.py, written to $OUT for
#             tests/fixtures, then tests/moe_fixture_test.cc run against it)
#   grouped_gemm  loom-bench-grouped-gemm beside bench/grouped_gemm_torch_reference.py (torch._grouped_mm), with
#             GG_ARGS for both (e.g. "--hidden 2048 --ffn 8192 16384": mixtral-1b's gate and up), once per provider
#             of the grouped kernels in GG_PROVIDERS ("native cutlass")
#   python    the loom Python package: when the interpreter (PYTHON_EXE, else the python3 that imports torch) has
#             Python.h, built with LOOM_PYTHON=ON, then python/tests/test_cuda_dlpack.py (CUDA tensors to and
#             from PyTorch through DLPack), tools/bench/python_overhead.py (loom.Trainer with a per-step Python
#             callback against loom-train from the same TOML: PY_MODEL gpt2-124m, PY_B 16, T 1024, PY_STEPS 30,
#             bf16) and last the whole pytest suite, each with its row and log as it ends; without Python.h a row
#             says so and the stage stops
#   fp8_gemm  loom-bench-fp8-gemm beside bench/fp8_gemm_torch_reference.py (torch._scaled_mm): each linear layer's
#             forward, input and weight gradient products in FP8, promoted and fast, against bf16 (FG_ARGS: a model
#             and a token count, default "llama3-3b 8192")
#   passes    the memory-bound passes against the copy bandwidth: loom-bench-norm (the residual norms at GPT-2's and
#             LLaMA's widths; NORM_SHAPES, e.g. "8192x3072", for other shapes) and loom-bench-fp8-cast (the FP8
#             casts that are passes of their own, at the 3B's shapes)
#   bench     tools/bench/device_session.sh (MODELS, BATCHES, ...: see that script), against PyTorch
#   kernels   tools/bench/kernel_profile.py: the GPU time of a few steps kernel by kernel, PyTorch beside Loom, by
#             kernel class (KP_MODEL gpt2-124m, KP_B 32, KP_T 1024, KP_FLAGS); builds the Python package first
#   lora      tools/bench/lora_8b.sh: LoRA on LLaMA-3 8B beside PEFT in the same call (RECOMPUTE_BLOCKS, LOOM_FLAGS,
#             SKIP_PEFT, STEPS: see that script), one row with each run's tokens/s and memory against PEFT's
#   loss      GPT-2 124M's FP8 loss against bf16's own spread: 3 runs of each over 1,000 steps (LOSS_* variables, at
#             stage_loss) on a text sampled from tiny Shakespeare's statistics, which a run learns, not memorizes
# Every stage appends a row (stage, result, figures, seconds) to $LOOM_SESSION_DIR/table.tsv, which lives as long
# as the machine does; the whole table is printed last, so a second call on a warm machine shows both calls' rows.
# Logs stay in $LOOM_SESSION_DIR (default /tmp/loom-session); the table and the logs are copied to $OUT. LOOM_TREE
# names the tree in the table's heading (the copy on the GPU machine may have no git history).
set -u
cd "$(dirname "$0")/../.."
S=${LOOM_SESSION_DIR:-/tmp/loom-session}
mkdir -p "$S"
OUT=${OUT:-$S/out}
mkdir -p "$OUT"
TABLE=$S/table.tsv
BIN=build-dev
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(build tests suite traces sanitize)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
[ -n "$gpu" ] || { echo "session.sh: no GPU visible (nvidia-smi found none)"; exit 1; }

row() {  # stage, result, figures, seconds
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$TABLE"
  printf '== %s: %s, %s (%s s)\n' "$1" "$2" "$3" "$4"
  cp "$TABLE" "$OUT/table.tsv"  # a call cut short still brings back the rows so far
}
# The environment of the carried dependencies (no build): what tools/device/build.sh exports.
environment() {
  local D=$PWD/.devdeps
  export LD_LIBRARY_PATH=$D/usr/lib/openblas:$D/usr/lib/pcre2:$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
  export NCCL_NVLS_ENABLE=0
  [ -f "$D/cache/gpt2/encoder.json" ] && export LOOM_CACHE_DIR=$D/cache
  local cudnn_lib
  cudnn_lib=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
  [ -n "$cudnn_lib" ] && export LD_LIBRARY_PATH=$cudnn_lib:$LD_LIBRARY_PATH
}
# compute-sanitizer's path ("" when this machine has none).
sanitizer_path() { command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1; }
# Every stage runs on a build of the tree this call brought: the first stage to need one builds (incrementally when
# the machine kept build-dev/, from scratch on a fresh machine), so a call works whatever the machine kept. Unless
# the call names `build` (everything) or sets LOOM_BUILD_TARGETS, it builds the targets its stages run, no more.
built=0
stage_targets() {  # stage -> the build targets it runs
  case $1 in
    tests|sanitize|initcheck|racecheck) echo loom_tests ;;
    suite|suite_initcheck|suite_racecheck|sweep) echo loom-conformance ;;
    traces) echo loom-train loom-conformance ;;
    reference) echo loom_tests loom-train loom-export loom-generate ;;
    grouped_gemm) echo loom-bench-grouped-gemm ;;
    fp8_gemm) echo loom-bench-fp8-gemm ;;
    passes) echo loom-bench-norm loom-bench-fp8-cast ;;
    lora|loss) echo loom-train ;;
    python|kernels) echo loom-train ;;  # and loom_python, which the stage builds itself (with LOOM_PYTHON=ON)
    # What tools/bench/device_session.sh runs: loom-train, the tests only with TESTS, the suite only with CONFORMANCE.
    bench) echo loom-train ${TESTS:+loom_tests} ${CONFORMANCE:+loom-conformance} ;;
    *) echo all ;;  # build
  esac
}
targets=""
for stage in "${stages[@]}"; do targets="$targets $(stage_targets "$stage")"; done
if [ -z "${LOOM_BUILD_TARGETS:-}" ] && [[ " $targets " != *" all "* ]]; then
  LOOM_BUILD_TARGETS=$(tr ' ' '\n' <<< "$targets" | sort -u | paste -sd' ' | sed 's/^ *//')
  export LOOM_BUILD_TARGETS
fi
need_build() {
  [ $built = 1 ] && return 0
  stage_build || return 1
  t0=$SECONDS  # the calling stage's own clock (its local t0, which bash lets this function set) starts after the build
}
# Whether loom-conformance takes a flag (older builds lack --jobs and --max-calls).
conformance_has() { $BIN/loom-conformance --help 2>&1 | grep -q -- "$1"; }
jobs_flag() { conformance_has --jobs && echo "--jobs $(nproc)"; }
# The CUDA tests, one per line (Suite.Name).
cuda_tests() {
  $BIN/tests/loom_tests --gtest_list_tests --gtest_filter="${TESTS:-*Cuda*:*Cudnn*}" |
    awk '/^[^ ]/ {suite=$1} /^  / {print suite $1}'
}
# Counts of JSON conformance reports (a file, or every .json in a folder): "cases failures declined".
report_counts() {
  python3 - "$1" <<'PY'
import glob, json, os, sys
path = sys.argv[1]
files = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
r = []
for f in files:
    try:
        r += json.load(open(f))["results"]
    except Exception:
        print("? ? ?"); sys.exit(0)
print(len(r), sum(x["status"] == "FAIL" for x in r), sum(x["status"] == "declined" for x in r))
PY
}

stage_build() {
  local t0=$SECONDS
  # shellcheck disable=SC1091
  if . tools/device/build.sh; then
    built=1; row build pass "build-dev ($(nproc) cores)${LOOM_BUILD_TARGETS:+: $LOOM_BUILD_TARGETS}" $((SECONDS - t0))
  else row build FAIL "see build-dev.log" $((SECONDS - t0)); cp build-dev.log "$OUT/" 2>/dev/null; return 1; fi
}

stage_tests() {
  local t0=$SECONDS n=${SHARDS:-4} i
  need_build || return 1
  cuda_tests > $S/tests.txt
  for ((i = 0; i < n; ++i)); do
    GTEST_TOTAL_SHARDS=$n GTEST_SHARD_INDEX=$i timeout ${TEST_TIMEOUT:-400} $BIN/tests/loom_tests \
      --gtest_filter="${TESTS:-*Cuda*:*Cudnn*}" > $S/tests_$i.log 2>&1 &
  done
  wait
  local ok failed skipped
  ok=$(cat $S/tests_*.log | grep -c '^\[       OK \]')
  failed=$(cat $S/tests_*.log | grep -c -E '^\[  FAILED  \] [A-Za-z].* \([0-9]+ ms\)$')
  skipped=$(cat $S/tests_*.log | grep -c -E '^\[  SKIPPED \] [A-Za-z].* \([0-9]+ ms\)$')
  grep -h '^\[  FAILED  \] [A-Za-z]' $S/tests_*.log | sort -u | head -20
  local result=pass
  [ "$failed" = 0 ] && [ $((ok + skipped)) -ge "$(wc -l < $S/tests.txt)" ] || result=FAIL
  row tests $result "$(wc -l < $S/tests.txt) tests: $ok ok, $failed failed, $skipped skipped" $((SECONDS - t0))
}

stage_suite() {
  local t0=$SECONDS rc
  need_build || return 1
  rm -rf $S/suite && mkdir -p $S/suite
  if conformance_has --jobs; then
    # shellcheck disable=SC2086
    timeout ${SUITE_TIMEOUT:-540} $BIN/loom-conformance --provider "${SUITE_PROVIDER:-native}" --device cuda \
      --jobs "$(nproc)" \
      ${SUITE_FLAGS:-} --json $S/suite/all.json > $S/suite.log 2> $S/suite.err
    rc=$?
  else
    # One process per op (generated cases, naive oracle), as many at once as there are cores: the suite's host work
    # is serial within a process. The stored PyTorch sets run in one more.
    { $BIN/loom-conformance --list-ops | awk '{print $1}'; echo stored; } > $S/suite/ops.txt
    run_one() {  # op-or-stored, folder, bin
      if [ "$1" = stored ]; then set -- "$2" "$3" stored --reference pytorch --no-generated
      else set -- "$2" "$3" "$1" --op "$1" --reference naive; fi
      local dir=$1 bin=$2 name=$3; shift 3
      "$bin/loom-conformance" --provider native --device cuda "$@" --json "$dir/$name.json" > "$dir/$name.log" 2>&1
    }
    export -f run_one
    timeout ${SUITE_TIMEOUT:-540} xargs -P "$(nproc)" -I{} bash -c 'run_one "$@"' _ {} $S/suite $BIN < $S/suite/ops.txt
    rc=$?
    cat $S/suite/*.log > $S/suite.log
  fi
  grep -h -E "^FAIL|^    " $S/suite.log | head -60
  # Errors other than an op with no CUDA kernel ("no case ran") fail the stage too.
  local errors
  errors=$(grep -h "error:" $S/suite.log $S/suite.err 2>/dev/null | grep -v "no case ran" | sort -u)
  [ -z "$errors" ] || echo "$errors" | head -10
  read -r cases failures declined <<< "$(report_counts $S/suite)"
  local result=pass
  [ "$failures" = 0 ] && [ -z "$errors" ] || result=FAIL
  [ $rc = 124 ] && result="TIMEOUT (${SUITE_TIMEOUT:-540} s)"
  cp $S/suite.log "$OUT/suite.txt"
  row suite "$result" "$cases cases, $failures failures, $declined declined" $((SECONDS - t0))
}

stage_traces() {
  need_build || return 1
  local spec model shard T B t0 rc1 rc2 replay_flags
  python3 tools/bench/make_shard.py $S/gpt2.bin --tokens 200000 > /dev/null
  python3 tools/bench/make_shard.py $S/llama.bin --tokens 200000 --vocab 128256 > /dev/null
  replay_flags=$(jobs_flag)
  for spec in gpt2-124M:gpt2:1024:4 llama3-1B:llama:2048:1; do
    IFS=: read -r model shard T B <<< "$spec"
    [[ " ${TRACE_MODELS:-gpt2 llama} " == *" $shard "* ]] || continue
    t0=$SECONDS
    # shellcheck disable=SC2086
    timeout 300 $BIN/loom-train --model $model --device cuda --dtype bf16 --train-data $S/$shard.bin -t $T -b $B \
      --steps 1 --eval-interval 0 --sample-tokens 0 --warmup 1 ${TRAIN_FLAGS:-} --trace-ops $S/trace_$shard.json \
      > $S/train_$shard.log 2>&1
    rc1=$?
    [ $rc1 = 0 ] || { tail -5 $S/train_$shard.log; row "trace $model" FAIL "loom-train rc=$rc1 (see train_$shard.log)" $((SECONDS - t0)); continue; }
    t0=$SECONDS
    # shellcheck disable=SC2086
    timeout ${TRACE_TIMEOUT:-300} $BIN/loom-conformance --trace $S/trace_$shard.json --provider native --device cuda \
      $replay_flags ${REPLAY_FLAGS:-} --json $S/replay_$shard.json > $S/replay_$shard.log 2> $S/replay_$shard.err
    rc2=$?
    grep -E "^FAIL|^    " $S/replay_$shard.log | head -20
    read -r cases failures declined <<< "$(report_counts $S/replay_$shard.json)"
    local result=pass
    [ $rc2 = 0 ] || result="FAIL (rc $rc2)"
    [ $rc2 = 124 ] && result="TIMEOUT (${TRACE_TIMEOUT:-300} s)"
    row "trace $model" "$result" "$(head -1 $S/replay_$shard.log | grep -o '[0-9]* distinct calls ([0-9]* in the run)'): $failures failures, $declined declined" $((SECONDS - t0))
  done
}

# Splits tests.txt into n lists of about equal time (longest first onto the least loaded list) for TOOL: by the
# seconds each test took under that tool (tools/device/sanitizer_seconds.tsv, measured on an H200), else by the
# times the tests stage logged; a test with no time counts as the median. Writes $S/shard_<i>.txt.
balanced_shards() {  # n, tool
  python3 - "$S" "$1" "$2" tools/device/sanitizer_seconds.tsv <<'PY'
import glob, os, re, statistics, sys
S, n, tool, table = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
tests = [t.strip() for t in open(os.path.join(S, "tests.txt")) if t.strip()]
times = {}
if os.path.exists(table):
    for line in open(table):
        f = line.rstrip("\n").split("\t")
        if len(f) == 3 and not line.startswith("#") and f[0] == tool:
            times[f[1]] = float(f[2])
if not times:
    for f in glob.glob(os.path.join(S, "tests_*.log")):
        for m in re.finditer(r"^\[       OK \] (\S+) \((\d+) ms\)", open(f, errors="replace").read(), re.M):
            times[m.group(1)] = int(m.group(2)) / 1000
typical = statistics.median(times.values()) if times else 1
loads, lists = [0] * n, [[] for _ in range(n)]
for t in sorted(tests, key=lambda t: -times.get(t, typical)):
    k = loads.index(min(loads))
    loads[k] += times.get(t, typical)
    lists[k].append(t)
for k in range(n):
    open(os.path.join(S, "%s_shard_%d.txt" % (tool, k)), "w").write("\n".join(lists[k]) + "\n")
PY
}

# The kernels a compute-sanitizer tool leaves out or takes alone, as flags. Vendor kernels a tool cannot judge are
# left out of that tool only: cuDNN's fused attention kernels and cuBLAS's Hopper kernels synchronize through wgmma,
# TMA and mbarrier waits that racecheck and synccheck do not model (synccheck: barrier errors inside cuDNN's SDPA
# backward; racecheck: read-write races inside a cuBLAS split-K kernel, and "the Sanitizer failed to handle a hardware
# exception" inside cuBLASLt's epilogue and FP8 kernels, after which the context is lost). racecheck therefore
# instruments Loom's kernels alone (their mangled names hold "loom"); Loom's own kernels are checked by every tool.
# cuDNN's grouped-query reduction (fmha_reduce_head) reads memory nothing wrote; its results do not depend on it
# (CudnnAttention.GroupedQueryResultsDoNotDependOnTheWorkspaceContents fills the workspace with NaN first).
# initcheck does not see the bulk (TMA) stores of cuBLASLt's and cuDNN's Hopper kernels: Loom marks what they wrote
# through the NVTX memory API (src/backends/cuda/vendor_writes.h), which the tool reads with --nvtx yes.
tool_filters() {
  case $1 in
    racecheck) echo --kernel-name kns=loom ;;
    synccheck) echo --kernel-name-exclude kns=cudnn ;;
    initcheck) echo --nvtx yes --kernel-name-exclude kns=fmha_reduce_head ;;
  esac
}

# Tests that make a CUDA call fail on purpose, whose failure is what they test: the out-of-memory tests ask for 1 PiB,
# and a failed capture (a synchronizing call inside a CUDA graph's capture) must fall back to eager steps.
API_ERROR_TESTS='OutOfMemory|AFailedCaptureFallsBackToEagerSteps'
# compute-sanitizer's TOOLS over every test of `tests`, all tools at once, each tool's tests in n processes.
sanitize() {  # n, tools...
  need_build || return 1
  local SAN tool n=$1 i t0=$SECONDS list
  shift
  local tools=("$@")
  SAN=$(sanitizer_path)
  [ -n "$SAN" ] || { row sanitize FAIL "no compute-sanitizer on this machine" 0; return 1; }
  cuda_tests > $S/tests.txt
  for tool in "${tools[@]}"; do
    balanced_shards "$n" "$tool"
    local extra=()
    read -r -a extra <<< "$(tool_filters "$tool")"
    rm -f $S/${tool}_*.log
    for ((i = 0; i < n; ++i)); do
      list=$(grep -v -E "$API_ERROR_TESTS" $S/${tool}_shard_$i.txt | paste -sd:)
      [ -n "$list" ] || continue
      timeout ${SAN_TIMEOUT:-500} "$SAN" --tool $tool "${extra[@]}" --error-exitcode 99 --print-limit 20 \
        $BIN/tests/loom_tests --gtest_filter="$list" > $S/${tool}_$i.log 2>&1 &
    done
    # The tests that make a CUDA call fail on purpose run in one more process with the API error report off for
    # them alone (the tool still checks their memory and barriers).
    list=$(grep -h -E "$API_ERROR_TESTS" $S/${tool}_shard_*.txt | paste -sd:)
    [ -z "$list" ] || timeout ${SAN_TIMEOUT:-500} "$SAN" --tool $tool "${extra[@]}" --report-api-errors no \
      --error-exitcode 99 --print-limit 20 $BIN/tests/loom_tests --gtest_filter="$list" > $S/${tool}_api.log 2>&1 &
  done
  wait
  for tool in "${tools[@]}"; do
    local ok errors=0 timed_out=0 f e failed result=pass shards
    ok=$(cat $S/${tool}_*.log | grep -c '^\[       OK \]')
    shards=$(ls $S/${tool}_*.log | wc -l)
    for f in $S/${tool}_*.log; do
      # "ERROR SUMMARY: N errors"; racecheck's own: "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)"
      # ("1 error" in the singular).
      e=$(grep -m1 -o -E 'ERROR SUMMARY: [0-9]+|RACECHECK SUMMARY: .*\(([0-9]+) errors?' "$f" | grep -o -E '[0-9]+( errors?)?$' | grep -o -E '^[0-9]+')
      if [ -z "$e" ]; then timed_out=$((timed_out + 1)); else errors=$((errors + e)); fi
    done
    echo "-- $tool"
    grep -h -E "^========= (Invalid|Race|Barrier|Uninitialized|Program hit|Error|Unused|Leaked)" $S/${tool}_*.log | sort | uniq -c | sort -rn | head -8
    failed=$(cat $S/${tool}_*.log | grep -c -E '^\[  FAILED  \] [A-Za-z].* \([0-9]+ ms\)$')
    [ "$errors" = 0 ] && [ "$timed_out" = 0 ] && [ "$failed" = 0 ] || result=FAIL
    row "sanitize $tool" "$result" "$(wc -l < $S/tests.txt) tests: $ok ok, $failed failed, $errors errors$([ $timed_out = 0 ] || echo ", $timed_out of $shards processes out of time")" $((SECONDS - t0))
  done
}

# memcheck and synccheck at once (SAN_SHARDS processes each, default 5): both fit one call of 10 minutes.
stage_sanitize() { sanitize "${SAN_SHARDS:-5}" ${SANITIZERS:-memcheck synccheck}; }

# TOOL (racecheck or initcheck) over every test of `tests`, one process per test (SAN_JOBS at once, default the cores
# less one), each within SAN_TIMEOUT s (500), then each test judged apart ($S/<tool>_summary.txt):
# - racecheck instruments Loom's kernels alone (--kernel-name kns=loom). Some of cuBLASLt's Hopper kernels (its
#   epilogue and FP8 kernels) still stop under it with "the Sanitizer failed to handle a hardware exception", and the
#   context is lost: in its own process that takes down one test, counted apart, not as clean. The Loom kernels such a
#   test runs are race-checked by suite_racecheck, which calls them without cuBLASLt.
# - initcheck reads what vendor calls wrote from Loom's NVTX marks (tool_filters); a test listed in
#   tools/device/initcheck_vendor_writes.tsv (none now) is counted apart. Any report fails the stage.
per_test_sanitizer() {  # tool
  need_build || return 1
  local tool=$1 SAN t0=$SECONDS extra=()
  SAN=$(sanitizer_path)
  [ -n "$SAN" ] || { row "sanitize $tool" FAIL "no compute-sanitizer on this machine" 0; return 1; }
  read -r -a extra <<< "$(tool_filters "$tool")"
  cuda_tests > $S/tests.txt
  rm -rf "${S:?}/$tool" && mkdir -p $S/$tool
  one_test() {  # test, folder, sanitizer, bin, seconds, tool, extra...
    local name=$1 dir=$2 san=$3 bin=$4 seconds=$5 t=$6 api=()
    shift 6
    grep -q -E "$API_ERROR_TESTS" <<< "$name" && api=(--report-api-errors no)  # fails a CUDA call on purpose
    # The status is read from the log, never returned: xargs stops the whole run when a command exits 255, as
    # compute-sanitizer does for a test that makes no CUDA call (a test of an app's refusal, say).
    timeout "$seconds" "$san" --tool "$t" "$@" "${api[@]}" --error-exitcode 99 --print-limit 20 \
      "$bin/tests/loom_tests" --gtest_filter="$name" > "$dir/$name.log" 2>&1 || true
  }
  export -f one_test
  export API_ERROR_TESTS
  xargs -P "${SAN_JOBS:-$(($(nproc) - 1))}" -I{} bash -c 'one_test "$@"' _ {} $S/$tool "$SAN" $BIN \
    "${SAN_TIMEOUT:-500}" $tool "${extra[@]}" < $S/tests.txt
  python3 - "$tool" "$S/$tool" "$S/tests.txt" tools/device/initcheck_vendor_writes.tsv > $S/${tool}_summary.txt <<'PY'
import os, re, sys
tool, folder, tests, known_file = sys.argv[1], sys.argv[2], [t.strip() for t in open(sys.argv[3]) if t.strip()], sys.argv[4]
known = {}
if os.path.exists(known_file):
    for line in open(known_file):
        f = line.rstrip("\n").split("\t")
        if len(f) == 2 and not line.startswith("#"):
            known[f[0]] = f[1]
clean, reported, apart, failed, errors = [], [], [], [], 0
for t in tests:
    path = os.path.join(folder, t + ".log")
    log = open(path, errors="replace").read() if os.path.exists(path) else ""
    # A test that makes no CUDA call has nothing to judge: the tool says so instead of printing a summary.
    finished = re.search(r"(ERROR|RACECHECK) SUMMARY|terminated before first instrumented API call", log)
    passed = re.search(r"^\[  (PASSED  |SKIPPED )\]", log, re.M) and "[  FAILED  ]" not in log
    if tool == "racecheck":
        # Its summary counts a hardware exception as an error too: the races are the reports that name one.
        n = len(re.findall(r"^========= (Error|Warning): Race reported", log, re.M))
        vendor = "failed to handle a hardware exception" in log
    else:
        m = re.search(r"ERROR SUMMARY: (\d+)", log)
        n = int(m.group(1)) if m else 0
        # A listed test is not judged by initcheck: its reports are counted apart, and so is its running out of time
        # (the reports slow it down).
        if t in known and (n or not finished):
            apart.append(f"{t} ({n} reports: {known[t]})" if finished else f"{t} (out of time: {known[t]})")
            continue
        vendor = False
    if n:
        errors += n
        reported.append(f"{t} ({n})")
    elif vendor:
        apart.append(t)
    elif finished and passed:
        clean.append(t)
    else:
        failed.append(t)  # failed, or out of time (no summary)
for name, group in (("reported", reported), ("failed or out of time", failed), ("counted apart", apart)):
    for t in group:
        print(f"  {name}: {t}")
why = "stopped by a hardware exception in cuBLASLt" if tool == "racecheck" else "reading cuBLASLt's output"
print(f"{len(tests)} tests: {len(clean)} clean, {len(reported)} with reports ({errors} errors), {len(failed)} failed "
      f"or out of time, {len(apart)} {why}")
PY
  grep -v "^[0-9]" $S/${tool}_summary.txt | head -30
  grep -h -E "^========= (Race|Error|Warning|Uninitialized)" -A4 $S/$tool/*.log | head -30
  local summary result=pass
  summary=$(tail -1 $S/${tool}_summary.txt)
  echo "$summary" | grep -q " 0 with reports (0 errors), 0 failed" || result=FAIL
  row "sanitize $tool" "$result" "$summary" $((SECONDS - t0))
}
stage_racecheck() { per_test_sanitizer racecheck; }
stage_initcheck() { per_test_sanitizer initcheck; }

# TOOL over the CUDA suite: every input there is written by a copy from the host, and every output read back by one,
# so each report is about Loom's kernel (initcheck: a read of memory nothing wrote, by the kernel or by the copy of an
# output it left unwritten). initcheck takes every op: what cuBLASLt writes for gemm and fp8_gemm is marked (NVTX).
# racecheck judges shared memory only, and under it a case runs a hundred times slower: it takes the ops served by
# Loom's CUDA kernels that use shared memory (found in src/kernels/cuda/*.cu: a file holding __shared__, its
# LOOM_REGISTER_KERNEL ops), in RACE_DTYPES (f32,bf16), RACE_SAMPLE (12) generated cases per op and dtype spread
# from the smallest to the largest (`--sample`; every case of 35 ops would take hours), Loom's kernels instrumented
# alone, as in stage_racecheck. RACE_OPS names other ops. A run cut short by SAN_TIMEOUT says how many cases it
# reached (the progress lines in its log, one per finished op and dtype). Both use SAN_JOBS workers (the cores less
# one).
shared_memory_ops() {  # but gemm and fp8_gemm: cuBLASLt stops under racecheck (stage_racecheck)
  local f
  for f in $(grep -l "__shared__" src/kernels/cuda/*.cu); do
    grep -oE "LOOM_REGISTER_KERNEL\(\s*[a-z_0-9]+" "$f" | sed -E 's/.*\(\s*//'
  done | grep -v -x -E 'gemm|fp8_gemm' | sort -u | paste -sd,
}
suite_sanitizer() {  # tool
  need_build || return 1
  local tool=$1 t0=$SECONDS SAN ops rc errors result=pass extra=() dtypes=() note="every op"
  SAN=$(sanitizer_path)
  [ -n "$SAN" ] || { row "suite $tool" FAIL "no compute-sanitizer on this machine" 0; return 1; }
  read -r -a extra <<< "$(tool_filters "$tool")"
  if [ "$tool" = racecheck ]; then
    ops=${RACE_OPS:-$(shared_memory_ops)}
    dtypes=(--dtype "${RACE_DTYPES:-f32,bf16}" --sample "${RACE_SAMPLE:-12}" --reference naive)
    note="$(echo "$ops" | tr ',' '\n' | wc -l) ops with shared memory, ${RACE_DTYPES:-f32,bf16}, ${RACE_SAMPLE:-12} cases each"
  else
    ops=$($BIN/loom-conformance --list-ops | awk '{print $1}' | paste -sd,)
  fi
  rm -f $S/suite_$tool.json
  # shellcheck disable=SC2086
  timeout ${SAN_TIMEOUT:-500} "$SAN" --tool $tool "${extra[@]}" --target-processes all --print-limit 50 \
    $BIN/loom-conformance --provider native --device cuda --op "$ops" "${dtypes[@]}" \
    --jobs "${SAN_JOBS:-$(($(nproc) - 1))}" \
    --json $S/suite_$tool.json > $S/suite_$tool.log 2>&1
  rc=$?
  grep -h -E "^========= (Uninitialized|Host API|Race|Error|Internal)" -A3 $S/suite_$tool.log | head -24
  # One summary per process (the runner and its workers): "ERROR SUMMARY: N errors", or racecheck's
  # "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)".
  errors=$(grep -o -E 'ERROR SUMMARY: [0-9]+|RACECHECK SUMMARY: .*\(([0-9]+) errors?' $S/suite_$tool.log |
    grep -o -E '[0-9]+( errors?)?$' | grep -o -E '^[0-9]+' | awk '{n += $1} END {print n + 0}')
  [ "$rc" = 0 ] && [ "$errors" = 0 ] || result=FAIL
  if [ -f $S/suite_$tool.json ]; then
    read -r cases failures declined <<< "$(report_counts $S/suite_$tool.json)"
    row "suite $tool" "$result" "$cases cases, $failures failures, $errors $tool errors ($note; exit $rc)" \
      $((SECONDS - t0))
  else  # cut short: the last progress line says how many cases had run
    local reached
    reached=$(grep -oE "[0-9]+ of [0-9]+ cases" $S/suite_$tool.log | tail -1)
    row "suite $tool" "$result" "stopped at ${reached:-no case} (exit $rc), $errors $tool errors ($note)" \
      $((SECONDS - t0))
  fi
}
stage_suite_initcheck() { suite_sanitizer initcheck; }
stage_suite_racecheck() { suite_sanitizer racecheck; }

stage_reference() {
  need_build || return 1
  local t0=$SECONDS result=pass passed failed
  PYTHONUNBUFFERED=1 timeout 400 python3 tools/reference/hf_check.py --bin $BIN --work /tmp/hf_check \
    --devices cpu,cuda --out "$OUT" > $S/hf_check.log 2>&1 || result=FAIL
  grep -E "^(PASS|FAIL)" $S/hf_check.log | head -40
  passed=$(grep -c "^PASS" $S/hf_check.log) failed=$(grep -c "^FAIL" $S/hf_check.log)
  row "reference hf_check" "$result" "$passed checks pass, $failed fail" $((SECONDS - t0))
  t0=$SECONDS
  mkdir -p "$OUT/fixtures"
  if timeout 120 python3 tools/reference/make_mixtral_fixture.py "$OUT/fixtures" > $S/mixtral_fixture.log 2>&1; then
    cp "$OUT"/fixtures/mixtral_tiny.* tests/fixtures/
    $BIN/tests/loom_tests --gtest_filter='ModelFixture.Mixtral*' > $S/mixtral_fixture_test.log 2>&1
    local rc=$?
    tail -3 $S/mixtral_fixture_test.log
    row "reference mixtral fixture" "$([ $rc = 0 ] && echo pass || echo FAIL)" \
      "written to \$OUT/fixtures (commit to tests/fixtures); $(grep -c '^\[       OK' $S/mixtral_fixture_test.log) tests ok" \
      $((SECONDS - t0))
  else
    tail -5 $S/mixtral_fixture.log
    row "reference mixtral fixture" FAIL "make_mixtral_fixture.py (see mixtral_fixture.log)" $((SECONDS - t0))
  fi
}

stage_sweep() {
  need_build || return 1
  local t0=$SECONDS
  PYTHONUNBUFFERED=1 timeout 400 python3 tools/reference/make_conformance_sweep.py --out "$OUT" ${SWEEP_FLAGS:-} > $S/sweep.log 2>&1 ||
    { tail -5 $S/sweep.log; row sweep FAIL "make_conformance_sweep.py (see sweep.log)" $((SECONDS - t0)); return 1; }
  # shellcheck disable=SC2046
  timeout 300 $BIN/loom-conformance --provider native --device cuda --reference pytorch --no-generated \
    --reference-file "$OUT/pytorch_sweep.json" --json $S/sweep.json > $S/sweep_check.log 2>&1
  local rc=$?
  grep -E "^FAIL|^    " $S/sweep_check.log | head -20
  read -r cases failures declined <<< "$(report_counts $S/sweep.json)"
  local result=pass
  [ $rc = 0 ] || result=FAIL
  row sweep "$result" "$cases cases, $failures failures, $declined declined ($(du -k "$OUT/pytorch_sweep.safetensors" | cut -f1) KiB)" $((SECONDS - t0))
}

# Loom's grouped GEMM at Mixtral's shapes beside torch._grouped_mm, a loop of torch.mm and one dense product, the
# same group sizes on both sides (bench/grouped_gemm_bench.cc, bench/grouped_gemm_torch_reference.py).
stage_grouped_gemm() {
  need_build || return 1
  local t0=$SECONDS rc1=0 rc2 p
  : > $S/grouped_gemm_loom.log
  # shellcheck disable=SC2086
  for p in ${GG_PROVIDERS:-native cutlass}; do
    echo "== grouped_gemm kernels of provider $p" >> $S/grouped_gemm_loom.log
    LOOM_PROVIDERS="$p:grouped_gemm,grouped_gemm_weight_grad" timeout 300 $BIN/bench/loom-bench-grouped-gemm \
      ${GG_ARGS:-} >> $S/grouped_gemm_loom.log 2>&1 || rc1=$?
  done
  # shellcheck disable=SC2086
  timeout 300 python3 bench/grouped_gemm_torch_reference.py ${GG_ARGS:-} > $S/grouped_gemm_torch.log 2>&1
  rc2=$?
  cat $S/grouped_gemm_loom.log $S/grouped_gemm_torch.log
  row "grouped gemm" "$([ $rc1 = 0 ] && [ $rc2 = 0 ] && echo done || echo "FAIL (rc $rc1, $rc2)")" \
    "Loom and torch tables above (grouped_gemm_*.log)" $((SECONDS - t0))
}

# Each linear layer's three products in FP8 (promoted and fast accumulation) beside bf16, Loom's ops
# (bench/fp8_gemm_bench.cc) and torch._scaled_mm (bench/fp8_gemm_torch_reference.py) on the same shapes: FG_ARGS
# (model and tokens; default llama3-3b 8192).
stage_fp8_gemm() {
  need_build || return 1
  local t0=$SECONDS rc1 rc2
  # shellcheck disable=SC2086
  timeout 300 $BIN/bench/loom-bench-fp8-gemm ${FG_ARGS:-} > $S/fp8_gemm_loom.log 2>&1
  rc1=$?
  # shellcheck disable=SC2086
  timeout 300 python3 bench/fp8_gemm_torch_reference.py ${FG_ARGS:-} > $S/fp8_gemm_torch.log 2>&1
  rc2=$?
  cat $S/fp8_gemm_loom.log $S/fp8_gemm_torch.log
  local figures
  figures="Loom $(grep -o '(forward fast) [0-9.]* us ([0-9.]*x)' $S/fp8_gemm_loom.log | head -1), torch $(grep -o \
    '(forward fast) [0-9.]* us ([0-9.]*x)' $S/fp8_gemm_torch.log | head -1) of bf16"
  row "fp8 gemm" "$([ $rc1 = 0 ] && [ $rc2 = 0 ] && echo done || echo "FAIL (rc $rc1, $rc2)")" "$figures" \
    $((SECONDS - t0))
}

# The memory-bound passes one by one against the device's copy bandwidth (bench/norm_bench.cc, NORM_SHAPES;
# bench/fp8_cast_bench.cc).
stage_passes() {
  need_build || return 1
  local t0=$SECONDS rc1 rc2
  # shellcheck disable=SC2086
  timeout 300 $BIN/bench/loom-bench-norm ${NORM_SHAPES:-} > $S/norm.log 2>&1
  rc1=$?
  timeout 300 $BIN/bench/loom-bench-fp8-cast > $S/fp8_cast.log 2>&1
  rc2=$?
  cat $S/norm.log $S/fp8_cast.log
  row passes "$([ $rc1 = 0 ] && [ $rc2 = 0 ] && echo done || echo "FAIL (rc $rc1, $rc2)")" \
    "rms_norm_quantize at the widest $(grep 'quantize' $S/norm.log | tail -1 | awk '{print $(NF)}'), a weight's cast $(grep 'f32 -> e4m3' $S/fp8_cast.log | head -1 | awk '{print $(NF)}') of copy" \
    $((SECONDS - t0))
}

# The Python the `python` stage builds the package for and tests with: PYTHON_EXE, else the first of python3 on PATH
# and PyTorch's virtual environment that imports torch (the DLPack tests need it), else python3.
python_interpreter() {
  local p
  [ -n "${PYTHON_EXE:-}" ] && { echo "$PYTHON_EXE"; return; }
  for p in "$(command -v python3)" /opt/torch/.venv/bin/python3; do
    [ -x "$p" ] && "$p" -c "import torch" 2>/dev/null && { echo "$p"; return; }
  done
  command -v python3
}
# The interpreter's include folder; fails when Python.h is not there (the extension module cannot be built).
python_headers() {  # interpreter
  local inc
  inc=$("$1" -c "import sysconfig; print(sysconfig.get_paths()['include'])" 2>/dev/null)
  echo "${inc:-?}"
  [ -n "$inc" ] && [ -f "$inc/Python.h" ]
}
# The version in a pybind11 include folder ("" when none).
pybind11_version() {  # include folder
  awk '/define PYBIND11_VERSION_(MAJOR|MINOR|PATCH) / {v = v (v == "" ? "" : ".") $3} END {print v}' \
    "$1/pybind11/detail/common.h" 2>/dev/null
}
# The newest pybind11 for the interpreter: its own pybind11 package, the copy PyTorch ships (copied apart, as
# torch/include holds much else) or the one carried in .devdeps/pybind11 (Debian's; too old for Python 3.12 or numpy 2:
# CMake then says so).
pybind11_include() {  # interpreter
  local best=$PWD/.devdeps/pybind11/include dir torch_dir
  dir=$("$1" -c "import pybind11; print(pybind11.get_include())" 2>/dev/null)
  torch_dir=$("$1" -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))" 2>/dev/null)
  if [ -f "$torch_dir/pybind11/pybind11.h" ]; then
    [ -f "$S/pybind11/pybind11/pybind11.h" ] || { mkdir -p "$S/pybind11" && cp -r "$torch_dir/pybind11" "$S/pybind11/"; }
    torch_dir=$S/pybind11
  fi
  for dir in "$dir" "$torch_dir"; do
    [ -f "$dir/pybind11/pybind11.h" ] || continue
    if [ "$(printf '%s\n%s\n' "$(pybind11_version "$best")" "$(pybind11_version "$dir")" | sort -V | tail -1)" = \
         "$(pybind11_version "$dir")" ]; then best=$dir; fi
  done
  echo "$best"
}
# "passed skipped failed errors" from a pytest log's last summary line ("3 passed, 1 skipped in 2.1s").
pytest_counts() {  # log
  local line w n out=""
  line=$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)\b.* in [0-9.]+s' "$1" 2>/dev/null | tail -1)
  for w in passed skipped failed error; do
    n=$(grep -oE "[0-9]+ $w" <<< "$line" | grep -oE '^[0-9]+')
    out="$out ${n:-0}"
  done
  echo "${out# }"
}

# The loom Python package and loom-train, built with LOOM_PYTHON=ON for the interpreter that imports torch (PYTHON_EXE
# to choose another); sets py (the interpreter) and missing (which of numpy, pytest, torch it lacks) for the caller,
# and rows a failure. The stages that need the package call it.
build_python_package() {
  local t0=$SECONDS inc version pybind m
  missing=""
  py=$(python_interpreter)
  version=$("$py" -c "import platform; print(platform.python_version())" 2>/dev/null)
  if ! inc=$(python_headers "$py"); then
    row python FAIL "no Python.h in $inc for $py (Python ${version:-?}): the package cannot be built here" \
      $((SECONDS - t0))
    return 1
  fi
  for m in numpy pytest torch; do "$py" -c "import $m" 2>/dev/null || missing="$missing $m"; done
  local pyb_inc
  pyb_inc=$(pybind11_include "$py")
  pybind=$(pybind11_version "$pyb_inc")
  local had_args=${LOOM_CMAKE_ARGS+1} old_args=${LOOM_CMAKE_ARGS:-} old_python=${LOOM_PYTHON:-}
  local args=${LOOM_CMAKE_ARGS:--DLOOM_INFINIOPS=OFF -DLOOM_DIOPI=OFF}
  [[ " $args " == *" -DPython3_EXECUTABLE="* ]] || args="$args -DPython3_EXECUTABLE=$py"
  [[ " $args " == *" -DLOOM_PYBIND11_INCLUDE="* ]] || args="$args -DLOOM_PYBIND11_INCLUDE=$pyb_inc"
  export LOOM_PYTHON=ON LOOM_CMAKE_ARGS=$args
  local LOOM_BUILD_TARGETS="loom_python loom-train"
  # shellcheck disable=SC1091
  if ! . tools/device/build.sh; then
    cp build-dev.log "$OUT/python_build.log" 2>/dev/null
    # The next build configures afresh with its own flags (a failed configure leaves LOOM_PYTHON=ON in the cache).
    rm -f build-dev/.loom_cmake_args
    if [ -n "$had_args" ]; then LOOM_CMAKE_ARGS=$old_args; else unset LOOM_CMAKE_ARGS; fi
    if [ -n "$old_python" ]; then LOOM_PYTHON=$old_python; else unset LOOM_PYTHON; fi
    row python FAIL "build with LOOM_PYTHON=ON for $py (Python $version, pybind11 ${pybind:-?}) failed: see \
python_build.log" $((SECONDS - t0))
    return 1
  fi
  row "python build" pass "$LOOM_BUILD_TARGETS for $py (Python $version, pybind11 ${pybind:-?})" $((SECONDS - t0))
}

# The loom Python package on the GPU, built with LOOM_PYTHON=ON for python_interpreter (a reconfigure when the last
# build had it off; later stages of the call keep it on): its pytest suite but the DLPack file, in the environment
# ctest's python.pytest gets; python/tests/test_cuda_dlpack.py (CUDA tensors to and from PyTorch) alone; then
# tools/bench/python_overhead.py (loom.Trainer with a per-step callback against loom-train, same TOML, PY_MODEL
# gpt2-124m, PY_B 16, T 1024, PY_STEPS 30, bf16). Without the interpreter's headers it records why and stops.
stage_python() {
  local t0 py missing
  build_python_package || return 1
  t0=$SECONDS

  # python.pytest's environment (python/CMakeLists.txt), and tiny Shakespeare for the trainer tests where it is here.
  local mpi mpiexec data="" d
  mpi=$(grep -m1 '^LOOM_MPI:' $BIN/CMakeCache.txt | cut -d= -f2)
  case ${mpi^^} in ON|TRUE|YES|Y|1) mpi=ON ;; *) mpi=OFF ;; esac
  mpiexec=$(grep -m1 '^MPIEXEC_EXECUTABLE:' $BIN/CMakeCache.txt | cut -d= -f2 | grep -v NOTFOUND)
  # conftest.py looks beside the tree itself; data/tinyshakespeare is the folder a call may carry (scripts/setup.sh
  # fills it here).
  for d in "${LOOM_DATA_DIR:-}" "$PWD/shared/data" "$PWD/data/tinyshakespeare"; do
    [ -n "$d" ] && [ -f "$d/tinyshakespeare.txt" ] && { data=$d; break; }
  done
  local pyenv=(PYTHONPATH="$PWD/$BIN/python" LOOM_TRAIN_EXE="$PWD/$BIN/loom-train" LOOM_PLUGIN_DIR="$PWD/$BIN/plugins"
             LOOM_MPI="$mpi" LOOM_MPIEXEC="$mpiexec" LOOM_SOURCE_DIR="$PWD" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1)
  [ -z "$data" ] || pyenv+=(LOOM_DATA_DIR="$data")
  # The GPU's own parts first (DLPack with torch, the loop's overhead), then the whole suite; each part's log goes to
  # $OUT and its row to the table as soon as it ends, so that a call cut short still brings back what ran.
  local result=pass tests="pytest not run (needs numpy and pytest)" dlpack="dlpack cuda not run" overhead
  local rc1=0 rc2=0 rc3 passed skipped failed errors
  local have_pytest=1
  [[ " $missing " != *" pytest "* && " $missing " != *" numpy "* ]] || have_pytest=0
  if [ $have_pytest = 1 ]; then
    env "${pyenv[@]}" timeout "${DLPACK_TIMEOUT:-120}" "$py" -m pytest -q -p no:cacheprovider -rfEs \
      -o faulthandler_timeout=60 python/tests/test_cuda_dlpack.py > $S/python_dlpack.log 2>&1
    rc2=$?
    cp $S/python_dlpack.log "$OUT/" 2>/dev/null
    read -r passed skipped failed errors <<< "$(pytest_counts $S/python_dlpack.log)"
    dlpack="dlpack cuda $passed passed"
    [ "$skipped" = 0 ] || dlpack="$dlpack $skipped skipped"
    [ "$failed$errors" = 00 ] || dlpack="$dlpack $failed FAILED $errors errors"
    [ $rc2 = 124 ] && dlpack="$dlpack (TIMEOUT ${DLPACK_TIMEOUT:-120} s)"
    grep -E '^(FAILED|ERROR) ' $S/python_dlpack.log | head -20
    row "python dlpack" "$([ $rc2 = 0 ] && echo pass || echo FAIL)" "$dlpack" $((SECONDS - t0))
  fi
  env "${pyenv[@]}" timeout "${OVERHEAD_TIMEOUT:-150}" "$py" tools/bench/python_overhead.py \
    --model "${PY_MODEL:-gpt2-124m}" --device cuda -b "${PY_B:-16}" -t 1024 --steps "${PY_STEPS:-30}" \
    --loom-train $BIN/loom-train --work $S/python_overhead > $S/python_overhead.log 2>&1
  rc3=$?
  cp $S/python_overhead.log "$OUT/" 2>/dev/null
  grep -v '^step ' $S/python_overhead.log | tail -8
  local r
  r=$(grep '^RESULT ' $S/python_overhead.log | tail -1)
  result_field() { grep -oE "(^| )$1=[^ ]*" <<< "$r" | cut -d= -f2; }
  if [ $rc3 = 0 ] && [ -n "$r" ]; then
    overhead="loop overhead $(result_field overhead_pct)% (loom-train $(result_field loom_train_tok_s) tok/s, \
loom.Trainer $(result_field trainer_tok_s) tok/s, ${PY_MODEL:-gpt2-124m} B=${PY_B:-16} T=1024)"
    row "python overhead" pass "$overhead" $((SECONDS - t0))
  else
    overhead="loop overhead FAILED (rc $rc3: see python_overhead.log)"
    row "python overhead" FAIL "$overhead" $((SECONDS - t0))
    result=FAIL
  fi
  if [ $have_pytest = 1 ]; then
    # -v and a traceback of every thread after 60 s in one test: a test that hangs on this machine is named.
    env "${pyenv[@]}" timeout "${PY_TEST_TIMEOUT:-200}" "$py" -m pytest -v -p no:cacheprovider -rfEs \
      -o faulthandler_timeout=60 --durations=10 python/tests --ignore=python/tests/test_cuda_dlpack.py \
      > $S/python_pytest.log 2>&1
    rc1=$?
    cp $S/python_pytest.log "$OUT/" 2>/dev/null
    read -r passed skipped failed errors <<< "$(pytest_counts $S/python_pytest.log)"
    tests="pytest $passed passed $skipped skipped"
    [ "$failed$errors" = 00 ] || tests="$tests $failed FAILED $errors errors"
    local last
    last=$(grep -E '::' $S/python_pytest.log | tail -1 | cut -c1-80)
    [ $rc1 = 124 ] && tests="$tests (TIMEOUT ${PY_TEST_TIMEOUT:-200} s; last: $last)"
    [ $rc1 -gt 128 ] && tests="$tests (crashed, signal $((rc1 - 128)); last: $last)"
    grep -E '^(FAILED|ERROR) ' $S/python_pytest.log | head -20
    [ $rc1 = 0 ] && [ $rc2 = 0 ] || result=FAIL
  else
    result=incomplete
  fi
  [ "$result" = pass ] && [ -n "$missing" ] && result=incomplete
  row python "$result" "$tests, $dlpack, $overhead${missing:+; not installed:$missing}" $((SECONDS - t0))
  [ "$result" = pass ]
}

# Kernel by kernel, PyTorch beside Loom (tools/bench/kernel_profile.py: torch.profiler's CUDA activity over a few
# steps of each, in processes of their own): KP_MODEL (gpt2-124m), KP_B (32), KP_T (1024), KP_FLAGS (more flags:
# '--loom-set fp8=classifier --loom-set fp8_amax_history=16', '--skip-torch'). Needs the Python package, which it
# builds as the python stage does.
stage_kernels() {
  local t0 py missing rc figures
  build_python_package || return 1
  t0=$SECONDS
  # shellcheck disable=SC2086
  env PYTHONPATH="$PWD/$BIN/python" PYTHONUNBUFFERED=1 timeout "${KP_TIMEOUT:-480}" "$py" tools/bench/kernel_profile.py \
    --model "${KP_MODEL:-gpt2-124m}" -b "${KP_B:-32}" -t "${KP_T:-1024}" --work $S/kernels ${KP_FLAGS:-} \
    > $S/kernels.log 2>&1
  rc=$?
  cp $S/kernels.log "$OUT/" 2>/dev/null
  grep -v '^RESULT' $S/kernels.log | tail -${KP_TAIL:-70}
  figures=$(grep '^RESULT' $S/kernels.log | tail -1 | cut -d' ' -f3-)
  row kernels "rc $rc" "${figures:-see kernels.log}" $((SECONDS - t0))
}

stage_bench() {
  local t0=$SECONDS
  OUT=$OUT tools/bench/device_session.sh 2>&1 | tee $S/bench.log | tail -${BENCH_TAIL:-40}
  row bench "rc ${PIPESTATUS[0]}" "see bench.log" $((SECONDS - t0))
}

# LoRA on LLaMA-3 8B beside PEFT (tools/bench/lora_8b.sh, its variables: RECOMPUTE_BLOCKS, LOOM_FLAGS, SKIP_PEFT,
# STEPS, ...), one row with each Loom run's tokens/s, peak memory and ratios to PEFT.
stage_lora() {
  local t0=$SECONDS figures rc
  need_build || return 1
  DIR=$OUT/lora tools/bench/lora_8b.sh 2>&1 | tee $S/lora.log | grep -v '^step'
  rc=${PIPESTATUS[0]}
  rm -f "$OUT"/lora/shard.bin "$OUT"/lora/*/events.out.tfevents.*
  figures=$(python3 - $S/lora.log <<'PY'
import re, sys
runs, run = [], None
for line in open(sys.argv[1]):
    if m := re.match(r"loom, recompute (.*): rc", line):
        run = {"name": m.group(1)}
        runs.append(run)
    elif run is not None and (m := re.match(r"loom tokens/s (\d+) \| loom peak ([\d.]+) GiB", line)):
        run["figures"] = f"{m.group(1)} tok/s, {m.group(2)} GiB"
    elif run is not None and (m := re.match(r"ratio loom / peft: ([\d.]+x), memory ([\d.]+x)", line)):
        run["figures"] += f" ({m.group(1)} PEFT at {m.group(2)} its memory)"
peft = re.search(r"peft tokens/s (\d+) \| peft peak ([\d.]+) GiB", open(sys.argv[1]).read())
parts = [f"PEFT {peft.group(1)} tok/s, {peft.group(2)} GiB"] if peft else []
print("; ".join(parts + [f"{r['name']}: {r.get('figures', 'no figures')}" for r in runs]))
PY
)
  row lora "rc $rc" "${figures:-see lora.log}" $((SECONDS - t0))
}

# GPT-2 124M's FP8 loss against bf16's own spread (tools/bench/e2e_gpt2.sh with RUNS): LOSS_RUNS (3) runs each of
# bf16 and of FP8 (FP8=all with LOSS_FP8_FLAGS, default '--fp8-amax-history 16'; LOSS_FP8_FAST adds recipes, e.g.
# none), LOSS_STEPS (1000) steps at B = 32, on LOSS_DATA or by default a text a run learns rather than memorizes:
# LOSS_TOKENS (34M: one pass) tokens sampled by tools/bench/make_shard.py --from LOSS_TEXT (the tiny Shakespeare
# shard), and 200K more with another seed to validate on (LOSS_VAL), kept in the session folder while the machine
# stays warm. One row: bf16's spread and each FP8 recipe against it; the logs and the pictures to $OUT/loss.
# LOSS_PEER=pytorch: the same comparison with PyTorch's runs (tools/bench/pytorch_gpt2.py, torch.compile) in place
# of Loom's, bf16 against its --fp8 all (torchao's recipe: current scaling, the forward's products fast; with none in
# LOSS_FP8_FAST also every product promoted): whether FP8 moves PyTorch's loss as it moves Loom's. No validation.
loss_pytorch() {
  local k recipe label flags log logs=() labels=() recipes=("bf16|" "fp8 all|--fp8 all")
  [[ " ${LOSS_FP8_FAST:-} " == *" none "* ]] && recipes+=("fp8 all fast none|--fp8 all --fp8-fast-accumulation none")
  mkdir -p "$S/loss"
  for ((k = 1; k <= ${LOSS_RUNS:-3}; k++)); do
    for recipe in "${recipes[@]}"; do
      IFS='|' read -r label flags <<< "$recipe"
      log=$S/loss/torch_${label// /_}_run$k.log
      echo "== pytorch: $label, run $k"
      # shellcheck disable=SC2086
      PYTHONUNBUFFERED=1 timeout "${LOSS_TIMEOUT:-300}" python3 tools/bench/pytorch_gpt2.py -b 32 \
        --steps "${LOSS_STEPS:-1000}" --data "$data" $flags > "$log" 2>&1
      grep -E "^fp8 check|^RESULT|Error|error:" "$log" | tail -3
      logs+=("$log"); labels+=(--label "torch $label")
    done
  done
  local plot=(python3 tools/plot_loss.py "${logs[@]}" "${labels[@]}" --warmup 100 --window 50)
  "${plot[@]}" --title "pytorch gpt-2 124m" -o "$S/loss/loss_torch.png"
  "${plot[@]}" --relative --title "pytorch gpt-2 124m against bf16" -o "$S/loss/loss_torch_relative.png" | grep wrote
}

stage_loss() {
  local t0=$SECONDS rc figures text=${LOSS_TEXT:-data/tinyshakespeare/tinyshakespeare_train_000000.bin}
  local data=${LOSS_DATA:-$S/loss_train.bin} val=${LOSS_VAL:-$S/loss_val.bin} shard path tokens seed
  need_build || return 1
  for shard in "$data:${LOSS_TOKENS:-34000000}:1337" "$val:200000:7"; do
    IFS=: read -r path tokens seed <<< "$shard"
    [ -f "$path" ] && continue
    if [ -n "${LOSS_DATA:-}" ] && [ "$path" = "$data" ]; then
      row loss fail "no LOSS_DATA $data" $((SECONDS - t0)); return 1
    fi
    python3 tools/bench/make_shard.py "$path" --tokens "$tokens" --seed "$seed" --from "$text" ||
      { row loss fail "no shard sampled from $text" $((SECONDS - t0)); return 1; }
  done
  rm -rf "$S/loss"
  if [ "${LOSS_PEER:-loom}" = pytorch ]; then
    loss_pytorch 2>&1 | tee "$S/loss.log"
    rc=${PIPESTATUS[0]}
  else
    RUNS=${LOSS_RUNS:-3} DATA=$data LOOM_FLAGS="--val-data $val ${LOSS_FLAGS:-}" SKIP_TORCH=1 FP8=all \
      FP8_FLAGS=${LOSS_FP8_FLAGS---fp8-amax-history 16} FP8_FAST=${LOSS_FP8_FAST:-} MODEL=124m B=32 \
      STEPS=${LOSS_STEPS:-1000} LOSS_WINDOW=50 EVAL_INTERVAL=${LOSS_EVAL:-100} DIR=$S/loss \
      LOOM_TIMEOUT=${LOSS_TIMEOUT:-300} tools/bench/e2e_gpt2.sh 2>&1 | tee "$S/loss.log" | grep -v '^step'
    rc=${PIPESTATUS[0]}
  fi
  mkdir -p "$OUT/loss"
  cp "$S"/loss/*.log "$S"/loss/*.png "$OUT/loss/" 2>/dev/null
  figures=$(python3 - "$S/loss.log" <<'PY'
import re, sys
parts = []
for line in open(sys.argv[1]):
    if m := re.match(r"plot_loss: ((?:torch )?bf16) \((\d+) runs\), .*?each run within ([\d.]+%) .*?up to ([\d.]+%) "
                     r"apart", line):
        parts.append(f"{m.group(1)} x{m.group(2)} within {m.group(3)} of their mean ({m.group(4)} apart)")
    elif m := re.match(r"plot_loss: (.+?) \((\d+) runs?\) against (?:torch )?bf16 .*?, last ([-+\d.]+%) .*?"
                       r"in (\d+ of \d+) windows", line):
        parts.append(f"{m.group(1)} x{m.group(2)} {m.group(3)}, outside {m.group(4)}")
print("; ".join(parts))
PY
)
  row loss "rc $rc" "${figures:-see loss.log}" $((SECONDS - t0))
}

environment
for stage in "${stages[@]}"; do
  case $stage in
    build|tests|suite|suite_initcheck|suite_racecheck|traces|sanitize|initcheck|racecheck|sweep|reference|grouped_gemm|fp8_gemm|passes|bench|lora|loss|kernels) "stage_$stage" || [ "$stage" != build ] || break ;;
    python) stage_python ;;
    *) echo "session.sh: unknown stage '$stage' (build tests suite suite_initcheck suite_racecheck traces sanitize \
initcheck racecheck sweep reference grouped_gemm fp8_gemm python bench lora loss kernels)"; exit 2 ;;
  esac
done
# The logs (not the shards, traces or full JSON reports, which can pass the size a call brings back).
tar -czf "$OUT/session_logs.tar.gz" --exclude='*.bin' --exclude='*.json' --exclude=out -C "$(dirname "$S")" "$(basename "$S")" 2>/dev/null
echo
echo "==== $gpu, driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1), $(date -u +%F), tree ${LOOM_TREE:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
column -t -s $'\t' "$TABLE" 2>/dev/null || cat "$TABLE"
cp "$TABLE" "$OUT/table.tsv"
