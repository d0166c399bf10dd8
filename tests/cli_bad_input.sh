#!/bin/sh
# Bad values given to the k3 program are refused with a non-zero exit and a message naming the
# field or option: an empty input_ids, serve's --timeout and --http-threads out of range, two
# sources of drafts, MTP drafts from a model without the layer, JSON constraints that cannot be honoured, a config
# whose routing or YaRN factor is impossible (k3 info checks what loading checks), a weight stored
# as an integer dtype, a model too large for the machine.
k3="$1"
fixture="$2"  # a model folder (gpt2-tiny)
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
. "$(dirname "$0")/expect_error.sh"
# input_ids of shape [1, 0]: a safetensors file written by hand (8-byte header length, header).
python3 - "$dir/empty.safetensors" <<'PY'
import json, struct, sys
h = json.dumps({"input_ids": {"dtype": "I64", "shape": [1, 0], "data_offsets": [0, 0]}}).encode()
h += b" " * ((8 - len(h) % 8) % 8)
open(sys.argv[1], "wb").write(struct.pack("<Q", len(h)) + h)
PY
expect_error "logits on T = 0" "holds no tokens" "$k3" logits --model "$fixture" --input "$dir/empty.safetensors" --output "$dir/o.safetensors"
expect_error "serve --timeout 1e10" "--timeout" "$k3" serve --model "$fixture" --timeout 1e10
expect_error "serve --http-threads 5000" "--http-threads" "$k3" serve --model "$fixture" --http-threads 5000
expect_error "serve --max-step-tokens 4 --max-batch 8" "--max-step-tokens" "$k3" serve --model "$fixture" --max-step-tokens 4 --max-batch 8
expect_error "serve --speculate ngram --draft-model" "not both" "$k3" serve --model "$fixture" --speculate ngram --draft-model "$fixture"
expect_error "generate --speculate mtp without an MTP layer" "MTP layer" "$k3" generate --model "$fixture" --prompt-ids 1,2 --speculate mtp
expect_error "serve --speculate mtp without an MTP layer" "MTP layer" "$k3" serve --model "$fixture" --port 0 --speculate mtp
expect_error "generate --json --json-schema" "not both" "$k3" generate --model "$fixture" --prompt-ids 1,2 --json --json-schema "$dir/s.json"
printf '{"type": "string", "pattern": "^a"}' > "$dir/s.json"
expect_error "generate --json-schema with a pattern" "'pattern'" "$k3" generate --model "$fixture" --prompt-ids 1,2 --json-schema "$dir/s.json"
printf '{"type": "object"}' > "$dir/s.json"
expect_error "generate --json-schema without a tokenizer" "no tokenizer" "$k3" generate --model "$fixture" --prompt-ids 1,2 --json-schema "$dir/s.json"
mkdir -p "$dir/m"
python3 - "$fixture/config.json" "$dir/m/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update({"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": 16,
          "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 8,
          "num_experts_per_tok": 100, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
          "bos_token_id": 0, "eos_token_id": 1})
json.dump(c, open(sys.argv[2], "w"))
PY
expect_error "info: top-100 of 8 experts" "num_experts_per_tok" "$k3" info --model "$dir/m"
python3 - "$dir/m/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["num_experts_per_tok"] = 2
c["rope_scaling"] = {"type": "yarn", "factor": "big", "original_max_position_embeddings": 64}
json.dump(c, open(sys.argv[1], "w"))
PY
expect_error "info: YaRN factor \"big\"" "'factor'" "$k3" info --model "$dir/m"
# A model far larger than the machine (GPT-2 with 2,000 layers of width 8,192: 5.86 TiB as fp32):
# refused with the bytes needed before any weight is read, not killed halfway.
mkdir -p "$dir/huge"
python3 - "$fixture/config.json" "$dir/huge/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update({"n_layer": 2000, "n_embd": 8192, "n_head": 64})
json.dump(c, open(sys.argv[2], "w"))
PY
cp "$fixture/model.safetensors" "$dir/huge/"
expect_error "a model larger than the machine" "of memory available" "$k3" generate --model "$dir/huge" --prompt-ids 1 --max-new-tokens 1
echo "ok"
