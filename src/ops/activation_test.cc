// The activation array kernels (fastmath's exp/tanh/σ, one form per ISA level, split over the
// thread pool) against their closed forms in double: values and derivatives, over inputs that
// cross every region of the approximations (the small-|x| tanh series, the exponential form,
// saturation), at lengths that leave vector tails and span several parallel chunks.
#include "ops/activation.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "core/random.h"

namespace k3 {

namespace {

// Inputs spread over [-span, span], denser near 0, plus the region edges; length not a multiple
// of any vector width and larger than one parallel chunk (2^14).
std::vector<float> inputs(float span) {
  std::vector<float> x;
  for (float v : {0.0f, 0.29f, 0.3f, 0.31f, 1e-5f, 9.0f, 30.0f, span})
    for (float s : {1.0f, -1.0f}) x.push_back(s * v);
  Rng rng(5);
  while (x.size() < 40003) {
    const float u = 2.0f * rng.uniform() - 1.0f;
    x.push_back(span * u * u * u);
  }
  return x;
}

// |got − want| ≤ abs + rel·|want| everywhere; reports the worst element.
void expect_close(const std::vector<float>& x, const std::vector<float>& got, const std::function<double(double)>& want,
                  double abs, double rel, const char* what) {
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double w = want(double(x[i]));
    const double excess = std::fabs(double(got[i]) - w) / (abs + rel * std::fabs(w));
    if (!(excess <= worst)) worst = excess, at = i;
  }
  EXPECT_LE(worst, 1.0) << what << ": worst at x = " << x[at] << ", got " << got[at] << ", want " << want(x[at]);
}

double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Backward kernels accumulate: start from a known gradient and check the increment.
std::vector<float> grad_of(void (*backward)(const float*, const float*, float*, int64_t), const std::vector<float>& x) {
  std::vector<float> dy(x.size(), 1.0f), dx(x.size(), 1.0f / 64);
  backward(x.data(), dy.data(), dx.data(), int64_t(x.size()));
  for (float& v : dx) v -= 1.0f / 64;  // small, so that the subtraction loses almost nothing
  return dx;
}

}  // namespace

TEST(Activation, SigmoidAndSilu) {
  const std::vector<float> x = inputs(60.0f);
  std::vector<float> y(x.size());
  sigmoid_forward(x.data(), y.data(), int64_t(x.size()));
  expect_close(x, y, sig, 1e-30, 1e-6, "sigmoid");
  expect_close(x, grad_of(sigmoid_backward, x), [](double v) { return sig(v) * (1 - sig(v)); }, 2e-7, 1e-5,
               "sigmoid'");
  silu_forward(x.data(), y.data(), int64_t(x.size()));
  expect_close(x, y, [](double v) { return v * sig(v); }, 1e-30, 1e-6, "silu");
  expect_close(x, grad_of(silu_backward, x), [](double v) { return sig(v) * (1 + v * (1 - sig(v))); }, 2e-7, 1e-5,
               "silu'");
}

TEST(Activation, GeluTanh) {
  const std::vector<float> x = inputs(12.0f);
  auto u = [](double v) { return std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v); };
  std::vector<float> y(x.size());
  gelu_tanh_forward(x.data(), y.data(), int64_t(x.size()));
  // 1 + tanh(u) cancels for negative x in fp32 whatever the tanh: an absolute tolerance there.
  expect_close(x, y, [&](double v) { return 0.5 * v * (1 + std::tanh(u(v))); }, 1e-6, 1e-6, "gelu");
  expect_close(x, grad_of(gelu_tanh_backward, x), [&](double v) {
    const double t = std::tanh(u(v));
    return 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * std::sqrt(2.0 / M_PI) * (1 + 3 * 0.044715 * v * v);
  }, 2e-6, 1e-5, "gelu'");
}

TEST(Activation, SituGluAllCapCombinations) {
  const std::vector<float> g = inputs(40.0f);
  std::vector<float> u = inputs(200.0f);
  std::reverse(u.begin(), u.end());  // pair large gates with small ups and back
  const int64_t n = int64_t(g.size());
  for (const auto& [beta, beta_lin] : {std::pair{4.0f, 25.0f}, std::pair{4.0f, 0.0f}, std::pair{0.0f, 25.0f},
                                        std::pair{0.0f, 0.0f}}) {
    auto gate = [b = double(beta)](double v) { return b > 0 ? b * std::tanh(v / b) * sig(v) : v * sig(v); };
    auto dgate = [b = double(beta)](double v) {
      const double s = sig(v);
      if (!(b > 0)) return s * (1 + v * (1 - s));
      const double t = std::tanh(v / b);
      return (1 - t * t) * s + b * t * s * (1 - s);
    };
    auto up = [bl = double(beta_lin)](double v) { return bl > 0 ? bl * std::tanh(v / bl) : v; };
    auto dup = [bl = double(beta_lin)](double v) { return bl > 0 ? 1 - std::tanh(v / bl) * std::tanh(v / bl) : 1.0; };
    std::vector<float> y(g.size()), dy(g.size()), dg(g.size(), 0.25f), du(g.size(), -0.25f);
    Rng rng(6);
    for (float& v : dy) v = 2.0f * rng.uniform() - 1.0f;
    situ_glu_forward(g.data(), u.data(), y.data(), n, beta, beta_lin);
    situ_glu_backward(g.data(), u.data(), dy.data(), dg.data(), du.data(), n, beta, beta_lin);
    double worst_y = 0, worst_dg = 0, worst_du = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      const double G = g[i], U = u[i], DY = dy[i];
      const double want_y = gate(G) * up(U), want_dg = 0.25 + DY * dgate(G) * up(U),
                   want_du = -0.25 + DY * gate(G) * dup(U);
      // Scaled by the factors' sizes: the products inherit each factor's relative error.
      worst_y = std::max(worst_y, std::fabs(y[i] - want_y) / (1e-30 + 2e-6 * std::fabs(want_y)));
      worst_dg = std::max(worst_dg, std::fabs(dg[i] - want_dg) / (1e-6 + 1e-5 * std::fabs(DY * up(U))));
      worst_du = std::max(worst_du, std::fabs(du[i] - want_du) / (1e-6 + 1e-5 * std::fabs(DY * gate(G))));
    }
    EXPECT_LE(worst_y, 1.0) << "beta " << beta << " beta_lin " << beta_lin;
    EXPECT_LE(worst_dg, 1.0) << "beta " << beta << " beta_lin " << beta_lin;
    EXPECT_LE(worst_du, 1.0) << "beta " << beta << " beta_lin " << beta_lin;
  }
}

}  // namespace k3
