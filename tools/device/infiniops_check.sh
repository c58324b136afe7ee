#!/usr/bin/env bash
# On a machine with an H100 and this repo (.devdeps and the third-party snapshots beside it): the vendor-library checks
# in stages, each within one run (STAGE=build, then check, then bench; or STAGE=all):
#   build  Loom with the infiniops provider and InfiniOps' NVIDIA backend, and the DIOPI bridge, into build-io/
#   check  loom-conformance --provider infiniops --device cuda --verify (results into $VERIFY_CACHE), the CUDA tests
#          matching $TESTS (default: InfiniOps, verified routing, DIOPI and every CUDA test)
#   bench  LLaMA-3 1B tokens/s (bf16, B=$B, T=$T, $STEPS steps): native, then everything InfiniOps serves routed to
#          it under verified routing (the cache the check stage wrote), and prints a short table.
# The snapshots come from INFINIOPS_SOURCE (a folder with infiniops-*.tar.gz, infinirt-*.tar.gz,
# cutlass-*-include.tar.gz and diopi/include), default .devthird, ../shared/third_party or shared/third_party.
set -u
STAGE=${STAGE:-all}
SRC=${INFINIOPS_SOURCE:-}
for d in .devthird ../shared/third_party shared/third_party; do [ -z "$SRC" ] && [ -d "$d" ] && SRC=$(cd "$d" && pwd); done
[ -n "$SRC" ] || { echo "no snapshots: set INFINIOPS_SOURCE"; exit 1; }
B=${B:-4}; T=${T:-2048}; STEPS=${STEPS:-12}
VERIFY_CACHE=${VERIFY_CACHE:-$PWD/io_verified.json}
O=${OUT:-/tmp/out}; mkdir -p "$O"
D=$PWD/.devdeps
export PKG_CONFIG_PATH=$D/usr/lib/openblas/pkgconfig
export LD_LIBRARY_PATH=$D/usr/lib/openblas:${LD_LIBRARY_PATH:-}
[ -f /usr/local/cuda/include/cudnn_graph.h ] || export CPATH=$D/cudnn_include${CPATH:+:$CPATH}
cudnn_lib=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$cudnn_lib" ] && export LD_LIBRARY_PATH=$cudnn_lib:$LD_LIBRARY_PATH
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

if [ $STAGE = build ] || [ $STAGE = all ]; then
  cmake -S . -B build-io -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLOOM_INFINIOPS=ON -DLOOM_INFINIOPS_NVIDIA=ON -DLOOM_INFINIOPS_SOURCE="$SRC" \
    -DLOOM_DIOPI_INCLUDE_DIR="$SRC/diopi/include" \
    -DGTest_DIR=$D/usr/lib/x86_64-linux-gnu/cmake/GTest -Dnlohmann_json_DIR=$D/usr/share/cmake/nlohmann_json \
    > build-io.log 2>&1 || { tail -30 build-io.log; cp build-io.log $O/; exit 1; }
  grep -i "infiniops\|diopi" build-io.log | grep -v "^--.*Looking" | head -8
  stamp "configured (InfiniRT and InfiniOps built)"
  cmake --build build-io -j 16 >> build-io.log 2>&1 ||
    { grep -E "error|Error" build-io.log | head -30; cp build-io.log $O/; exit 1; }
  stamp "built"
fi

if [ $STAGE = check ] || [ $STAGE = all ]; then
  # One process per op: a kernel that faults (a CUDA error is sticky) fails its op, not every op after it.
  stamp "conformance, infiniops on cuda (--verify), one process per op"
  rm -f io_conformance.txt
  for op in $(build-io/loom-conformance --list-kernels --device cuda | awk '/infiniops/ {print $1}'); do
    timeout ${CONF_TIMEOUT:-60} build-io/loom-conformance --provider infiniops --device cuda --reference none \
      --verify --verify-cache "$VERIFY_CACHE" --op $op > io_conf_$op.txt 2>&1
    echo "$op rc=$?"
    grep -E "^$op +[a-z0-9]+ +(pass|FAIL|declined)" io_conf_$op.txt
    grep -m3 -A2 "^FAIL $op" io_conf_$op.txt | cut -c1-400
    cat io_conf_$op.txt >> io_conformance.txt
  done
  cp io_conformance.txt "$VERIFY_CACHE" $O/ 2>/dev/null
  stamp "tests ${TESTS:-InfiniOps*:VerifiedRouting*:Diopi*:*Cuda*:*CUDA*}"
  timeout ${TEST_TIMEOUT:-200} build-io/tests/loom_tests --gtest_filter="${TESTS:-InfiniOps*:VerifiedRouting*:Diopi*:*Cuda*:*CUDA*}" \
    --gtest_brief=1 > io_tests.log 2>&1
  echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED) |FAILED TEST|tests ran|Failure|Expected|Which is|which is" io_tests.log | head -40
  cp io_tests.log $O/
  stamp "checked"
fi

if [ $STAGE = bench ] || [ $STAGE = all ]; then
  DATA=/tmp/io_shard.bin
  [ -f $DATA ] || python3 tools/bench/make_shard.py $DATA --tokens 2000000 > /dev/null || exit 1
  OPS=gemm,add,mul,silu,swiglu,rms_norm,residual_rms_norm,copy,gelu,softmax,embedding,rope,rope_strided
  run() {  # name, LOOM_PROVIDERS value
    LOOM_VERIFY_CACHE="$VERIFY_CACHE" LOOM_PROVIDERS="$2" timeout ${TRAIN_TIMEOUT:-170} build-io/loom-train \
      --model llama3-1b --dtype bf16 -b $B -t $T --steps $STEPS --device cuda --eval-interval 0 --sample-tokens 0 \
      --train-data $DATA --explain-kernels > "io_train_$1.log" 2>&1
    echo "$1 rc=$?"; cp "io_train_$1.log" $O/
  }
  stamp "LLaMA-3 1B bf16 B=$B T=$T, $STEPS steps"
  run native ""
  run infiniops "verify;infiniops:$OPS;native"
  python3 - $B $T <<'PY'
import re, statistics, sys
B, T = int(sys.argv[1]), int(sys.argv[2])
def stats(name):  # median step time after two warm-up steps, and the last loss
    text = open(f"io_train_{name}.log").read()
    ms = [float(m) for m in re.findall(r"\|\s*([0-9.]+) ms \|", text)]
    ms = ms[2:] if len(ms) > 2 else ms
    loss = re.findall(r"loss ([0-9.]+)", text)
    return (B * T / (statistics.median(ms) / 1000) if ms else float("nan")), (loss[-1] if loss else "?")
(n, nl), (i, il) = stats("native"), stats("infiniops")
print(f"{'':12}{'tokens/s':>12}{'ratio':>8}{'last loss':>12}")
print(f"{'native':12}{n:12.0f}{1.0:8.2f}{nl:>12}")
print(f"{'infiniops':12}{i:12.0f}{i / n:8.2f}{il:>12}")
PY
  grep -i "infiniops\|verified routing" io_train_infiniops.log | head -30
fi
stamp "done ($STAGE)"
