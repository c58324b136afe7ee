#!/usr/bin/env bash
# On a machine with an H100 and this repo: builds Loom with the infiniops provider and InfiniOps' NVIDIA backend into
# build-io/, then
#   1. loom-conformance --provider infiniops --device cuda   (every op the provider registers on CUDA)
#   2. the CUDA training parity tests (InfiniOpsCuda.*: tiny LLaMA-3 and GPT-2, routed vs native)
#   3. LLaMA-3 1B tokens/s (bf16, B=$B, T=$T, $STEPS steps): everything InfiniOps serves routed to it vs native
# and prints a short table. Uses the dependencies of tools/device/build.sh (.devdeps/). The snapshots come from
# INFINIOPS_SOURCE (a folder with infiniops-*.tar.gz, infinirt-*.tar.gz, cutlass-*-include.tar.gz), default
# ../shared/third_party or shared/third_party. Budget: about 8 minutes on 16 cores.
set -u
SRC=${INFINIOPS_SOURCE:-}
for d in ../shared/third_party shared/third_party; do [ -z "$SRC" ] && [ -d "$d" ] && SRC=$(cd "$d" && pwd); done
[ -n "$SRC" ] || { echo "no snapshots: set INFINIOPS_SOURCE"; exit 1; }
B=${B:-4}; T=${T:-2048}; STEPS=${STEPS:-12}
D=$PWD/.devdeps
export PKG_CONFIG_PATH=$D/usr/lib/openblas/pkgconfig
export LD_LIBRARY_PATH=$D/usr/lib/openblas:${LD_LIBRARY_PATH:-}
[ -f /usr/local/cuda/include/cudnn_graph.h ] || export CPATH=$D/cudnn_include${CPATH:+:$CPATH}
cudnn_lib=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$cudnn_lib" ] && export LD_LIBRARY_PATH=$cudnn_lib:$LD_LIBRARY_PATH

t0=$(date +%s)
cmake -S . -B build-io -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DLOOM_INFINIOPS=ON -DLOOM_INFINIOPS_NVIDIA=ON -DLOOM_INFINIOPS_SOURCE="$SRC" -DLOOM_PLUGINS=OFF \
  -DGTest_DIR=$D/usr/lib/x86_64-linux-gnu/cmake/GTest -Dnlohmann_json_DIR=$D/usr/share/cmake/nlohmann_json \
  > build-io.log 2>&1 || { tail -30 build-io.log; exit 1; }
grep "infiniops" build-io.log
cmake --build build-io -j 16 --target loom-conformance loom_tests loom-train >> build-io.log 2>&1 ||
  { grep -E "error|Error" build-io.log | head -30; exit 1; }
echo "== built in $(( $(date +%s) - t0 )) s"

echo "== 1. conformance, infiniops on cuda"
timeout 240 build-io/loom-conformance --provider infiniops --device cuda --reference none 2>/dev/null |
  tee io_conformance.txt | grep -E "^[a-z_]+ +[a-z0-9]+ +(pass|FAIL|declined)|^FAIL" | head -60
conf_rc=${PIPESTATUS[0]}

echo "== 2. training parity (InfiniOpsCuda.*)"
timeout 120 build-io/tests/loom_tests --gtest_filter='InfiniOpsCuda.*' 2>&1 | grep -E "OK|FAILED|Failure|SKIPPED|Expected|which is"

echo "== 3. LLaMA-3 1B bf16 B=$B T=$T, $STEPS steps"
DATA=/tmp/io_shard.bin
[ -f $DATA ] || python3 tools/bench/make_shard.py $DATA --tokens 2000000 > /dev/null || exit 1
ROUTE="infiniops:gemm,add,mul,silu,swiglu,rms_norm,residual_rms_norm,copy,gelu,softmax,embedding;native"
run() {  # name, LOOM_PROVIDERS value
  LOOM_PROVIDERS="$2" timeout 150 build-io/loom-train --model llama3-1b --dtype bf16 -b $B -t $T --steps $STEPS \
    --device cuda --eval-interval 0 --sample-tokens 0 --train-data $DATA --explain-kernels > "io_train_$1.log" 2>&1
  echo "$1 rc=$?"
}
run native ""
run infiniops "$ROUTE"
python3 - $B $T <<'PY'
import re, statistics, sys
B, T = int(sys.argv[1]), int(sys.argv[2])
def tps(name):  # from the step times ("| 812 ms |"), median after two warm-up steps
    ms = [float(m) for m in re.findall(r"\|\s*([0-9.]+) ms \|", open(f"io_train_{name}.log").read())]
    ms = ms[2:] if len(ms) > 2 else ms
    return B * T / (statistics.median(ms) / 1000) if ms else float("nan")
n, i = tps("native"), tps("infiniops")
print(f"{'':12}{'tokens/s':>12}{'ratio':>8}")
print(f"{'native':12}{n:12.0f}{1.0:8.2f}")
print(f"{'infiniops':12}{i:12.0f}{i / n:8.2f}")
PY
grep -A2 -i "infiniops" io_train_infiniops.log | head -20
echo "== total $(( $(date +%s) - t0 )) s; conformance rc=$conf_rc"
