#!/bin/sh
# k3 tokenizer encode / decode on the format fixtures: the ids of every fixture's reference
# (tests/data/tokenizer/format_goldens.json) for the joined corpus, decode giving the text back,
# and clear errors for bad input.
k3="$1"
data="$2"  # tests/data/tokenizer
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
. "$(dirname "$0")/expect_error.sh"
python3 - "$data" "$dir/joined.txt" <<'PY' || exit 1
import json, sys
texts = json.load(open(sys.argv[1] + "/multilingual.json", encoding="utf-8"))
open(sys.argv[2], "w", encoding="utf-8", newline="").write("\n".join(texts))
PY
for m in deepseek-v3 qwen3 pipeline-mix kimi; do
  "$k3" tokenizer encode --model "$data/formats/$m" --input "$dir/joined.txt" > "$dir/$m.ids" || exit 1
  python3 - "$data/format_goldens.json" "$m" "$dir/$m.ids" <<'PY' || { echo "FAIL: $m ids differ from the reference"; exit 1; }
import json, sys
want = json.load(open(sys.argv[1], encoding="utf-8"))["fixtures"][sys.argv[2]]["joined"]
got = json.load(open(sys.argv[3]))
sys.exit(0 if got == want else 1)
PY
done
"$k3" tokenizer decode --model "$data/formats/kimi/tiktoken.model" --input "$dir/kimi.ids" > "$dir/back.txt" || exit 1
cmp -s "$dir/back.txt" "$dir/joined.txt" || { echo "FAIL: decode(encode(text)) != text (kimi)"; exit 1; }
echo '[1, "x"]' > "$dir/bad.json"
expect_error "decode of a non-id" "not a token id" "$k3" tokenizer decode --model "$data/formats/qwen3" --input "$dir/bad.json"
expect_error "decode of text" "JSON array" sh -c "echo hello | '$k3' tokenizer decode --model '$data/formats/qwen3'"
expect_error "a missing model" "no such file or folder" "$k3" tokenizer encode --model "$dir/none" --input "$dir/joined.txt"
echo "ok"
