// GPT-2 specifics (the fixture comparisons are in fixture_models_test.cc).
#include "models/gpt2.h"

#include <gtest/gtest.h>

#include "mixers/attention/kv_cache.h"

#include "infer/generate.h"
#include "models/registry.h"
#include "models/testing.h"

namespace k3 {


TEST(Gpt2, PresetCountsMatchTheSpec) {
  auto m = build_model(preset_config("gpt2"), "gpt2");
  EXPECT_EQ(m->total_params(), 124439808);  // spec §1
  ArchReport r = report_from_model(*m, "gpt2");
  double kv = 0;
  for (const auto& lm : r.memory) kv += lm.spec.per_token_bytes;
  EXPECT_EQ(kv, 73728.0);  // 2·L·d fp32 (spec §1)
}

TEST(Gpt2, BadCheckpointsGiveClearErrors) {
  Json c = preset_config("gpt2");
  c["n_head"] = 5;
  EXPECT_THROW(build_model(c, "cfg"), Error);
  c = preset_config("gpt2");
  c.erase("n_embd");
  EXPECT_THROW(build_model(c, "cfg"), Error);
  c["model_type"] = "gpt7";
  try {
    build_model(c, "cfg");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown architecture"), std::string::npos);
  }
  EXPECT_THROW(load_model("/nonexistent"), Error);
}

// The k3 short-conv variant (k3_short_conv): decoding one token at a time through the KV cache
// and its conv tail equals the full forward; the conv is causal (a token's logits do not move when
// later tokens change) and it is applied (zeroing its weights changes the logits).
TEST(Gpt2, ShortConvVariantDecodesAsItPrefills) {
  Json c = {{"model_type", "gpt2"}, {"vocab_size", 40},  {"n_positions", 32},     {"n_embd", 16},
            {"n_layer", 2},         {"n_head", 2},       {"k3_short_conv", 4},    {"tie_word_embeddings", true}};
  auto m = build_model(c, "cfg");
  m->init_random(5);
  EXPECT_EQ(m->config_json().value("k3_short_conv", 0), 4);
  EXPECT_FALSE(build_model(preset_config("gpt2"), "gpt2")->config_json().contains("k3_short_conv"));
  const int64_t T = 20, V = 40;
  std::vector<int64_t> ids(T);
  for (int64_t t = 0; t < T; ++t) ids[size_t(t)] = (7 * t + 3) % V;
  std::vector<float> full(size_t(T * V)), step(size_t(T * V));
  m->forward(ids.data(), T, nullptr, full.data(), Logits::All);
  Context ctx = m->new_context(T);
  m->forward(ids.data(), 5, &ctx, step.data(), Logits::All);
  for (int64_t t = 5; t < T; ++t) m->forward(ids.data() + t, 1, &ctx, step.data() + t * V, Logits::Last);
  EXPECT_LT(testing::rel_l2(step.data(), full.data(), T * V), 1e-5);

  std::vector<int64_t> changed = ids;
  changed[12] = (changed[12] + 1) % V;
  std::vector<float> other(size_t(T * V));
  m->forward(changed.data(), T, nullptr, other.data(), Logits::All);
  EXPECT_LT(testing::rel_l2(other.data(), full.data(), 12 * V), 1e-6);       // tokens before 12 unchanged
  EXPECT_GT(testing::rel_l2(other.data() + 12 * V, full.data() + 12 * V, V), 1e-4);

  m->visit([](const std::string& name, Node& p, ParamKind) {
    if (name.ends_with("c_attn_conv.weight")) std::fill(p.value.f32(), p.value.f32() + p.value.numel(), 0.0f);
  });
  m->forward(ids.data(), T, nullptr, other.data(), Logits::All);
  EXPECT_GT(testing::rel_l2(other.data(), full.data(), T * V), 1e-5);  // float noise is ~1e-7

  c["k3_short_conv"] = -1;
  EXPECT_THROW(build_model(c, "cfg"), Error);
}

// extend_zeros shifts zero inputs into the conv tail: the last W-1 rows of [tail; 0 x n].
TEST(Gpt2, KvCacheConvTailShiftsInZeros) {
  const int64_t C = 3, W = 4;
  for (int64_t n : {1, 2, 3, 7}) {
    KVCache cache(1, 2, 64, C, W);
    float* tail = cache.conv_tail();
    ASSERT_NE(tail, nullptr);
    for (int64_t i = 0; i < (W - 1) * C; ++i) tail[i] = float(i + 1);
    cache.extend_zeros(n);
    EXPECT_EQ(cache.length(), n);
    for (int64_t r = 0; r < W - 1; ++r)
      for (int64_t ch = 0; ch < C; ++ch) {
        const int64_t src = r + n;  // row of [tail; zeros] that lands in row r
        const float want = src < W - 1 ? float(src * C + ch + 1) : 0.0f;
        EXPECT_EQ(tail[r * C + ch], want) << "n " << n << " row " << r;
      }
    cache.reset();
    EXPECT_EQ(cache.conv_tail()[0], 0.0f);
  }
  EXPECT_EQ(KVCache(1, 2, 64).conv_tail(), nullptr);
}

}  // namespace k3
