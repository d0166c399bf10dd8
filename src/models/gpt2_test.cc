// GPT-2 against the transformers fixture (fixtures/models/gpt2-tiny): logits, greedy ids, and
// decode == prefill.
#include "models/gpt2.h"

#include <gtest/gtest.h>

#include "infer/generate.h"
#include "models/registry.h"
#include "models/testing.h"

namespace k3 {

using testing::fixture_model;
using testing::rel_l2;

class Gpt2Fixture : public ::testing::Test {
 protected:
  void SetUp() override {
    model = load_model(fixture_model("gpt2-tiny"));
    expected = std::make_unique<SafeTensors>(SafeTensors::open(fixture_model("gpt2-tiny") + "/expected.safetensors"));
  }
  std::unique_ptr<Model> model;
  std::unique_ptr<SafeTensors> expected;
};

TEST_F(Gpt2Fixture, LogitsMatchTransformers) {
  Tensor ids = expected->get("input_ids");      // [2, 48]
  Tensor ref = expected->get_f32("logits");     // [2, 48, 512]
  const int64_t B = ids.dim(0), T = ids.dim(1), V = model->vocab_size();
  ASSERT_EQ(V, ref.dim(2));
  std::vector<float> out(size_t(B * T * V));
  for (int64_t b = 0; b < B; ++b)
    model->forward(ids.data<int64_t>() + b * T, T, nullptr, out.data() + b * T * V, Logits::All);
  EXPECT_LT(rel_l2(out.data(), ref.f32(), B * T * V), 1e-4);
}

TEST_F(Gpt2Fixture, GreedyGenerationReproducesTransformers) {
  Tensor prompt = expected->get("prompt_ids");  // [1, 24]
  Tensor greedy = expected->get("greedy_ids");  // [1, 40]
  std::vector<int64_t> p(prompt.data<int64_t>(), prompt.data<int64_t>() + prompt.numel());
  GenerateOptions g;
  g.max_new_tokens = greedy.numel() - prompt.numel();
  g.sampling.temperature = 0;
  auto out = generate(*model, p, g);
  std::vector<int64_t> want(greedy.data<int64_t>(), greedy.data<int64_t>() + greedy.numel());
  EXPECT_EQ(out, want);
}

TEST_F(Gpt2Fixture, TokenByTokenDecodeEqualsFullForward) {
  Tensor greedy = expected->get("greedy_ids");  // [1, 40]
  const int64_t T = greedy.numel(), V = model->vocab_size();
  const int64_t* ids = greedy.data<int64_t>();
  std::vector<float> full(size_t(T * V)), step(size_t(T * V));
  model->forward(ids, T, nullptr, full.data(), Logits::All);
  // Also checks our full forward against transformers' greedy_logits.
  EXPECT_LT(rel_l2(full.data(), expected->get_f32("greedy_logits").f32(), T * V), 1e-4);
  Context ctx = model->new_context(T);
  // A 5-token prefill, then one token at a time: both paths must give the full forward's logits.
  model->forward(ids, 5, &ctx, step.data(), Logits::All);
  for (int64_t t = 5; t < T; ++t) model->forward(ids + t, 1, &ctx, step.data() + t * V, Logits::Last);
  EXPECT_LT(rel_l2(step.data(), full.data(), T * V), 1e-5);
  EXPECT_EQ(ctx.position, T);
  // KV cache bytes: 2 (K,V) x layers x d_model x fp32 per token, with capacity rounding.
  EXPECT_GE(ctx.bytes(), size_t(2 * 2 * 64 * 4 * T));
}

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

}  // namespace k3
