#!/usr/bin/env bash
# Builds the CUDA configuration here (no GPU needed) and packs what a GPU machine needs to run
# its tests and benchmarks into .gpu/ (ignored by git): the binaries, the shared libraries the
# machine's image may lack (OpenBLAS, ICU, cpp-httplib and their runtime), and the fixtures.
# Then `bash tools/gpu/run.sh` on the GPU machine runs everything. Usage: tools/gpu/pack.sh [build dir]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${1:-$root/build-cuda}"
cd "$root"
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DK3_CUDA=ON -DK3_WERROR=ON -DK3_BENCH=OFF
fi
ninja -C "$build" -j2 k3 $(cd "$build" && ninja -t targets all | grep -o '^src/[a-z_]*/[a-z_]*_cuda_test:' | tr -d ':')
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
cp "$build/k3" .gpu/bin/
find "$build/src" -maxdepth 2 -name '*_cuda_test' -type f -exec cp {} .gpu/bin/ \;
# Libraries outside glibc/libstdc++/CUDA that the binaries load.
for b in .gpu/bin/*; do ldd "$b"; done | awk '/=> \//{print $3}' | sort -u |
  grep -E 'openblas|gfortran|quadmath|icu|httplib|gomp|brotli|libssl|libcrypto|libz\.' |
  while read -r lib; do cp -L "$lib" .gpu/lib/; done
tar -C .gpu -cJf .gpu/bundle.tar.xz bin lib
rm -rf .gpu/bin .gpu/lib
mkdir -p .gpu/shared/fixtures/models && cp -r "$root/../shared/fixtures/ops" .gpu/shared/fixtures/ &&
  cp -r "$root/../shared/fixtures/models/." .gpu/shared/fixtures/models/
du -sh .gpu/*
