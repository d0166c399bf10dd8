#!/usr/bin/env bash
# Quick start, command 1: install, build, and run k3's main job on its built-in default.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh build
SHARED="${K3_SHARED_DIR:-$(cd .. && pwd)/shared}"

echo "== k3 info --preset kimi-k3 --compare gpt2"
./build/k3 info --preset kimi-k3 --compare gpt2
echo
echo "== k3 info --model gpt2-tiny"
./build/k3 info --model "$SHARED/fixtures/models/gpt2-tiny"
echo
echo "== k3 generate (greedy, KV cache) on the gpt2-tiny fixture"
./build/k3 generate --model "$SHARED/fixtures/models/gpt2-tiny" --prompt-ids 5,17,42,99,7 \
  --max-new-tokens 16 --temperature 0 --print-ids --stats
