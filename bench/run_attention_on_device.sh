#!/usr/bin/env bash
# On the GPU machine (through the device tool, carrying .devdeps): builds the tests and loom-bench-attention into
# build-dev/, runs the attention tests, the benchmark for each tile variant, PyTorch's SDPA on the same shapes, and
# compute-sanitizer on small cases. Everything is logged under $OUT; a short summary prints last.
set -o pipefail
OUT=${OUT:-/tmp/attention_out}
mkdir -p "$OUT"
D=$PWD/.devdeps
export PKG_CONFIG_PATH=$D/usr/lib/openblas/pkgconfig
export LD_LIBRARY_PATH=$D/usr/lib/openblas:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv > "$OUT/gpu.txt"
start=$SECONDS
cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=ON -DLOOM_PLUGINS=OFF -DLOOM_APPS=OFF \
  -DGTest_DIR=$D/usr/lib/x86_64-linux-gnu/cmake/GTest -Dnlohmann_json_DIR=$D/usr/share/cmake/nlohmann_json \
  -DCMAKE_CUDA_ARCHITECTURES=90 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
cmake --build build-dev -j 16 --target loom_tests loom-bench-attention >> "$OUT/build.log" 2>&1 ||
  { grep -E "error|Error" "$OUT/build.log" | head -30; exit 1; }
echo "built in $((SECONDS - start)) s"
timeout 120 build-dev/tests/loom_tests --gtest_filter="${TEST_FILTER:-CudaFlash*:CudaMiscAttention*}" \
  > "$OUT/tests.log" 2>&1; echo "tests rc=$?"
for v in 0 1 0; do  # the default twice: the spread between equal runs
  LOOM_FLASH_FWD_VARIANT=$v LOOM_FLASH_BWD_VARIANT=$v timeout 60 build-dev/bench/loom-bench-attention \
    >> "$OUT/bench.log" 2>&1
done
PYTHONUNBUFFERED=1 timeout 120 python3 bench/attention_torch_reference.py > "$OUT/torch.log" 2>&1
if [ -n "${SANITIZE:-}" ]; then
  timeout 60 compute-sanitizer --tool racecheck build-dev/tests/loom_tests \
    --gtest_filter='CudaFlashAttention.KvCacheAlignmentAndNonCausal' > "$OUT/racecheck.log" 2>&1
  timeout 60 compute-sanitizer --tool memcheck build-dev/tests/loom_tests \
    --gtest_filter='CudaFlashAttention.KvCache*:CudaFlashAttention.Gradients*' > "$OUT/memcheck.log" 2>&1
fi
cat "$OUT/gpu.txt"
grep -E "^\[  FAILED|^\[  PASSED|Failure|error|Expected|Which is|relative|out$|lse$|grad_|Trace|B=" "$OUT/tests.log" | head -60
tail -n 2 "$OUT/racecheck.log" "$OUT/memcheck.log" 2>/dev/null
cat "$OUT/bench.log" "$OUT/torch.log"
