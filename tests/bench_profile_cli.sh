#!/bin/sh
# bench decode --profile on the CPU: the table names the step's scopes (each block's mixer by its
# kind, its memory's work, the MoE's parts, the head), the step takes nearly all of the profiled
# time, and a scope's children never add up to more than the scope (their times are parts of its).
k3="$1"
out=$("$k3" bench decode --preset k3-tiny --context 32 --steps 3 --profile 2>&1) || { echo "$out"; exit 1; }
echo "$out"
for scope in "step" "mixer kda" "state step" "short conv" "mixer mla" "latent attention" "router" \
  "routed experts" "lm head" "greedy pick"; do
  echo "$out" | grep -q "^ *$scope  " || { echo "missing scope: $scope"; exit 1; }
done
# The profiled steps' wall time is the 100 %: "step" takes nearly all of it (the loop the rest).
echo "$out" | awk '/^  step / { share = $(NF - 1); sub("%", "", share); share += 0; found = 1; exit !(share >= 90 && share <= 100.05) }
  END { if (!found) exit 1 }' || { echo "the step's share of the profiled time is off"; exit 1; }
# Children of "mixer kda" (indented two more spaces) sum to at most its time.
echo "$out" | awk '
  /^  +mixer kda / { inside = 1; parent = $(NF - 2); indent = index($0, $1); sum = 0; next }
  inside && index($0, $1) <= indent { inside = 0 }
  inside && index($0, $1) == indent + 2 { sum += $(NF - 2) }
  END { if (sum == 0 || sum > parent + 0.01) { print "children " sum " against mixer kda " parent; exit 1 } }
' || exit 1
echo "ok"
