#!/bin/sh
# bench decode --temperature: sampled decoding (the step's logits come back, each sequence's own
# sampler draws) runs and reports a positive rate for every context; a negative temperature is a
# clear error naming the option.
k3="$1"
out=$("$k3" bench decode --preset k3-tiny --context 16,40 --steps 3 --batch 2 --temperature 0.8 2>&1) || { echo "$out"; exit 1; }
echo "$out"
echo "$out" | grep -q "sampled at temperature 0.8" || { echo "no line saying the tokens are sampled"; exit 1; }
for c in 16 40; do
  echo "$out" | awk -v c="$c" '$1 == c && $2 == 2 { found = 1; exit !($3 > 0) } END { if (!found) exit 1 }' ||
    { echo "no positive tok/s row for context $c"; exit 1; }
done
if out=$("$k3" bench decode --preset k3-tiny --context 16 --steps 3 --temperature -1 2>&1); then
  echo "a negative temperature was accepted"; exit 1
fi
echo "$out" | grep -q -- "--temperature" || { echo "the error does not name --temperature: $out"; exit 1; }
echo "ok"
