// MLA: absorbed decode over the latent cache equals the expanded prefill; gradients match
// finite differences; RoPE and NoPE, with and without q LoRA and the output gate.
#include "mixers/mla/mla.h"

#include <gtest/gtest.h>

#include "ops/gradcheck.h"

namespace k3 {

namespace {
void init(const Mixer& m, uint64_t seed, float scale = 0.3f) {
  Rng rng(seed);
  m.visit("", [&](const std::string& name, Node& p, ParamKind k) {
    p.value = Tensor::empty(p.value.shape());
    for (int64_t i = 0; i < p.value.numel(); ++i)
      p.value.f32()[i] = k == ParamKind::Norm ? 1.0f + 0.1f * rng.normal() : scale * rng.normal();
  });
}
double rel(const Tensor& a, const Tensor& b) {
  double n = 0, d = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    n += std::pow(double(a.f32()[i]) - b.f32()[i], 2);
    d += std::pow(double(b.f32()[i]), 2);
  }
  return std::sqrt(n / d);
}
MlaOptions small(MlaPosition p, bool lora, OutputGate g) {
  MlaOptions o;
  o.d_model = 16;
  o.heads = 3;
  if (lora) o.q_lora_rank = 8;
  o.kv_lora_rank = 6;
  o.qk_nope_head_dim = 4;
  o.qk_rope_head_dim = 4;
  o.v_head_dim = 5;
  o.position = p;
  o.gate = g;
  o.max_positions = 64;
  return o;
}
}  // namespace

class MlaVariants : public ::testing::TestWithParam<int> {};

TEST_P(MlaVariants, AbsorbedDecodeEqualsExpandedPrefill) {
  const int v = GetParam();
  Mla m(small(v & 1 ? MlaPosition::Rope : MlaPosition::NoPE, v & 2, v & 4 ? OutputGate::Sigmoid : OutputGate::None));
  init(m, 10 + uint64_t(v));
  Rng rng(3);
  const int64_t T = 9;
  Var x = testing::random_var({T, 16}, rng, 1.0f, false);
  Var full = m.forward(x, SeqBatch{1, T, nullptr});
  auto mem = m.new_memory(64);
  Memory* mems[1] = {mem.get()};
  // 4 tokens at once, then one at a time.
  Var a = m.forward(constant(x->value.slice(0, 0, 4).clone()), SeqBatch{1, 4, mems});
  std::vector<Var> parts = {a};
  for (int64_t t = 4; t < T; ++t) parts.push_back(m.forward(constant(x->value.slice(0, t, t + 1).clone()), SeqBatch{1, 1, mems}));
  Tensor step = Tensor::empty({T, 16});
  int64_t row = 0;
  for (auto& p : parts) {
    std::memcpy(step.f32() + row * 16, p->value.f32(), p->value.nbytes());
    row += p->value.dim(0);
  }
  EXPECT_LT(rel(step, full->value), 1e-5);
  EXPECT_EQ(mem->length(), T);
}

TEST_P(MlaVariants, GradientsMatchFiniteDifferences) {
  const int v = GetParam();
  Mla m(small(v & 1 ? MlaPosition::Rope : MlaPosition::NoPE, v & 2, v & 4 ? OutputGate::Sigmoid : OutputGate::None));
  init(m, 20 + uint64_t(v));
  Rng rng(4);
  std::vector<Var> inputs = {testing::random_var({2 * 5, 16}, rng)};
  m.visit("", [&](const std::string&, Node& p, ParamKind) {
    inputs.push_back(std::shared_ptr<Node>(std::shared_ptr<Node>{}, &p));
  });
  double err = testing::gradcheck([&](const std::vector<Var>& in) { return m.forward(in[0], SeqBatch{2, 5, nullptr}); },
                                  inputs, 1e-2f, 24);
  EXPECT_LT(err, 1e-2);
}

INSTANTIATE_TEST_SUITE_P(Mla, MlaVariants, ::testing::Range(0, 8));

TEST(Rope, YarnMatchesTheClosedFormAtTheExtremes) {
  // The fastest pair (i = 0) extrapolates (θ unchanged); the slowest is interpolated (θ / factor).
  YarnScaling y;
  y.factor = 40;
  y.original_max_position_embeddings = 4096;
  y.mscale = 1;
  y.mscale_all_dim = 1;
  RopeTable t = make_rope(64, 10000.0, y);
  RopeTable plain = make_rope(64, 10000.0);
  EXPECT_DOUBLE_EQ(t.inv_freq[0], plain.inv_freq[0]);
  EXPECT_NEAR(t.inv_freq[31], plain.inv_freq[31] / 40, 1e-15);
  EXPECT_DOUBLE_EQ(t.attention_factor, 1.0);  // mscale == mscale_all_dim
  EXPECT_NEAR(yarn_mscale(40, 1), 0.1 * std::log(40.0) + 1, 1e-12);
}

}  // namespace k3
