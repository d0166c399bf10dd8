#!/usr/bin/env bash
# On the GPU machine (after run.sh unpacked the bundle): `k3 serve --device cuda` and
# `k3 serve --device cpu` on the same fixture model answer the same requests (greedy, with
# logprobs; 4 at once, so the CUDA server batches them); tokens must be equal and logprobs
# within 1e-3.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
m="$root/.gpu/shared/fixtures/models/${1:-kimi-linear-tiny}"
tmp=$(mktemp -d)
k3 serve --model "$m" --port 18601 --device cpu > "$tmp/cpu.log" 2>&1 & cpu_pid=$!
k3 serve --model "$m" --port 18602 --device cuda > "$tmp/cuda.log" 2>&1 & gpu_pid=$!
trap 'kill $cpu_pid $gpu_pid 2>/dev/null' EXIT
for p in 18601 18602; do
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$p/health" > /dev/null && break; sleep 0.2; done
done
for p in 18601 18602; do
  pids=()
  for i in 0 1 2 3; do
    curl -sf "http://127.0.0.1:$p/v1/completions" -H 'Content-Type: application/json' \
      -d "{\"prompt\": [$((1 + i)), 7, 19, 4], \"max_tokens\": 12, \"temperature\": 0, \"logprobs\": 1}" \
      > "$tmp/$p.$i.json" & pids+=($!)
  done
  wait "${pids[@]}"
done
python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
worst, ok = 0.0, True
for i in range(4):
    a = json.load(open(f"{tmp}/18601.{i}.json"))["choices"][0]["logprobs"]
    b = json.load(open(f"{tmp}/18602.{i}.json"))["choices"][0]["logprobs"]
    ok &= a["tokens"] == b["tokens"] and len(a["tokens"]) == 12
    worst = max([worst] + [abs(x - y) for x, y in zip(a["token_logprobs"], b["token_logprobs"])])
print(f"serve cuda vs cpu: 4 requests x 12 tokens, tokens {'equal' if ok else 'DIFFER'}, worst logprob diff {worst:.2e}")
sys.exit(0 if ok and worst < 1e-3 else 1)
PY
