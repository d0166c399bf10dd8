// Per-step cost of constrained decoding (infer/json_constraint.h): one token mask over GPT-2's
// 50,257-token vocabulary at several points of a document, for a JSON Schema and for any object.
// The GPT-2 files are read from $K3_SHARED_DIR/data/gpt2.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "infer/json_constraint.h"
#include "gpt2_tokenizer.h"
#include "tokenizer/bpe.h"


namespace {

const k3::Tokenizer& gpt2() { return gpt2_tokenizer(); }

const char* kSchema = R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},
  "tags":{"type":"array","items":{"type":"string"}},"address":{"type":"object","properties":{
  "city":{"type":"string"},"zip":{"type":"string","maxLength":10}},"required":["city"]}},"required":["name","age"]})";

// Masks the vocabulary after `prefix` (the document so far).
void mask_after(benchmark::State& state, bool schema, const std::string& prefix) {
  static const auto vocab = k3::TokenBytes::of(gpt2());
  const auto s = schema ? k3::JsonSchema::compile(k3::Json::parse(kSchema)) : k3::JsonSchema::any_object();
  k3::JsonMatcher check(s);
  if (!check.feed(prefix)) {
    state.SkipWithError("the prefix is not a document's start");
    return;
  }
  k3::JsonConstraint c(s, vocab);
  for (const auto& id : gpt2().encode(prefix)) c.accept(id);
  const int64_t V = int64_t(vocab->bytes.size());
  std::vector<float> logits(static_cast<size_t>(V));
  int64_t allowed = 0;
  for (auto _ : state) {
    std::fill(logits.begin(), logits.end(), 0.0f);
    allowed = c.mask(logits.data(), V);
    benchmark::DoNotOptimize(logits.data());
  }
  state.counters["allowed"] = double(allowed);
  state.counters["vocab"] = double(V);
}

}  // namespace

BENCHMARK_CAPTURE(mask_after, schema_start, true, "")->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(mask_after, schema_key, true, "{\"name\": \"Ann\", ")->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(mask_after, schema_in_string, true, "{\"name\": \"Ann Lee")->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(mask_after, schema_in_integer, true, "{\"name\": \"Ann\", \"age\": 4")->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(mask_after, object_key, false, "{\"a\": 1, ")->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(mask_after, object_in_string, false, "{\"a\": \"some text")->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(mask_after, object_value, false, "{\"a\": ")->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
