#!/usr/bin/env bash
# Installs what k3 needs from Debian's packages (only what is missing), then configures and
# builds. Usage: scripts/setup.sh [BUILD_DIR] [extra cmake args...]
# K3_BUILD_TARGET=NAME builds that target only (default: everything).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(build-essential cmake ninja-build pkg-config git python3
          libopenblas-openmp-dev nlohmann-json3-dev libcli11-dev libgtest-dev libbenchmark-dev libicu-dev
          bible-kjv curl)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "k3 setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The built-in training corpus: the King James Bible from Debian's bible-kjv package.
if [ ! -s data/kjv.txt ]; then
  mkdir -p data
  bible -f gen1:1-rev22:21 > data/kjv.txt.tmp && mv data/kjv.txt.tmp data/kjv.txt
fi

BUILD_DIR="${1:-build}"
shift || true
SHARED="${K3_SHARED_DIR:-$(cd .. && pwd)/shared}"
# The fixture tests read the reference outputs there; without them they fail, each naming the
# missing file. Say so now rather than after the build.
if [ ! -d "$SHARED/fixtures" ]; then
  echo "k3 setup: warning: no fixtures at $SHARED/fixtures (the shared folder beside the project, or" \
       "K3_SHARED_DIR); the fixture tests will fail until it is there" >&2
fi
# The CUDA backend (sm_90a) is built wherever the CUDA toolkit is installed, GPU or not; GPU tests
# carry the ctest label "gpu". An explicit -DK3_CUDA=... wins.
CUDA_ARGS=()
if [[ " $* " != *" -DK3_CUDA="* ]] && { command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }; then
  CUDA_ARGS=(-DK3_CUDA=ON)
fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DK3_SHARED_DIR="$SHARED" "${CUDA_ARGS[@]}" "$@" >/dev/null
cmake --build "$BUILD_DIR" -j"$(nproc)" ${K3_BUILD_TARGET:+--target "$K3_BUILD_TARGET"}
