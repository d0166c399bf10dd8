#!/bin/bash
# k3 train killed at arbitrary moments (SIGKILL, mostly inside a checkpoint save, with a save every
# step) and resumed each time ends with the same weights and optimizer state as a run never
# interrupted; a second Ctrl-C during the final save does not cut it short. Every resume either
# continues from a complete checkpoint or, before the first one, starts the run afresh.
set -u
k3="$1"
text="$2"
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
export K3_CACHE_DIR="$dir/cache"
common=(--preset gpt2-tiny --data "$text" --batch 2 --seq-len 32 --eval-every 0 --eval-batches 1
        --sample-tokens 0 --threads 1 --quiet)
"$k3" train "${common[@]}" --steps 40 --out "$dir/straight" >/dev/null || { echo "the uninterrupted run failed"; exit 1; }

# Killed again and again until the run completes (at most 60 attempts).
run="$dir/killed"
kills=0
for attempt in $(seq 1 60); do
  # Killed after its last checkpoint was published (during the final evaluation): complete.
  if grep -q '"step": 40' "$run/trainer_state.json" 2>/dev/null; then break; fi
  if [ -L "$run/latest" ]; then
    "$k3" train --resume "$run" --steps 40 --threads 1 --quiet --sample-tokens 0 >"$dir/log" 2>&1 &
  else
    "$k3" train "${common[@]}" --steps 40 --out "$run" --overwrite --save-every 1 >"$dir/log" 2>&1 &
  fi
  pid=$!
  # 10 to 400 ms: a step is a few ms, a save a few more, so most kills land inside a save.
  sleep "0.$(printf '%03d' $(( (RANDOM % 390) + 10 )))"
  if kill -9 "$pid" 2>/dev/null; then
    wait "$pid" 2>/dev/null
    kills=$((kills + 1))
    continue
  fi
  wait "$pid"
  rc=$?
  if [ "$rc" -ne 0 ]; then echo "a resume failed (exit $rc):"; cat "$dir/log"; exit 1; fi
  if grep -q '"step": 40' "$run/trainer_state.json" 2>/dev/null; then break; fi
done
grep -q '"step": 40' "$run/trainer_state.json" || { echo "the killed run never completed"; exit 1; }
for f in model.safetensors optimizer.safetensors; do
  cmp -s "$dir/straight/$f" "$run/$f" || { echo "$f differs from the uninterrupted run's after $kills kills"; exit 1; }
done
left=$(find "$run" -name '*.tmp*' | wc -l)
[ "$left" -eq 0 ] || { echo "temporary files left behind:"; find "$run" -name '*.tmp*'; exit 1; }
echo "killed $kills times; final weights and optimizer state identical to the uninterrupted run"

# Two Ctrl-Cs: the first asks for a checkpoint, the second arrives while it is being written.
"$k3" train "${common[@]}" --steps 100000 --decay-steps 40 --out "$dir/int" >"$dir/int.log" 2>&1 &
pid=$!
for i in $(seq 1 100); do grep -q . "$dir/int.log" 2>/dev/null && break; [ -d "$dir/int" ] && break; sleep 0.1; done
sleep 1
kill -INT "$pid"
sleep 0.005
kill -INT "$pid" 2>/dev/null
wait "$pid"
rc=$?
[ "$rc" -eq 0 ] || { echo "interrupted training exited $rc"; cat "$dir/int.log"; exit 1; }
[ -L "$dir/int/latest" ] || { echo "no checkpoint after Ctrl-C"; cat "$dir/int.log"; exit 1; }
"$k3" train --resume "$dir/int" --steps 100000 --threads 1 --quiet --sample-tokens 0 >"$dir/int2.log" 2>&1 &
pid=$!
sleep 0.5
kill -INT "$pid"
wait "$pid" || { echo "the resume of an interrupted run failed"; cat "$dir/int2.log"; exit 1; }
echo "ok"
