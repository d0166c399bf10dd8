#!/bin/sh
# bench decode --memory-mb: each model decodes as many sequences as its memories fit in the budget;
# and --dtype bf16 is refused off the GPU.
# gpt2-tiny keeps K and V (2 layers x 2 x width 128 x 4 bytes = 2 KiB) per token and nothing fixed;
# a run of --steps 3 decodes 3 warm-up + 2 timed steps past the context, so at context 64 a
# sequence holds 69 tokens = 141,312 bytes and 1 MiB fits floor(1048576 / 141312) = 7 of them.
k3="$1"
fail() { echo "$out"; echo "FAIL: $1"; exit 1; }
out=$("$k3" bench decode --preset gpt2-tiny --versus gpt2-tiny --context 64,190,1000 --steps 3 --memory-mb 1 2>&1) ||
  fail "exit status"
echo "$out"
# 190 + 5 tokens = 399,360 bytes: 2 fit; context 1000 is past the model's 256 positions.
[ "$(echo "$out" | awk '$1 == 64 { print $2; exit }')" = 7 ] || fail "batch at context 64 is not 7"
[ "$(echo "$out" | awk '$1 == 190 { print $2; exit }')" = 2 ] || fail "batch at context 190 is not 2"
echo "$out" | grep -q "beyond the model's 256 positions" || fail "context 1000 not refused"
echo "$out" | grep -Eq "^ +64 +7 / 7 " || fail "the speed-up table does not name both batches"
# A budget below one sequence says so and times nothing; --batch and --memory-mb exclude each other.
out=$("$k3" bench decode --preset gpt2-tiny --context 64 --steps 3 --memory-mb 0.1 2>&1) || fail "exit status (small budget)"
echo "$out" | grep -q "one sequence needs 138.00 KiB, over the budget" || fail "no over-budget line"
out=$("$k3" bench decode --preset gpt2-tiny --batch 2 --memory-mb 1 2>&1) && fail "--batch with --memory-mb accepted"
echo "$out" | grep -q "excludes" || fail "no reason given for refusing --batch with --memory-mb"
# bf16 weight storage is a CUDA option: on the CPU it is refused by name, not ignored.
out=$("$k3" bench decode --preset gpt2-tiny --context 64 --steps 3 --dtype bf16 --device cpu 2>&1) &&
  fail "--dtype bf16 accepted on the CPU"
echo "$out" | grep -q -- "--dtype bf16 applies to --device cuda" || fail "no reason given for refusing --dtype bf16"
echo "ok"
