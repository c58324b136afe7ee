#!/usr/bin/env bash
# Gathers, into .devdeps/ (git-ignored), what the GPU machine lacks to build and test Loom, copied from this machine
# (where scripts/setup.sh installed it): OpenBLAS with its Fortran runtime, GoogleTest, nlohmann-json, PCRE2, CLI11,
# toml++ (a compiled library on Debian: its headers, shared library and CMake package), pybind11, cuDNN's headers, CUTLASS's headers, and GPT-2's
# vocabulary (scripts/fetch_gpt2_vocab.sh) for the tokenizer tests. Carry ".devdeps" with each GPU call.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=.devdeps/usr
mkdir -p $D/lib/openblas/pkgconfig $D/lib/openblas/include $D/include $D/share/cmake $D/lib/x86_64-linux-gnu/cmake
grep -qx '/.devdeps/' .git/info/exclude 2>/dev/null || echo '/.devdeps/' >> .git/info/exclude
blas=$(readlink -f /usr/lib/x86_64-linux-gnu/libopenblas.so.0)
cp "$blas" $D/lib/openblas/libopenblas.so.0
ln -sf libopenblas.so.0 $D/lib/openblas/libopenblas.so
cp "$(readlink -f /usr/lib/x86_64-linux-gnu/libgfortran.so.5)" $D/lib/openblas/libgfortran.so.5
cp /usr/include/x86_64-linux-gnu/openblas-pthread/*.h $D/lib/openblas/include/ 2>/dev/null || cp /usr/include/x86_64-linux-gnu/*/cblas.h $D/lib/openblas/include/
cat > $D/lib/openblas/pkgconfig/openblas.pc <<'PC'
prefix=${pcfiledir}/..
libdir=${prefix}
includedir=${prefix}/include
Name: openblas
Description: OpenBLAS (carried from the build machine)
Version: 0.3.21
Libs: -L${libdir} -lopenblas
Cflags: -I${includedir}
PC
cp -r /usr/include/gtest /usr/include/gmock /usr/include/nlohmann $D/include/
cp /usr/lib/x86_64-linux-gnu/libg{test,mock}*.a $D/lib/x86_64-linux-gnu/
cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest $D/lib/x86_64-linux-gnu/cmake/
cp -r /usr/share/cmake/nlohmann_json $D/share/cmake/
# PCRE2 (the tokenizers' pre-tokenizer): its header, library and pkg-config file, found through PKG_CONFIG_PATH.
mkdir -p $D/lib/pcre2/pkgconfig $D/lib/pcre2/include
cp "$(readlink -f /usr/lib/x86_64-linux-gnu/libpcre2-8.so)" $D/lib/pcre2/libpcre2-8.so.0
ln -sf libpcre2-8.so.0 $D/lib/pcre2/libpcre2-8.so
cp /usr/include/pcre2.h $D/lib/pcre2/include/
cat > $D/lib/pcre2/pkgconfig/libpcre2-8.pc <<'PC'
prefix=${pcfiledir}/..
libdir=${prefix}
includedir=${prefix}/include
Name: libpcre2-8
Description: PCRE2 (carried from the build machine)
Version: 10.42
Libs: -L${libdir} -lpcre2-8
Cflags: -I${includedir}
PC
# CLI11 (the apps' flags): header-only.
cp -r /usr/include/CLI $D/include/
# toml++ (config files): Debian's is compiled (TOML_HEADER_ONLY=0), so its library and CMake package come too. The
# package finds its prefix relative to itself (../../../..), which is .devdeps/usr.
cp -r /usr/include/toml++ $D/include/
cp -P /usr/lib/x86_64-linux-gnu/libtomlplusplus.so* $D/lib/x86_64-linux-gnu/
cp -r /usr/lib/x86_64-linux-gnu/cmake/tomlplusplus $D/lib/x86_64-linux-gnu/cmake/
# pybind11 (the Python package, built on the GPU machine with LOOM_PYTHON=ON): its headers, apart from CPATH's folder
# so that a newer pybind11 the GPU machine has (PyTorch's) can be chosen over it (tools/device/session.sh).
rm -rf $D/include/pybind11 $D/lib/cmake/pybind11 .devdeps/pybind11  # an older layout's copies
mkdir -p .devdeps/pybind11/include && cp -r /usr/include/pybind11 .devdeps/pybind11/include/
mkdir -p .devdeps/cudnn_include && cp /usr/local/cuda/include/cudnn*.h .devdeps/cudnn_include/  # cudnn provider
# CUTLASS's headers (the cutlass provider, cmake/Cutlass.cmake), from the third-party snapshots when present.
mkdir -p .devdeps/third_party && rm -f .devdeps/third_party/cutlass-*-include.tar.gz
for t in ../shared/third_party/cutlass-*-include.tar.gz; do [ -f "$t" ] && cp "$t" .devdeps/third_party/; done
# GPT-2's vocabulary (the GPU machine cannot fetch it): LOOM_CACHE_DIR points here there.
./scripts/fetch_gpt2_vocab.sh .devdeps/cache/gpt2 >/dev/null
du -sh .devdeps
