#!/usr/bin/env bash
# Builds the CUDA configuration here (no GPU needed) and packs what a GPU machine needs to run
# its tests and benchmarks into .gpu/ (ignored by git): the binaries, the shared libraries the
# machine's image may lack (OpenBLAS, ICU and their runtime), and the fixtures.
# Then `bash tools/gpu/run.sh` on the GPU machine runs everything. Usage: tools/gpu/pack.sh [build dir]
#
# A device call carries the tree and .gpu together within 64 MiB, about 46 MB of .gpu beside the
# tracked files; every binary and fixture is more. To pack less:
#   K3_GPU_TESTS="ops models"    test binaries (src/*/NAME_cuda_test, bench/harness/bench_cuda_test;
#                                default: all of them)
#   K3_GPU_FIXTURES="models/gpt2-tiny ops/attnres.safetensors"   fixtures under ../shared/fixtures
#                                (default: all of them)
#   K3_GPU_EXTRA="k3-branch=../wt/build/k3 mixers_cuda_test-branch=../wt/build/src/mixers/mixers_cuda_test"
#                                more binaries, under their own names (another build of another
#                                commit, say, to time both in one call)
#   K3_GPU_NOBUILD=1             pack the build as it is (a patched build's binaries, say), without ninja
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${1:-$root/build-cuda}"
cd "$root"
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DK3_CUDA=ON -DK3_WERROR=ON -DK3_BENCH=OFF
fi
if [ -z "${K3_GPU_NOBUILD:-}" ]; then
  ninja -C "$build" -j2 k3 $(cd "$build" && ninja -t targets all | grep -oE '^(src/[a-z_]*|bench/harness)/[a-z_]*_cuda_test:' | tr -d ':')
fi
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
cp "$build/k3" .gpu/bin/
if [ -n "${K3_GPU_TESTS:-}" ]; then
  for t in $K3_GPU_TESTS; do
    f=$(find "$build/src" "$build/bench" -maxdepth 2 -name "${t}_cuda_test" -type f 2>/dev/null | head -1)
    [ -n "$f" ] || { echo "pack.sh: no test binary ${t}_cuda_test in $build/src or $build/bench" >&2; exit 1; }
    cp "$f" .gpu/bin/
  done
else
  find "$build/src" "$build/bench" -maxdepth 2 -name '*_cuda_test' -type f -exec cp {} .gpu/bin/ \; 2>/dev/null
fi
for e in ${K3_GPU_EXTRA:-}; do
  name="${e%%=*}" path="${e#*=}"
  [ -f "$path" ] && [ "$name" != "$e" ] || { echo "pack.sh: K3_GPU_EXTRA wants NAME=PATH of a binary, not '$e'" >&2; exit 1; }
  cp "$path" ".gpu/bin/$name"
done
# Libraries outside glibc/libstdc++/CUDA that the binaries load.
for b in .gpu/bin/*; do ldd "$b"; done | awk '/=> \//{print $3}' | sort -u |
  grep -E 'openblas|gfortran|quadmath|icu|gomp|httplib|libssl|libcrypto|brotli|libz\.' |
  while read -r lib; do cp -L "$lib" .gpu/lib/; done
# A 64 MiB window (xz -9): the binaries share most of their code, so the window dedupes them.
XZ_OPT="${XZ_OPT:--9}" tar -C .gpu -cJf .gpu/bundle.tar.xz bin lib
rm -rf .gpu/bin .gpu/lib
fixtures="$root/../shared/fixtures"
mkdir -p .gpu/shared/fixtures/models .gpu/shared/fixtures/ops
if [ -n "${K3_GPU_FIXTURES:-}" ]; then
  for f in $K3_GPU_FIXTURES; do
    [ -e "$fixtures/$f" ] || { echo "pack.sh: no fixture $fixtures/$f" >&2; exit 1; }
    # -T: a folder's contents into its namesake (ops/ already exists; plain -r would make ops/ops).
    mkdir -p ".gpu/shared/fixtures/$(dirname "$f")" && cp -rT "$fixtures/$f" ".gpu/shared/fixtures/$f"
  done
else
  cp -r "$fixtures/ops/." .gpu/shared/fixtures/ops/ && cp -r "$fixtures/models/." .gpu/shared/fixtures/models/
fi
du -sh .gpu/*
bytes=$(du -s --apparent-size --block-size=1 .gpu | cut -f1)
echo "pack.sh: .gpu holds $((bytes / 1000000)) MB"
if [ "$bytes" -gt 46000000 ]; then
  echo "pack.sh: over the ~46 MB a device call carries beside the tree; set K3_GPU_TESTS / K3_GPU_FIXTURES" >&2
fi
