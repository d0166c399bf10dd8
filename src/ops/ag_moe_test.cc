// MoE ops (ag_moe.h): finite-difference gradients, dispatch grouping and the balance loss value.
#include "ops/ag_moe.h"

#include <gtest/gtest.h>

#include <cmath>

#include "ops/ag.h"
#include "ops/gradcheck.h"

namespace k3 {

using testing::gradcheck;
using testing::random_var;

TEST(AgMoe, SoftmaxAndGathers) {
  Rng rng(21);
  auto x = random_var({5, 7}, rng);
  Var p = ag::softmax_last(x);
  for (int64_t m = 0; m < 5; ++m) {
    double s = 0;
    for (int64_t j = 0; j < 7; ++j) s += p->value.f32()[m * 7 + j];
    EXPECT_NEAR(s, 1.0, 1e-6);
  }
  EXPECT_LT(gradcheck([](auto& v) { return ag::softmax_last(v[0]); }, {x}), 2e-3);
  // Repeated rows: the backward must add, not overwrite.
  EXPECT_LT(gradcheck([](auto& v) { return ag::gather_rows(v[0], {4, 0, 4, 2}); }, {x}), 2e-3);
  Tensor off = Tensor::from_vector({0.1f, -0.2f, 0.3f, 0.0f, 1.0f, 2.0f, -1.0f}, {7});
  std::vector<int64_t> idx = {0, 6, 3, 3, 1, 2, 5, 4, 6, 0};
  Var g = ag::gather_cols(x, idx, 2, off);
  EXPECT_FLOAT_EQ(g->value.f32()[1], x->value.f32()[6] - 1.0f);
  EXPECT_FLOAT_EQ(g->value.f32()[9], x->value.f32()[4 * 7 + 0] + 0.1f);
  EXPECT_LT(gradcheck([&](auto& v) { return ag::gather_cols(v[0], idx, 2, off); }, {x}), 2e-3);
}

TEST(AgMoe, NormalizeSum) {
  Rng rng(22);
  auto w = random_var({4, 3}, rng);
  for (int64_t i = 0; i < w->value.numel(); ++i) w->value.f32()[i] = 0.3f + std::fabs(w->value.f32()[i]);
  Var y = ag::normalize_sum_last(w, 1e-20f);
  EXPECT_NEAR(y->value.f32()[0] + y->value.f32()[1] + y->value.f32()[2], 1.0f, 1e-6);
  EXPECT_LT(gradcheck([](auto& v) { return ag::normalize_sum_last(v[0], 1e-20f); }, {w}, 1e-3f), 2e-3);
}

TEST(AgMoe, DispatchGroupsByExpertInTokenOrder) {
  // M = 3 tokens, K = 2, E = 5: experts 1 and 3 unused.
  std::vector<int64_t> idx = {4, 0, 0, 2, 2, 4};
  ag::Dispatch d = ag::make_dispatch(idx, 3, 2, 5);
  EXPECT_EQ(d.experts, (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(d.offsets, (std::vector<int64_t>{0, 2, 4, 6}));
  EXPECT_EQ(d.rows, (std::vector<int64_t>{0, 1, 1, 2, 0, 2}));
  EXPECT_EQ(d.slots, (std::vector<int64_t>{1, 2, 3, 4, 0, 5}));
  EXPECT_EQ(d.rows_of(1), (std::vector<int64_t>{1, 2}));
}

TEST(AgMoe, WeightedCombineGradients) {
  Rng rng(23);
  std::vector<int64_t> idx = {4, 0, 0, 2, 2, 4, 1, 4};  // M = 4, K = 2
  ag::Dispatch d = ag::make_dispatch(idx, 4, 2, 5);
  std::vector<Var> ys;
  for (int64_t j = 0; j < d.active(); ++j) ys.push_back(random_var({d.offsets[size_t(j) + 1] - d.offsets[size_t(j)], 3}, rng));
  auto w = random_var({4, 2}, rng);
  std::vector<Var> inputs = ys;
  inputs.push_back(w);
  auto f = [&](const std::vector<Var>& v) {
    return ag::weighted_combine(std::vector<Var>(v.begin(), v.end() - 1), d, v.back(), 4);
  };
  // Direct value: token 1 = w[1,0]·(expert 0's 2nd row) + w[1,1]·(expert 2's 1st row).
  Var y = f(inputs);
  for (int64_t c = 0; c < 3; ++c)
    EXPECT_NEAR(y->value.f32()[1 * 3 + c],
                w->value.f32()[2] * ys[0]->value.f32()[1 * 3 + c] + w->value.f32()[3] * ys[2]->value.f32()[0 * 3 + c],
                1e-6);
  EXPECT_LT(gradcheck(f, inputs), 2e-3);
}

TEST(AgMoe, SeqBalanceLossValueAndGradient) {
  Rng rng(24);
  const int64_t M = 6, E = 4, K = 2, T = 3;
  auto logits = random_var({M, E}, rng);
  std::vector<int64_t> idx = {0, 1, 0, 2, 1, 0, 3, 2, 3, 1, 2, 3};
  Var s = ag::sigmoid(logits);
  Var l = ag::seq_balance_loss(s, idx, K, T, 0.1f);
  double ref = 0;
  for (int64_t b = 0; b < M / T; ++b) {
    std::vector<double> f(E, 0.0), P(E, 0.0);
    for (int64_t t = b * T; t < (b + 1) * T; ++t) {
      for (int64_t k = 0; k < K; ++k) f[size_t(idx[size_t(t * K + k)])] += double(E) / double(K * T);
      double S = 0;
      for (int64_t e = 0; e < E; ++e) S += s->value.f32()[t * E + e];
      for (int64_t e = 0; e < E; ++e) P[size_t(e)] += s->value.f32()[t * E + e] / S / double(T);
    }
    for (int64_t e = 0; e < E; ++e) ref += 0.1 * f[size_t(e)] * P[size_t(e)] / double(M / T);
  }
  EXPECT_NEAR(l->value.f32()[0], ref, 1e-6);
  EXPECT_LT(gradcheck([&](auto& v) { return ag::seq_balance_loss(ag::sigmoid(v[0]), idx, K, T, 0.1f); }, {logits}),
            2e-3);
  EXPECT_THROW(ag::seq_balance_loss(s, idx, K, 4, 0.1f), Error);
}

}  // namespace k3
