#!/usr/bin/env bash
# Quick start, command 2: install, build (warnings as errors) and run the whole test suite,
# then the unit tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS="$(nproc)"

scripts/setup.sh build -DK3_WERROR=ON
# The k3 serve integration test talks to the server through the openai package.
python3 -c "import openai" 2>/dev/null || python3 -m pip install --quiet openai || pip3 install --quiet openai
# GPU tests (label "gpu") need a CUDA device: tools/gpu/run.sh runs them on one.
(cd build && ctest --output-on-failure -j"$JOBS" --timeout 900 -LE gpu)

echo "== ASan/UBSan build of the unit tests"
# Only the unit tests' binaries, at -O1 with line tables (-g1: file and line in every report,
# assertions on): half the compile time of -O2 -g on CI's two cores.
K3_BUILD_TARGET=unit_tests scripts/setup.sh build-asan -DK3_WERROR=ON -DK3_SANITIZE=ON -DK3_BENCH=OFF -DK3_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g1"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
   ctest --output-on-failure -j"$JOBS" -L unit --timeout 900)
