#!/usr/bin/env bash
# On the GPU machine (see pack.sh): unpacks .gpu/bundle.tar.xz, runs every packed *_cuda_test
# binary, `k3 op run --device cuda` on every packed op fixture (fp32 and bf16, compared by
# compare_ops.py), then any extra command given as arguments. $OUT (or ./out) receives two files,
# since a device call brings back few: summary.txt (each suite's result and failures, the op
# fixtures' errors) and logs.tar.gz (every full log and gtest JSON). K3_GPU_ONLY_EXTRA=1 skips the
# tests and fixtures and runs the extra command alone (a second call on the same pack).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-$root/out}"
mkdir -p "$out"
logs="$(mktemp -d)"
summary="$out/summary.txt"
: > "$summary"
cd "$root/.gpu"
tar -xJf bundle.tar.xz
# The test binaries look for the fixtures where they were built: /work/shared.
if [ ! -e /work/shared ]; then mkdir -p /work && ln -s "$root/.gpu/shared" /work/shared; fi
cuda_libs=$(python3 -c 'import nvidia, os; print(":".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null || true)
export LD_LIBRARY_PATH="$root/.gpu/lib:/usr/local/cuda/lib64:${cuda_libs}:${LD_LIBRARY_PATH:-}"
export PATH="$root/.gpu/bin:$PATH"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$summary"
echo "fixtures packed: $(cd "$root/.gpu/shared/fixtures" && ls models ops 2>/dev/null | tr '\n' ' ')" | tee -a "$summary"
status=0
for t in "$root"/.gpu/bin/*_cuda_test; do
  [ -z "${K3_GPU_ONLY_EXTRA:-}" ] || break
  [ -e "$t" ] || continue
  name=$(basename "$t")
  echo "== $name" | tee -a "$summary"
  "$t" --gtest_brief=1 --gtest_output="json:$logs/$name.json" > "$logs/$name.log" 2>&1 || status=1
  { grep -E '^\[  FAILED  \]|Failure$|^Expected|Which is|actual:|C\+\+ exception' "$logs/$name.log" | head -40; tail -n 3 "$logs/$name.log"; } |
    tee -a "$summary"
done
if [ -z "${K3_GPU_ONLY_EXTRA:-}" ] && [ -n "$(ls "$root/.gpu/shared/fixtures/ops" 2>/dev/null)" ]; then
  echo "== k3 op run --device cuda on every packed op fixture" | tee -a "$summary"
  python3 "$root/tools/gpu/compare_ops.py" "$root/.gpu/shared/fixtures/ops" "$logs/ops" 2>&1 | tee -a "$summary" ||
    status=1
fi
g="$root/.gpu/shared/fixtures/models/gpt2-tiny"
if [ -z "${K3_GPU_ONLY_EXTRA:-}" ] && [ -d "$g" ]; then
  echo "== k3 logits --device cuda on gpt2-tiny (f32 and bf16 weights)" | tee -a "$summary"
  for dt in f32 bf16; do
    k3 logits --model "$g" --input "$g/expected.safetensors" --output "$logs/gpt2_logits_$dt.safetensors" --device cuda \
      --dtype $dt 2>&1 | tail -n 3 >> "$logs/gpt2_logits.log"
    python3 -c "
import numpy as np, sys
from safetensors.numpy import load_file
a = load_file('$logs/gpt2_logits_$dt.safetensors')['logits']; b = load_file('$g/expected.safetensors')['logits']
e = np.linalg.norm(a - b) / np.linalg.norm(b); tol = 5e-3 if '$dt' == 'bf16' else 1e-4
print(f'gpt2-tiny logits $dt: rel L2 {e:.2e} (tolerance {tol:g})'); sys.exit(0 if e <= tol else 1)" 2>&1 |
      tee -a "$summary" || status=1
  done
fi
if [ $# -gt 0 ]; then
  echo "== $*" | tee -a "$summary"
  (cd "$root" && "$@") 2>&1 | tee -a "$summary" || status=1
fi
echo "run.sh: exit status $status" | tee -a "$summary"
tar -C "$logs" -czf "$out/logs.tar.gz" . && rm -rf "$logs"
exit $status
