#!/bin/sh
# k3 quantize and --quantize: a model folder rewritten in FP8 and in MXFP4 gives, loaded packed,
# the same logits as the original with --quantize of the same format (one quantisation, two
# paths); generate and bench decode run with packed weights; bad input is refused by name.
set -e
k3="$1"
model="$2"
gpt2="$3"
. "$(dirname "$0")/expect_error.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for fmt in fp8 mxfp4; do
  "$k3" quantize --model "$model" --format "$fmt" --out "$work/$fmt" | grep "weight tensors as $fmt"
  [ -f "$work/$fmt/tokenizer.json" ] || { [ ! -f "$model/tokenizer.json" ] || { echo "tokenizer not copied"; exit 1; }; }
  grep -q quantization_config "$work/$fmt/config.json"
  "$k3" logits --model "$work/$fmt" --input "$model/expected.safetensors" --output "$work/a.safetensors"
  "$k3" logits --model "$model" --quantize "$fmt" --input "$model/expected.safetensors" --output "$work/b.safetensors"
  cmp "$work/a.safetensors" "$work/b.safetensors"
  "$k3" generate --model "$work/$fmt" --prompt-ids 1,2,3 --max-new-tokens 4 --temperature 0 --print-ids | grep -E '[0-9]'
done
"$k3" bench decode --preset k3-tiny --context 16 --steps 2 --quantize mxfp4 | grep -q "of roofline"
expect_error "an --out that holds a model" "already holds a model" \
  "$k3" quantize --model "$model" --format fp8 --out "$work/fp8"
expect_error "GPT-2" "cannot be quantised" "$k3" logits --model "$gpt2" --quantize fp8 \
  --input "$gpt2/expected.safetensors" --output "$work/c.safetensors"
expect_error "an unknown format" "--quantize" "$k3" generate --model "$model" --prompt-ids 1 --quantize int4
