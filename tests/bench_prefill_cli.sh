#!/bin/sh
# bench prefill and --layers: prompt tokens/s beside the GEMM-peak roofline at a preset's shape, a
# real-width slice of its first layers, and bad input refused by name.
k3="$1"
fail() { echo "$out"; echo "FAIL: $1"; exit 1; }
out=$("$k3" bench prefill --preset gpt2-tiny --seq-len 32,1000 --reps 1 2>&1) || fail "exit status"
echo "$out"
echo "$out" | grep -q "measured sgemm peak" || fail "no measured peak"
echo "$out" | grep -Eq "^ +32 +1 +[0-9]+ +[0-9]+ +[0-9.]+% " || fail "no figure, roofline and ratio at 32 tokens"
echo "$out" | grep -q "beyond the model's 256 positions" || fail "1000 tokens not refused"
# gpt2-tiny: 2 layers of width 128, each 12 x 128^2 = 196,608 weights (q/k/v, out, and the 4x MLP's
# two), 384 + 128 + 512 + 128 = 1,152 biases and 2 x 256 norm parameters: 198,272. The one-layer
# slice has exactly one layer fewer.
whole=$(echo "$out" | sed -n 's/^gpt2-tiny: \([0-9,]*\) params.*/\1/p' | tr -d ,)
out=$("$k3" bench prefill --preset gpt2-tiny --layers 1 --seq-len 32 --reps 1 2>&1) || fail "exit status (--layers 1)"
one=$(echo "$out" | sed -n 's/^gpt2-tiny, first 1 layers at full width: \([0-9,]*\) params.*/\1/p' | tr -d ,)
[ -n "$whole" ] && [ -n "$one" ] && [ $((whole - one)) -eq 198272 ] || fail "one layer is not $whole - 198272 params ($one)"
out=$("$k3" bench decode --preset gpt2-tiny --layers 1 --context 16 --steps 3 2>&1) || fail "exit status (decode --layers)"
echo "$out" | grep -q "gpt2-tiny (first 1 layers at full width)" || fail "decode does not say it ran a slice"
out=$("$k3" bench prefill --preset gpt2-tiny --layers 3 2>&1) && fail "3 layers of a 2-layer model accepted"
echo "$out" | grep -q -- "--layers 3 is not in \[1, 2\]" || fail "no reason given for refusing --layers 3"
out=$("$k3" bench prefill --preset gpt2-tiny --dtype bf16 --device cpu 2>&1) && fail "--dtype bf16 accepted on the CPU"
echo "$out" | grep -q -- "--dtype bf16 applies to --device cuda" || fail "no reason given for refusing --dtype bf16"
echo "ok"
