#!/usr/bin/env bash
# Serving figures on the GPU (docs/performance.md, "Serving on the GPU"). Trains k3-small and
# k3-tiny on the project's docs (the GPU machine has no KJV corpus; the same BPE for both, so
# k3-tiny can draft for k3-small), then times:
# prompt-lookup and draft-model speculation (`k3 generate --stats`), what a long prompt costs the
# streams already decoding (tools/serve_itl.py) and multi-turn TTFT with the prefix cache's host
# tier off and on (tools/serve_multiturn.py). Run it on the GPU machine after tools/gpu/pack.sh,
# as `bash tools/gpu/run.sh bash tools/gpu/serving.sh`; K3_DEVICE=cpu K3_STEPS=2 try it here.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
k3="$(command -v k3 || echo "$root/build/k3")"
dev="${K3_DEVICE:-cuda}"
steps="${K3_STEPS:-300}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
status=0
run() { echo "\$ k3 $*" >&2; "$k3" "$@" || status=1; }
corpus=("$root"/docs/*.md "$root"/README.md)
train() {  # preset, folder, extra args
  "$k3" train --device "$dev" --preset "$1" --steps "$steps" --eval-every 0 --data "${corpus[@]}" --out "$2" "${@:3}" \
    2>&1 | tail -n 2
}
train k3-small "$work/k3-small"
train k3-tiny "$work/k3-tiny" --tokenizer "$work/k3-small"
prompt="The prefix cache keeps snapshots of the context, and a hit restores them. The prefix cache keeps snapshots of the context, and a hit restores them. The prefix cache keeps"
gen=(generate --device "$dev" --model "$work/k3-small" --prompt "$prompt" --max-new-tokens 400 --ignore-eos
  --temperature 0 --stats)
echo "== speculation: k3-small, greedy, 400 tokens"
for spec in "" "--speculate ngram" "--draft-model $work/k3-tiny"; do
  # shellcheck disable=SC2086
  run "${gen[@]}" $spec > "$work/out.txt" 2> "$work/err.txt"
  cat "$work/err.txt"
  if [ -z "$spec" ]; then cp "$work/out.txt" "$work/plain.txt"
  elif cmp -s "$work/out.txt" "$work/plain.txt"; then echo "output identical to plain decoding"
  else echo "OUTPUT DIFFERS from plain decoding"; status=1; fi
done
echo "== a long prompt among 16 decoding streams (k3-small)"
python3 "$root/tools/serve_itl.py" --k3 "$k3" --model "$work/k3-small" --settings 0,256,1024 -- --device "$dev" ||
  status=1
echo "== multi-turn TTFT, host tier off and on (k3-small)"
python3 "$root/tools/serve_multiturn.py" --k3 "$k3" --model "$work/k3-small" -- --device "$dev" || status=1
exit $status
