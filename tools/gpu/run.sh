#!/usr/bin/env bash
# On the GPU machine (see pack.sh): unpacks .gpu/bundle.tar.xz, runs every *_cuda_test binary,
# `k3 op run --device cuda` on every op fixture (fp32 and bf16, compared by compare_ops.py), then
# any extra command given as arguments. Logs and JSON land in $OUT (or ./out).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-$root/out}"
mkdir -p "$out"
cd "$root/.gpu"
tar -xJf bundle.tar.xz
# The test binaries look for the fixtures where they were built: /work/shared.
if [ ! -e /work/shared ]; then mkdir -p /work && ln -s "$root/.gpu/shared" /work/shared; fi
cuda_libs=$(python3 -c 'import nvidia, os; print(":".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null || true)
export LD_LIBRARY_PATH="$root/.gpu/lib:/usr/local/cuda/lib64:${cuda_libs}:${LD_LIBRARY_PATH:-}"
export PATH="$root/.gpu/bin:$PATH"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
status=0
for t in "$root"/.gpu/bin/*_cuda_test; do
  name=$(basename "$t")
  echo "== $name"
  "$t" --gtest_brief=1 --gtest_output="json:$out/$name.json" > "$out/$name.log" 2>&1 || status=1
  tail -n 4 "$out/$name.log"
done
echo "== k3 op run --device cuda on every fixture"
python3 "$root/tools/gpu/compare_ops.py" "$root/.gpu/shared/fixtures/ops" "$out/ops" | tee "$out/compare_ops.txt" || status=1
if [ $# -gt 0 ]; then "$@" || status=1; fi
exit $status
