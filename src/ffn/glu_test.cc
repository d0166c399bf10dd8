// GluMlp: HF names, values against a direct per-element computation, gradients (SiLU and SiTU).
#include "ffn/glu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "ops/gradcheck.h"

namespace k3 {

using testing::gradcheck;
using testing::random_var;

namespace {

void init_glu(const GluMlp& m, Rng& rng, float scale) {
  m.visit("", [&](const std::string&, Node& p, ParamKind) {
    p.value = Tensor::empty(p.value.shape());
    for (int64_t i = 0; i < p.value.numel(); ++i) p.value.f32()[i] = scale * rng.normal();
  });
}

std::vector<Var> glu_params(const GluMlp& m) { return {m.gate.weight, m.up.weight, m.down.weight}; }

// y = W2 act(W1 x, W3 x) for one row, directly.
std::vector<double> glu_row(const GluMlp& m, const float* x, int64_t D, int64_t H) {
  std::vector<double> a(static_cast<size_t>(H)), y(static_cast<size_t>(D), 0.0);
  for (int64_t h = 0; h < H; ++h) {
    double g = 0, u = 0;
    for (int64_t d = 0; d < D; ++d) {
      g += double(m.gate.weight->value.f32()[h * D + d]) * x[d];
      u += double(m.up.weight->value.f32()[h * D + d]) * x[d];
    }
    a[size_t(h)] = m.opts.activation == GluActivation::SiTU
                       ? double(situ_gate(float(g), m.opts.situ.beta)) * situ_up(float(u), m.opts.situ.beta_lin)
                       : g / (1 + std::exp(-g)) * u;
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t h = 0; h < H; ++h) y[size_t(d)] += double(m.down.weight->value.f32()[d * H + h]) * a[size_t(h)];
  return y;
}

}  // namespace

TEST(GluMlp, HfNames) {
  std::map<std::string, Shape> names;
  auto collect = [&](const std::string& n, Node& p, ParamKind) { names[n] = p.value.shape(); };
  GluMlp(16, 8, GluOptions{}).visit("model.layers.0.mlp", collect);
  EXPECT_EQ(names.at("model.layers.0.mlp.gate_proj.weight"), (Shape{8, 16}));
  EXPECT_EQ(names.at("model.layers.0.mlp.up_proj.weight"), (Shape{8, 16}));
  EXPECT_EQ(names.at("model.layers.0.mlp.down_proj.weight"), (Shape{16, 8}));
  names.clear();
  GluMlp(16, 8, GluOptions{GluActivation::SiLU, {}, GluNames::kimi_expert()}).visit("e.3", collect);
  EXPECT_EQ(names.at("e.3.w1.weight"), (Shape{8, 16}));
  EXPECT_EQ(names.at("e.3.w3.weight"), (Shape{8, 16}));
  EXPECT_EQ(names.at("e.3.w2.weight"), (Shape{16, 8}));
  EXPECT_EQ(names.size(), 3u);
  EXPECT_EQ(GluMlp(16, 8, GluOptions{}).active_params(), 3 * 16 * 8);
}

TEST(GluMlp, ValuesAndGradientsSiluAndSitu) {
  for (auto act : {GluActivation::SiLU, GluActivation::SiTU}) {
    Rng rng(31);
    const int64_t D = 6, H = 5, M = 4;
    GluMlp m(D, H, GluOptions{act, SituOptions{}, GluNames::hf()});
    init_glu(m, rng, act == GluActivation::SiTU ? 1.5f : 0.5f);  // SiTU: reach the soft caps
    auto x = random_var({M, D}, rng, 2.0f);
    Var y = m.forward(x);
    for (int64_t r = 0; r < M; ++r) {
      auto ref = glu_row(m, x->value.f32() + r * D, D, H);
      for (int64_t d = 0; d < D; ++d) EXPECT_NEAR(y->value.f32()[r * D + d], ref[size_t(d)], 1e-4 * (1 + std::fabs(ref[size_t(d)])));
    }
    std::vector<Var> inputs = glu_params(m);
    inputs.push_back(x);
    EXPECT_LT(gradcheck([&](auto& v) { return m.forward(v.back()); }, inputs, 1e-3f), 5e-3) << int(act);
  }
}

}  // namespace k3
