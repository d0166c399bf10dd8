#!/usr/bin/env bash
# On the GPU machine after run.sh has unpacked the bundle: every fixture model through the CLI on
# CUDA — `k3 logits` against the reference logits, and `k3 generate` (sampled, seeded) equal to
# the CPU's ids.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out=$(mktemp -d)
status=0
for m in "$root"/.gpu/shared/fixtures/models/*/; do
  name=$(basename "$m")
  k3 logits --model "$m" --input "$m/expected.safetensors" --output "$out/logits_$name.safetensors" --device cuda &&
    python3 -c "
import numpy as np, sys
from safetensors.numpy import load_file
a = load_file('$out/logits_$name.safetensors')['logits']; b = load_file('$m/expected.safetensors')['logits']
e = np.linalg.norm(a - b) / np.linalg.norm(b)
print(f'$name logits cuda: rel L2 {e:.2e}'); sys.exit(0 if e <= 1e-4 else 1)" || status=1
  args=(--model "$m" --prompt-ids 1,2,3,4,5 --max-new-tokens 24 --temperature 0.8 --seed 7 --ignore-eos --print-ids)
  cpu=$(k3 generate "${args[@]}" --device cpu | tail -n 1)
  gpu=$(k3 generate "${args[@]}" --device cuda --stats | tail -n 1)
  if [ -n "$cpu" ] && [ "$cpu" = "$gpu" ]; then echo "$name generate cuda == cpu: $gpu"; else echo "$name generate DIFFERS: cpu $cpu / cuda $gpu"; status=1; fi
done
exit $status
