#!/bin/sh
# --cache-dtype: bf16 latent caches are a CUDA storage, so asking for them on the CPU is a clear
# error naming the option and the device (generate, bench decode); a dtype outside f32/bf16 is
# refused by the option itself.
k3="$1"
model="$2"
. "$(dirname "$0")/expect_error.sh"
expect_error "generate on the CPU" "--cache-dtype bf16 applies to --device cuda" \
  "$k3" generate --model "$model" --prompt-ids 1,2 --max-new-tokens 1 --cache-dtype bf16
expect_error "bench decode on the CPU" "--cache-dtype bf16 applies to --device cuda" \
  "$k3" bench decode --preset k3-tiny --context 16 --cache-dtype bf16
expect_error "an unknown dtype" "--cache-dtype" "$k3" generate --model "$model" --prompt-ids 1 --cache-dtype fp16
