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
echo "== k3 logits --device cuda on gpt2-tiny (f32 and bf16 weights)"
g="$root/.gpu/shared/fixtures/models/gpt2-tiny"
for dt in f32 bf16; do
  k3 logits --model "$g" --input "$g/expected.safetensors" --output "$out/gpt2_logits_$dt.safetensors" --device cuda --dtype $dt &&
    python3 -c "
import numpy as np, sys
from safetensors.numpy import load_file
a = load_file('$out/gpt2_logits_$dt.safetensors')['logits']; b = load_file('$g/expected.safetensors')['logits']
e = np.linalg.norm(a - b) / np.linalg.norm(b); tol = 5e-3 if '$dt' == 'bf16' else 1e-4
print(f'gpt2-tiny logits $dt: rel L2 {e:.2e} (tolerance {tol:g})'); sys.exit(0 if e <= tol else 1)" || status=1
done
if [ $# -gt 0 ]; then (cd "$root" && "$@") || status=1; fi
exit $status
