#!/usr/bin/env bash
# On the GPU machine: sets the environment for the dependencies carried in .devdeps/ (tools/device/make_devdeps.sh)
# and builds Loom with CUDA into build-dev/. Configures only when build-dev/ has no build.ninja yet (or when
# LOOM_CMAKE_ARGS changed), so on a machine still warm from an earlier call the build is incremental: a few seconds
# when nothing changed. LOOM_CMAKE_ARGS: more cmake flags (default "-DLOOM_INFINIOPS=OFF -DLOOM_DIOPI=OFF": the vendor
# bridges have their own script, tools/device/infiniops_check.sh). LOOM_BUILD_TARGETS: what to build (default all).
# Source it (". tools/device/build.sh") to keep the environment; tools/device/session.sh does.
D=$PWD/.devdeps
[ -d "$D/usr" ] || { echo "build.sh: no .devdeps/ here: run tools/device/make_devdeps.sh on the build machine and carry .devdeps"; return 1 2>/dev/null || exit 1; }
export PKG_CONFIG_PATH=$D/usr/lib/openblas/pkgconfig:$D/usr/lib/pcre2/pkgconfig
export LD_LIBRARY_PATH=$D/usr/lib/openblas:$D/usr/lib/pcre2:$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
export CPATH=$D/usr/include${CPATH:+:$CPATH}
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on shared machines
[ -f "$D/cache/gpt2/encoder.json" ] && export LOOM_CACHE_DIR=$D/cache
# cuDNN: the GPU machine has PyTorch's libcudnn.so.9 but no cuDNN headers; the cudnn attention provider needs the
# headers to build (carried in .devdeps) and the library at run time.
[ -f /usr/local/cuda/include/cudnn_graph.h ] || export CPATH=$D/cudnn_include${CPATH:+:$CPATH}
cudnn_lib=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$cudnn_lib" ] && export LD_LIBRARY_PATH=$cudnn_lib:$LD_LIBRARY_PATH
cmake_args="-DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DGTest_DIR=$D/usr/lib/x86_64-linux-gnu/cmake/GTest -Dnlohmann_json_DIR=$D/usr/share/cmake/nlohmann_json \
  -Dtomlplusplus_DIR=$D/usr/lib/x86_64-linux-gnu/cmake/tomlplusplus \
  -DLOOM_PYTHON=${LOOM_PYTHON:-OFF} ${LOOM_CMAKE_ARGS:--DLOOM_INFINIOPS=OFF -DLOOM_DIOPI=OFF}"
if [ ! -f build-dev/build.ninja ] || [ "$(cat build-dev/.loom_cmake_args 2>/dev/null)" != "$cmake_args" ]; then
  # shellcheck disable=SC2086
  cmake -S . -B build-dev -G Ninja $cmake_args > build-dev.log 2>&1 || { tail -30 build-dev.log; return 1 2>/dev/null || exit 1; }
  echo "$cmake_args" > build-dev/.loom_cmake_args
fi
# shellcheck disable=SC2086
cmake --build build-dev -j "$(nproc)" ${LOOM_BUILD_TARGETS:+--target $LOOM_BUILD_TARGETS} >> build-dev.log 2>&1 ||
  { grep -E "error|Error" build-dev.log | head -30; return 1 2>/dev/null || exit 1; }
echo "build-dev: built"
