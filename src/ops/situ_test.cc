// SiTU (spec §9): closed-form values, limits, derivatives and the fused op's gradients.
#include "ops/situ.h"

#include <gtest/gtest.h>

#include <cmath>

#include "ops/gradcheck.h"

namespace k3 {

using testing::gradcheck;
using testing::random_var;

namespace {
double silu_d(double x) { return x / (1.0 + std::exp(-x)); }
}  // namespace

TEST(Situ, ClosedFormValues) {
  for (float g : {-6.0f, -1.0f, -0.1f, 0.0f, 0.3f, 2.0f, 9.0f}) {
    const double ref = 4.0 * std::tanh(double(g) / 4.0) / (1.0 + std::exp(-double(g)));
    EXPECT_NEAR(situ_gate(g, 4.0f), ref, 1e-6) << g;
    EXPECT_NEAR(situ_gate(g, std::nullopt), silu_d(g), 1e-6) << g;
  }
  for (float u : {-100.0f, -3.0f, 0.5f, 40.0f}) {
    EXPECT_NEAR(situ_up(u, 25.0f), 25.0 * std::tanh(double(u) / 25.0), 1e-5) << u;
    EXPECT_EQ(situ_up(u, std::nullopt), u);
  }
}

TEST(Situ, MinimumAndSaturation) {
  // Spec §9: the minimum is about −0.270 at gate ≈ −1.22; the supremum is β = 4.
  float best = 1e9f, at = 0;
  for (int i = 0; i <= 40000; ++i) {
    const float g = -4.0f + 1e-4f * float(i);
    const float v = situ_gate(g, 4.0f);
    if (v < best) best = v, at = g;
  }
  EXPECT_NEAR(best, -0.2698, 5e-4);
  EXPECT_NEAR(at, -1.219, 5e-3);
  EXPECT_NEAR(situ_gate(60.0f, 4.0f), 4.0f, 1e-5);
  EXPECT_LT(situ_gate(1e3f, 4.0f), 4.0f + 1e-6f);
  EXPECT_NEAR(situ_gate(-60.0f, 4.0f), 0.0f, 1e-6);
  EXPECT_NEAR(situ_up(1e4f, 25.0f), 25.0f, 1e-5);
  EXPECT_NEAR(situ_up(-1e4f, 25.0f), -25.0f, 1e-5);
  // Small gates: the capped SiLU is SiLU to second order.
  EXPECT_NEAR(situ_gate(0.05f, 4.0f), silu_d(0.05), 1e-5);
}

TEST(Situ, ScalarDerivatives) {
  for (auto beta : {std::optional<float>(4.0f), std::optional<float>()}) {
    for (float g : {-5.0f, -1.22f, -0.2f, 0.0f, 0.7f, 3.0f}) {
      const double h = 1e-3;
      const double fd = (double(situ_gate(float(g + h), beta)) - situ_gate(float(g - h), beta)) / (2 * h);
      EXPECT_NEAR(situ_gate_grad(g, beta), fd, 2e-3) << g;
    }
  }
  for (float u : {-60.0f, -2.0f, 0.0f, 13.0f}) {
    const double h = 1e-2;
    const double fd = (double(situ_up(float(u + h), 25.0f)) - situ_up(float(u - h), 25.0f)) / (2 * h);
    EXPECT_NEAR(situ_up_grad(u, 25.0f), fd, 2e-3) << u;
  }
}

TEST(Situ, FusedOpValuesAndGradients) {
  Rng rng(11);
  // Gates around the soft cap and ups around the linear cap, so both tanh regions matter.
  auto g = random_var({6, 9}, rng, 3.0f), u = random_var({6, 9}, rng, 20.0f);
  Var y = ag::situ_glu(g, u, SituOptions{});
  for (int64_t i = 0; i < y->value.numel(); ++i) {
    const double gd = g->value.f32()[i], ud = u->value.f32()[i];
    const double want = 4.0 * std::tanh(gd / 4.0) / (1.0 + std::exp(-gd)) * 25.0 * std::tanh(ud / 25.0);
    EXPECT_NEAR(y->value.f32()[i], want, 2e-6 * std::fabs(want) + 1e-30) << i;
  }
  Var z = ag::silu_glu(g, u);
  for (int64_t i = 0; i < z->value.numel(); ++i)
    EXPECT_NEAR(z->value.f32()[i], silu_d(g->value.f32()[i]) * u->value.f32()[i], 1e-4);

  EXPECT_LT(gradcheck([](auto& v) { return ag::situ_glu(v[0], v[1], SituOptions{}); }, {g, u}), 2e-3);
  EXPECT_LT(gradcheck([](auto& v) { return ag::silu_glu(v[0], v[1]); }, {g, u}), 2e-3);
  EXPECT_LT(gradcheck([](auto& v) { return ag::situ_glu(v[0], v[1], SituOptions{4.0f, std::nullopt}); }, {g, u}),
            2e-3);
  EXPECT_LT(gradcheck([](auto& v) { return ag::situ_glu(v[0], v[1], SituOptions{std::nullopt, 25.0f}); }, {g, u}),
            2e-3);
  // One input without a gradient (its gradient goes nowhere; the other's must be unchanged).
  Var uc = constant(u->value), gc = constant(g->value);
  EXPECT_LT(gradcheck([&](auto& v) { return ag::situ_glu(v[0], uc, SituOptions{}); }, {g}), 2e-3);
  EXPECT_LT(gradcheck([&](auto& v) { return ag::situ_glu(gc, v[0], SituOptions{}); }, {u}), 2e-3);
  EXPECT_THROW(ag::situ_glu(g, u, SituOptions{0.0f, 25.0f}), Error);
  EXPECT_THROW(ag::situ_glu(g, u, SituOptions{4.0f, -1.0f}), Error);
  auto bad = random_var({6, 8}, rng);
  EXPECT_THROW(ag::situ_glu(g, bad, SituOptions{}), Error);
}

}  // namespace k3
