#!/usr/bin/env bash
# On the GPU machine: configures and builds Loom with CUDA into build-dev/, using the dependencies carried in
# .devdeps/ (tools/device/make_devdeps.sh), cuDNN's headers included. LOOM_CMAKE_ARGS: more cmake flags (e.g.
# "-DLOOM_INFINIOPS=OFF -DLOOM_DIOPI=OFF" to leave the vendor bridges out of a distributed run's build). Source it (". tools/device/build.sh") to keep
# LD_LIBRARY_PATH.
D=$PWD/.devdeps
export PKG_CONFIG_PATH=$D/usr/lib/openblas/pkgconfig:$D/usr/lib/pcre2/pkgconfig
export LD_LIBRARY_PATH=$D/usr/lib/openblas:$D/usr/lib/pcre2:${LD_LIBRARY_PATH:-}
export CPATH=$D/usr/include${CPATH:+:$CPATH}
export NCCL_NVLS_ENABLE=0
# cuDNN: the GPU machine has PyTorch's libcudnn.so.9 but no cuDNN headers; the cudnn attention provider needs the
# headers to build (carried in .devdeps) and the library at run time.
[ -f /usr/local/cuda/include/cudnn_graph.h ] || export CPATH=$D/cudnn_include${CPATH:+:$CPATH}
cudnn_lib=$(python3 -c "import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$cudnn_lib" ] && export LD_LIBRARY_PATH=$cudnn_lib:$LD_LIBRARY_PATH
cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=ON \
  -DGTest_DIR=$D/usr/lib/x86_64-linux-gnu/cmake/GTest -Dnlohmann_json_DIR=$D/usr/share/cmake/nlohmann_json \
  -DCMAKE_CUDA_ARCHITECTURES=90 ${LOOM_CMAKE_ARGS:-} > build-dev.log 2>&1 || { tail -30 build-dev.log; return 1 2>/dev/null || exit 1; }
cmake --build build-dev -j "$(nproc)" >> build-dev.log 2>&1 || { grep -E "error|Error" build-dev.log | head -30; return 1 2>/dev/null || exit 1; }
echo "build-dev: built"
