// Every differentiable op against finite differences; attention against a direct softmax.
#include "ops/ag.h"

#include <gtest/gtest.h>

#include "ops/gradcheck.h"

namespace k3 {

using testing::gradcheck;
using testing::random_var;

TEST(Ag, LinearBothLayoutsAndBias) {
  Rng rng(1);
  auto x = random_var({5, 7}, rng), w = random_var({3, 7}, rng), wt = random_var({7, 3}, rng), b = random_var({3}, rng);
  EXPECT_LT(gradcheck([](auto& v) { return ag::linear(v[0], v[1], v[2], WeightLayout::OutIn); }, {x, w, b}), 2e-3);
  EXPECT_LT(gradcheck([](auto& v) { return ag::linear(v[0], v[1], nullptr, WeightLayout::InOut); }, {x, wt}), 2e-3);
}

TEST(Ag, ElementwiseOps) {
  Rng rng(2);
  auto a = random_var({4, 6}, rng), b = random_var({4, 6}, rng);
  EXPECT_LT(gradcheck([](auto& v) { return ag::mul(ag::add(v[0], v[1]), ag::sub(v[0], v[1])); }, {a, b}), 2e-3);
  EXPECT_LT(gradcheck([](auto& v) { return ag::sigmoid(v[0]); }, {a}), 2e-3);
  EXPECT_LT(gradcheck([](auto& v) { return ag::silu(v[0]); }, {a}), 2e-3);
  EXPECT_LT(gradcheck([](auto& v) { return ag::gelu_tanh(v[0]); }, {a}), 2e-3);
  EXPECT_LT(gradcheck([](auto& v) { return ag::scale(ag::sum(v[0]), 0.5f); }, {a}), 2e-3);
}

TEST(Ag, Norms) {
  Rng rng(3);
  auto x = random_var({6, 10}, rng), w = random_var({10}, rng), b = random_var({10}, rng);
  EXPECT_LT(gradcheck([](auto& v) { return ag::layernorm(v[0], v[1], v[2], 1e-5f); }, {x, w, b}), 5e-3);
  EXPECT_LT(gradcheck([](auto& v) { return ag::rmsnorm(v[0], v[1], 1e-6f); }, {x, w}), 5e-3);
  EXPECT_LT(gradcheck([](auto& v) { return ag::rmsnorm(v[0], nullptr, 1e-6f); }, {x}), 5e-3);
}

TEST(Ag, SlicesConcatReshapeEmbedding) {
  Rng rng(4);
  auto x = random_var({3, 8}, rng), y = random_var({3, 2}, rng), table = random_var({10, 4}, rng);
  EXPECT_LT(gradcheck([](auto& v) { return ag::concat_last({ag::slice_last(v[0], 2, 6), v[1], ag::slice_last(v[0], 0, 1)}); }, {x, y}), 2e-3);
  EXPECT_LT(gradcheck([](auto& v) { return ag::reshape(v[0], {4, 6}); }, {x}), 2e-3);
  EXPECT_LT(gradcheck([](auto& v) { return ag::embedding(v[0], {3, 3, 9, 0}); }, {table}), 2e-3);
  EXPECT_THROW(ag::embedding(table, {10}), Error);
}

TEST(Ag, CausalAttentionMatchesDirectSoftmaxAndGradients) {
  Rng rng(5);
  const int64_t B = 2, T = 5, H = 2, hd = 3;
  auto q = random_var({B * T, H * hd}, rng), k = random_var({B * T, H * hd}, rng), v = random_var({B * T, H * hd}, rng);
  Var y = ag::causal_attention(q, k, v, B, T, H, 0.7f);
  // Direct formula for one element: b=1, t=3, h=1.
  const int64_t b = 1, t = 3, h = 1;
  std::vector<double> s(size_t(t + 1));
  double mx = -1e30, z = 0;
  for (int64_t j = 0; j <= t; ++j) {
    double d = 0;
    for (int64_t i = 0; i < hd; ++i)
      d += double(q->value.f32()[(b * T + t) * H * hd + h * hd + i]) * k->value.f32()[(b * T + j) * H * hd + h * hd + i];
    s[size_t(j)] = 0.7 * d;
    mx = std::max(mx, s[size_t(j)]);
  }
  for (auto& e : s) z += e = std::exp(e - mx);
  for (int64_t i = 0; i < hd; ++i) {
    double o = 0;
    for (int64_t j = 0; j <= t; ++j) o += s[size_t(j)] / z * v->value.f32()[(b * T + j) * H * hd + h * hd + i];
    EXPECT_NEAR(y->value.f32()[(b * T + t) * H * hd + h * hd + i], o, 1e-5);
  }
  EXPECT_LT(gradcheck([&](auto& x) { return ag::causal_attention(x[0], x[1], x[2], B, T, H, 0.7f); }, {q, k, v}), 5e-3);
}

TEST(Ag, ChunkedCrossEntropyMatchesDirectFormula) {
  Rng rng(6);
  const int64_t N = 7, D = 5, V = 23;
  auto h = random_var({N, D}, rng), w = random_var({V, D}, rng);
  std::vector<int64_t> targets = {0, 22, 5, -1, 17, 3, 11};
  Var l = ag::cross_entropy_head(h, w, targets, 4);  // chunks of 4 over a vocabulary of 23
  double ref = 0;
  int count = 0;
  for (int64_t r = 0; r < N; ++r) {
    if (targets[size_t(r)] < 0) continue;
    std::vector<double> z(static_cast<size_t>(V), 0.0);
    double mx = -1e30, se = 0;
    for (int64_t v = 0; v < V; ++v) {
      for (int64_t d = 0; d < D; ++d) z[size_t(v)] += double(h->value.f32()[r * D + d]) * w->value.f32()[v * D + d];
      mx = std::max(mx, z[size_t(v)]);
    }
    for (double e : z) se += std::exp(e - mx);
    ref += mx + std::log(se) - z[size_t(targets[size_t(r)])];
    ++count;
  }
  EXPECT_NEAR(l->value.f32()[0], ref / count, 1e-5);
  EXPECT_LT(gradcheck([&](auto& x) { return ag::cross_entropy_head(x[0], x[1], targets, 4); }, {h, w}), 5e-3);
  // z-loss: the value adds c·mean(lse²) (checked through the difference), gradients by FD.
  Var lz = ag::cross_entropy_head(h, w, targets, 4, 0.01f);
  EXPECT_GT(lz->value.f32()[0], l->value.f32()[0]);
  EXPECT_LT(gradcheck([&](auto& x) { return ag::cross_entropy_head(x[0], x[1], targets, 5, 0.01f); }, {h, w}), 5e-3);
}

TEST(Ag, NoGraphIsKeptWhenNotRecording) {
  Rng rng(7);
  auto a = random_var({3}, rng);
  Var y = ag::sigmoid(a);
  EXPECT_FALSE(y->requires_grad);
  EXPECT_TRUE(y->parents.empty());
}

}  // namespace k3
