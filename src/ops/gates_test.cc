// Gate ops: the KDA gates against fla's naive_kda_gate / naive_kda_lowerbound_gate
// (fixtures/ops/kda_gate.safetensors) and every backward against central differences of an
// independent double evaluation.
#include "ops/gates.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "core/random.h"
#include "io/safetensors.h"

namespace k3 {
namespace {

double rel_l2(const float* x, const float* ref, int64_t n) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    num += (double(x[i]) - ref[i]) * (double(x[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

TEST(KdaGate, MatchesFixture) {
  SafeTensors st = SafeTensors::open(std::string(K3_SHARED_DIR) + "/fixtures/ops/kda_gate.safetensors");
  const Tensor x = st.get_f32("g_raw");  // [B, T, H, K]
  const Tensor A_log = st.get_f32("A_log");  // [H]
  const Tensor dt_bias = st.get_f32("dt_bias");  // [H·K]
  const GateShape s{x.dim(0) * x.dim(1), x.dim(2), x.dim(3)};
  Tensor g = Tensor::empty(x.shape());
  gate_softplus_forward(x.f32(), A_log.f32(), dt_bias.f32(), g.f32(), s);
  EXPECT_LE(rel_l2(g.f32(), st.get_f32("g_softplus").f32(), g.numel()), 1e-6);
  gate_lowerbound_forward(x.f32(), A_log.f32(), dt_bias.f32(), -5.0f, g.f32(), s);
  EXPECT_LE(rel_l2(g.f32(), st.get_f32("g_lowerbound").f32(), g.numel()), 1e-6);
}

// Σ dg·g(x, A_log, dt_bias) in double.
double gate_loss(const std::vector<double>& x, const std::vector<double>& A_log, const std::vector<double>& dt,
                 const std::vector<float>& dg, GateShape s, double lower_bound) {
  double L = 0.0;
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t k = 0; k < s.K; ++k) {
        const int64_t i = (r * s.H + h) * s.K + k;
        const double u = x[i] + dt[h * s.K + k], a = std::exp(A_log[h]);
        const double g = lower_bound == 0.0 ? -a * std::log1p(std::exp(u)) : lower_bound / (1.0 + std::exp(-a * u));
        L += dg[i] * g;
      }
  return L;
}

void check_gate(double lower_bound, GateShape s) {
  Rng rng(3);
  const int64_t n = s.rows * s.H * s.K;
  std::vector<float> x(n), A_log(s.H), dt(s.H * s.K), dg(n);
  for (auto& v : x) v = 3.0f * rng.normal();
  for (auto& v : A_log) v = 0.5f * rng.normal();
  for (auto& v : dt) v = rng.normal();
  for (auto& v : dg) v = rng.normal();
  std::vector<float> dx(n, 0.0f), dA(s.H, 0.0f), ddt(s.H * s.K, 0.0f);
  if (lower_bound == 0.0)
    gate_softplus_backward(x.data(), A_log.data(), dt.data(), dg.data(), dx.data(), dA.data(), ddt.data(), s);
  else
    gate_lowerbound_backward(x.data(), A_log.data(), dt.data(), float(lower_bound), dg.data(), dx.data(), dA.data(),
                             ddt.data(), s);
  std::vector<double> xd(x.begin(), x.end()), Ad(A_log.begin(), A_log.end()), dd(dt.begin(), dt.end());
  auto fd_check = [&](std::vector<double>& p, const std::vector<float>& analytic, const char* name) {
    std::vector<float> fd(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      const double keep = p[i];
      p[i] = keep + 1e-6;
      const double up = gate_loss(xd, Ad, dd, dg, s, lower_bound);
      p[i] = keep - 1e-6;
      const double down = gate_loss(xd, Ad, dd, dg, s, lower_bound);
      p[i] = keep;
      fd[i] = float((up - down) / 2e-6);
    }
    EXPECT_LE(rel_l2(analytic.data(), fd.data(), int64_t(fd.size())), 1e-4) << name << " lb=" << lower_bound;
  };
  fd_check(xd, dx, "dx");
  fd_check(Ad, dA, "dA_log");
  fd_check(dd, ddt, "ddt_bias");
}

TEST(KdaGate, SoftplusBackwardMatchesFiniteDifferences) { check_gate(0.0, {5, 2, 3}); }
TEST(KdaGate, LowerBoundBackwardMatchesFiniteDifferences) { check_gate(-5.0, {5, 2, 3}); }
TEST(GdnGate, BackwardMatchesFiniteDifferences) { check_gate(0.0, {7, 3, 1}); }  // one channel per head

TEST(BetaSigmoid, BackwardMatchesFiniteDifferences) {
  const std::vector<float> x = {-30.0f, -2.0f, -0.1f, 0.0f, 0.7f, 4.0f, 30.0f};
  std::vector<float> y(x.size()), dy(x.size(), 1.0f), dx(x.size(), 0.0f);
  beta_sigmoid_forward(x.data(), y.data(), int64_t(x.size()));
  beta_sigmoid_backward(y.data(), dy.data(), dx.data(), int64_t(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    auto f = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
    EXPECT_NEAR(y[i], f(x[i]), 1e-7);
    EXPECT_NEAR(dx[i], (f(x[i] + 1e-6) - f(x[i] - 1e-6)) / 2e-6, 1e-6);
  }
}

}  // namespace
}  // namespace k3
