#!/bin/sh
# k3 train --profile on the CPU: the table names the step's phases (forward by layer and mixer,
# the backward op by op, clipping, the optimizer), the step takes nearly all of the profiled time,
# and the backward's ops never add up to more than the backward (their times are parts of it).
k3="$1"
text="$2"
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
out=$("$k3" train --preset k3-tiny --data "$text" --steps 2 --batch 2 --seq-len 32 --eval-every 0 --eval-batches 1 \
  --sample-tokens 0 --threads 1 --profile --out "$dir/run" 2>&1) || { echo "$out"; exit 1; }
echo "$out"
for scope in "step" "forward" "mixer kda" "mixer mla" "ffn" "routed experts" "attention residuals" "backward" \
  "cross_entropy" "linear" "delta_rule" "situ_glu" "attnres" "gradient clipping" "optimizer"; do
  echo "$out" | grep -q "^ *$scope  " || { echo "missing scope: $scope"; exit 1; }
done
echo "$out" | awk '/^step +[0-9.]+ +[0-9.]+% / { share = $(NF - 1); sub("%", "", share); share += 0; found = 1; exit !(share >= 90 && share <= 100.05) }
  END { if (!found) exit 1 }' || { echo "the step's share of the profiled time is off"; exit 1; }
# Children of "backward" (indented two more spaces) sum to at most its time.
echo "$out" | awk '
  /^  backward / { inside = 1; parent = $(NF - 2); indent = index($0, $1); sum = 0; next }
  inside && index($0, $1) <= indent { inside = 0 }
  inside && index($0, $1) == indent + 2 { sum += $(NF - 2) }
  END { if (sum == 0 || sum > parent + 0.01) { print "children " sum " against backward " parent; exit 1 } }
' || exit 1
echo "ok"
