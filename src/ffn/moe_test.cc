// MoE (spec §8): routing against a direct reimplementation (grouped top-k with bias, unbiased
// and biased combine weights, renormalisation, scaling, ties), outputs against a per-token loop,
// finite-difference gradients with fixed routing (plain and latent), compute proportional to
// top-k, the auxiliary-loss-free bias update and the balance loss.
#include "ffn/moe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>

#include "ops/gradcheck.h"

namespace k3 {

using testing::gradcheck;
using testing::random_var;

namespace {

void init_moe(const MoE& m, Rng& rng, float scale) {
  m.visit("", [&](const std::string& name, Node& p, ParamKind) {
    p.value = Tensor::empty(p.value.shape());
    const bool norm = name.find("norm") != std::string::npos;
    for (int64_t i = 0; i < p.value.numel(); ++i) p.value.f32()[i] = norm ? 1.0f + 0.2f * rng.normal() : scale * rng.normal();
  });
}

MoeOptions small_options() {
  MoeOptions o;
  o.d_model = 8;
  o.n_experts = 8;
  o.top_k = 2;
  o.expert_hidden = 4;
  o.n_shared = 1;
  o.n_group = 4;
  o.topk_group = 2;
  o.routed_scaling = 2.5f;
  return o;
}

struct RefRouting {
  std::vector<std::vector<int64_t>> idx;  // per token, selection order
  std::vector<std::vector<double>> w;
};

// Direct reimplementation of spec §8.1 in double, one token at a time, with stable sorts for ties.
RefRouting reference_routing(const MoE& m, const Tensor& x) {
  const auto& o = m.opts;
  const int64_t M = x.dim(0), D = o.d_model, E = o.n_experts, G = o.n_group, gs = E / G;
  RefRouting r;
  for (int64_t t = 0; t < M; ++t) {
    std::vector<double> logit(static_cast<size_t>(E), 0.0), s(static_cast<size_t>(E)), c(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      for (int64_t d = 0; d < D; ++d) logit[size_t(e)] += double(m.router.weight->value.f32()[e * D + d]) * x.f32()[t * D + d];
    if (o.score == ScoreFunction::Sigmoid) {
      for (int64_t e = 0; e < E; ++e) s[size_t(e)] = 1.0 / (1.0 + std::exp(-logit[size_t(e)]));
    } else {
      double mx = *std::max_element(logit.begin(), logit.end()), z = 0;
      for (int64_t e = 0; e < E; ++e) z += std::exp(logit[size_t(e)] - mx);
      for (int64_t e = 0; e < E; ++e) s[size_t(e)] = std::exp(logit[size_t(e)] - mx) / z;
    }
    // The op computes s in fp32: round here too so that exact ties stay ties.
    for (auto& v : s) v = double(float(v));
    for (int64_t e = 0; e < E; ++e) c[size_t(e)] = double(float(s[size_t(e)] + (m.router_bias ? m.router_bias->value.f32()[e] : 0.0f)));
    std::vector<bool> keep(static_cast<size_t>(E), true);
    if (G > 1) {
      std::vector<std::pair<double, int64_t>> gsc;
      for (int64_t g = 0; g < G; ++g) {
        std::vector<double> v(c.begin() + g * gs, c.begin() + (g + 1) * gs);
        std::sort(v.rbegin(), v.rend());
        gsc.push_back({-(v[0] + (gs > 1 ? v[1] : 0.0)), g});
      }
      std::stable_sort(gsc.begin(), gsc.end(), [](auto& a, auto& b) { return a.first < b.first; });
      std::fill(keep.begin(), keep.end(), false);
      for (int64_t i = 0; i < o.topk_group; ++i)
        for (int64_t e = gsc[size_t(i)].second * gs; e < (gsc[size_t(i)].second + 1) * gs; ++e) keep[size_t(e)] = true;
    }
    std::vector<int64_t> order;
    for (int64_t e = 0; e < E; ++e)
      if (keep[size_t(e)]) order.push_back(e);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return c[size_t(a)] > c[size_t(b)]; });
    order.resize(static_cast<size_t>(o.top_k));
    std::vector<double> w;
    for (int64_t e : order) w.push_back(o.combine == CombineWeights::Biased ? c[size_t(e)] : s[size_t(e)]);
    if (o.renormalize == Renormalize::Yes) {
      const double sum = std::accumulate(w.begin(), w.end(), 0.0) + 1e-20;
      for (auto& v : w) v /= sum;
    }
    for (auto& v : w) v *= o.routed_scaling;
    r.idx.push_back(order);
    r.w.push_back(w);
  }
  return r;
}

void expect_routing_matches(const MoE& m, const Var& x) {
  m.forward(x);
  const Routing& got = m.last_routing();
  RefRouting ref = reference_routing(m, x->value);
  const int64_t K = m.opts.top_k;
  for (int64_t t = 0; t < x->value.dim(0); ++t)
    for (int64_t k = 0; k < K; ++k) {
      EXPECT_EQ(got.indices[size_t(t * K + k)], ref.idx[size_t(t)][size_t(k)]) << "token " << t;
      EXPECT_NEAR(got.weights[size_t(t * K + k)], ref.w[size_t(t)][size_t(k)], 2e-6 * (1 + std::fabs(ref.w[size_t(t)][size_t(k)])))
          << "token " << t;
    }
}

// Adds exact ties: experts 2 and 3 (and 6, 7) share router rows and biases, one token is zero
// (all scores 0.5), and two tokens are identical.
void add_ties(const MoE& m, const Var& x) {
  const int64_t D = m.opts.d_model;
  float* w = m.router.weight->value.f32();
  std::copy(w + 2 * D, w + 3 * D, w + 3 * D);
  std::copy(w + 6 * D, w + 7 * D, w + 7 * D);
  if (m.router_bias) {
    float* b = m.router_bias->value.f32();
    b[3] = b[2];
    b[7] = b[6];
    b[0] = b[1];
  }
  std::fill(x->value.f32(), x->value.f32() + D, 0.0f);
  std::copy(x->value.f32() + 2 * D, x->value.f32() + 3 * D, x->value.f32() + 3 * D);
}

}  // namespace

TEST(MoE, RoutingMatchesReferenceGroupedSigmoidWithBias) {
  for (auto combine : {CombineWeights::Unbiased, CombineWeights::Biased}) {
    Rng rng(41);
    MoeOptions o = small_options();
    o.combine = combine;
    MoE m(o);
    init_moe(m, rng, 0.7f);
    for (int64_t e = 0; e < o.n_experts; ++e) m.router_bias->value.f32()[e] = 0.3f * rng.normal();  // visible bias
    auto x = random_var({24, o.d_model}, rng, 1.0f, false);
    expect_routing_matches(m, x);
    add_ties(m, x);
    expect_routing_matches(m, x);
  }
}

TEST(MoE, RoutingVariants) {
  Rng rng(42);
  {  // one group (Kimi), no renormalisation, no scaling
    MoeOptions o = small_options();
    o.n_group = 1;
    o.topk_group = 1;
    o.renormalize = Renormalize::No;
    o.routed_scaling = 1.0f;
    o.top_k = 3;
    MoE m(o);
    init_moe(m, rng, 0.7f);
    auto x = random_var({17, o.d_model}, rng, 1.0f, false);
    expect_routing_matches(m, x);
  }
  {  // softmax scores without a bias
    MoeOptions o = small_options();
    o.score = ScoreFunction::Softmax;
    o.bias = SelectionBias::None;
    o.renormalize = Renormalize::No;
    MoE m(o);
    init_moe(m, rng, 0.7f);
    auto x = random_var({17, o.d_model}, rng, 1.0f, false);
    add_ties(m, x);
    expect_routing_matches(m, x);
  }
}

TEST(MoE, BiasSelectsButUnbiasedScoresWeigh) {
  Rng rng(43);
  MoeOptions o = small_options();
  o.n_group = 1;
  o.topk_group = 1;
  o.renormalize = Renormalize::No;
  o.routed_scaling = 1.0f;
  MoE m(o);
  init_moe(m, rng, 0.5f);
  std::fill(m.router_bias->value.f32(), m.router_bias->value.f32() + 8, 0.0f);
  m.router_bias->value.f32()[5] = m.router_bias->value.f32()[6] = 10.0f;  // forces experts 5 and 6
  auto x = random_var({5, o.d_model}, rng, 1.0f, false);
  m.forward(x);
  for (int64_t t = 0; t < 5; ++t) {
    EXPECT_EQ(m.last_routing().indices[size_t(2 * t)], m.router_bias ? m.last_routing().indices[size_t(2 * t)] : -1);
    for (int64_t k = 0; k < 2; ++k) {
      const int64_t e = m.last_routing().indices[size_t(2 * t + k)];
      EXPECT_TRUE(e == 5 || e == 6);
      EXPECT_LT(m.last_routing().weights[size_t(2 * t + k)], 1.0f);  // a sigmoid score, no +10
    }
  }
}

TEST(MoE, OutputMatchesPerTokenLoopPlainAndLatent) {
  for (int64_t latent : {int64_t{0}, int64_t{5}}) {
    Rng rng(44);
    MoeOptions o = small_options();
    o.latent_dim = latent;
    o.latent_norm = latent ? LatentNorm::RMSNorm : LatentNorm::None;
    o.activation = latent ? GluActivation::SiTU : GluActivation::SiLU;
    MoE m(o);
    init_moe(m, rng, 0.6f);
    const int64_t M = 9, D = o.d_model;
    auto x = random_var({M, D}, rng, 1.0f, false);
    Var y = m.forward(x);
    const Routing& r = m.last_routing();
    for (int64_t t = 0; t < M; ++t) {
      Var xt = constant(Tensor::from_vector(std::vector<float>(x->value.f32() + t * D, x->value.f32() + (t + 1) * D), {1, D}));
      Var xl = latent ? m.latent_down(xt) : xt;
      Tensor acc = Tensor::zeros({1, latent ? latent : D});
      for (int64_t k = 0; k < o.top_k; ++k) {
        Var ye = m.experts[size_t(r.indices[size_t(t * o.top_k + k)])].forward(xl);
        for (int64_t c = 0; c < acc.numel(); ++c) acc.f32()[c] += r.weights[size_t(t * o.top_k + k)] * ye->value.f32()[c];
      }
      Var rt = constant(acc);
      if (latent) rt = m.latent_up((*m.latent_norm)(rt));
      Var ref = ag::add(rt, m.shared->forward(xt));
      for (int64_t c = 0; c < D; ++c) EXPECT_NEAR(y->value.f32()[t * D + c], ref->value.f32()[c], 1e-5) << t << "," << c;
    }
  }
}

TEST(MoE, GradientsWithFixedRouting) {
  for (int64_t latent : {int64_t{0}, int64_t{5}}) {
    Rng rng(45);
    MoeOptions o = small_options();
    o.latent_dim = latent;
    o.latent_norm = latent ? LatentNorm::RMSNorm : LatentNorm::None;
    o.activation = latent ? GluActivation::SiTU : GluActivation::SiLU;
    MoE m(o);
    init_moe(m, rng, 0.5f);
    const int64_t M = 6;
    auto x = random_var({M, o.d_model}, rng);
    m.forward(x);
    m.set_fixed_routing(m.last_routing().indices);  // selection frozen: finite differences stay smooth
    std::vector<Var> inputs = {x, m.router.weight};
    const int64_t e0 = m.last_routing().indices[0];
    for (const auto& v : {m.experts[size_t(e0)].gate.weight, m.experts[size_t(e0)].up.weight, m.experts[size_t(e0)].down.weight,
                          m.shared->gate.weight, m.shared->down.weight})
      inputs.push_back(v);
    if (latent) {
      inputs.push_back(m.latent_down.weight);
      inputs.push_back(m.latent_up.weight);
      inputs.push_back(m.latent_norm->weight);
    }
    EXPECT_LT(gradcheck([&](auto& v) { return m.forward(v[0]); }, inputs, 1e-3f), 5e-3) << "latent " << latent;
    // The balance loss reaches the router through the scores.
    EXPECT_LT(gradcheck([&](auto& v) { m.forward(v[0]); return m.balance_loss(3, 0.01f); }, {x, m.router.weight}, 1e-3f),
              5e-3);
    m.clear_fixed_routing();
  }
}

TEST(MoE, ComputeIsProportionalToTopK) {
  Rng rng(46);
  MoeOptions o = small_options();
  o.n_experts = 16;
  o.n_group = 1;
  o.topk_group = 1;
  MoE m(o);
  init_moe(m, rng, 0.5f);
  const int64_t M = 40;
  auto x = random_var({M, o.d_model}, rng, 1.0f, false);
  m.forward(x);
  EXPECT_EQ(m.rows_processed(), m.last_routing().load);
  EXPECT_EQ(std::accumulate(m.rows_processed().begin(), m.rows_processed().end(), int64_t{0}), M * o.top_k);
  // Forcing every token onto experts 3 and 9: the other 14 experts do no work at all.
  std::vector<int64_t> fixed;
  for (int64_t t = 0; t < M; ++t) fixed.insert(fixed.end(), {9, 3});
  m.set_fixed_routing(fixed);
  m.forward(x);
  for (int64_t e = 0; e < 16; ++e) EXPECT_EQ(m.rows_processed()[size_t(e)], (e == 3 || e == 9) ? M : 0) << e;
}

TEST(MoE, BiasUpdateMovesLoadTowardBalance) {
  Rng rng(47);
  MoeOptions o = small_options();
  o.n_group = 1;
  o.topk_group = 1;
  MoE m(o);
  init_moe(m, rng, 0.3f);
  std::fill(m.router_bias->value.f32(), m.router_bias->value.f32() + 8, 0.0f);
  // Skew: experts 0 and 1 align with a shared positive direction of every token.
  for (int64_t d = 0; d < o.d_model; ++d) m.router.weight->value.f32()[0 * o.d_model + d] += 1.0f,
                                          m.router.weight->value.f32()[1 * o.d_model + d] += 1.0f;
  auto x = random_var({64, o.d_model}, rng, 0.5f, false);
  for (int64_t i = 0; i < x->value.numel(); ++i) x->value.f32()[i] += 1.0f;
  auto imbalance = [&] {
    const auto& load = m.last_routing().load;
    return double(*std::max_element(load.begin(), load.end())) / (64.0 * 2 / 8);
  };
  m.forward(x);
  const double before = imbalance();
  EXPECT_GT(before, 3.0);
  for (int step = 0; step < 300; ++step) {
    Recording rec;  // training forwards accumulate the load
    m.forward(x);
    m.apply_bias_update(5e-3f);
  }
  EXPECT_EQ(std::accumulate(m.accumulated_load().begin(), m.accumulated_load().end(), int64_t{0}), 0);
  m.forward(x);
  EXPECT_LT(imbalance(), 0.6 * before) << "before " << before << " after " << imbalance();
  EXPECT_LT(m.router_bias->value.f32()[0], 0.0f);  // overloaded expert pushed down
}

TEST(MoE, HfNamesAndParamCounts) {
  auto names_of = [](const MoE& m, const std::string& prefix) {
    std::map<std::string, Shape> n;
    m.visit(prefix, [&](const std::string& name, Node& p, ParamKind) { n[name] = p.value.shape(); });
    return n;
  };
  MoeOptions o = small_options();
  auto ds = names_of(MoE(o), "model.layers.1.mlp");
  EXPECT_EQ(ds.at("model.layers.1.mlp.gate.weight"), (Shape{8, 8}));
  EXPECT_EQ(ds.at("model.layers.1.mlp.gate.e_score_correction_bias"), (Shape{8}));
  EXPECT_EQ(ds.at("model.layers.1.mlp.experts.7.gate_proj.weight"), (Shape{4, 8}));
  EXPECT_EQ(ds.at("model.layers.1.mlp.shared_experts.down_proj.weight"), (Shape{8, 4}));
  EXPECT_EQ(ds.size(), 2u + 8 * 3 + 3);
  o.names = MoeNames::kimi();
  o.latent_dim = 5;
  o.latent_norm = LatentNorm::RMSNorm;
  o.n_shared = 2;
  MoE k3m(o);
  auto k = names_of(k3m, "p");
  EXPECT_EQ(k.at("p.experts.0.w1.weight"), (Shape{4, 5}));
  EXPECT_EQ(k.at("p.experts.0.w2.weight"), (Shape{5, 4}));
  EXPECT_EQ(k.at("p.experts.0.w3.weight"), (Shape{4, 5}));
  EXPECT_EQ(k.at("p.shared_experts.gate_proj.weight"), (Shape{8, 8}));
  EXPECT_EQ(k.at("p.routed_expert_down_proj.weight"), (Shape{5, 8}));
  EXPECT_EQ(k.at("p.routed_expert_up_proj.weight"), (Shape{8, 5}));
  EXPECT_EQ(k.at("p.routed_expert_norm.weight"), (Shape{5}));
  EXPECT_EQ(k3m.active_params(), 8 * 8 + 8 + 2 * 3 * 5 * 4 + 3 * 8 * 8 + 2 * 5 * 8 + 5);
  EXPECT_EQ(k3m.total_params(), k3m.active_params() + 6 * 3 * 5 * 4);
  EXPECT_FALSE(k3m.router_bias->requires_grad);
}

TEST(MoE, RejectsBadOptionsAndInputs) {
  MoeOptions o = small_options();
  o.top_k = 5;  // only 2 groups × 2 experts survive the group limit
  EXPECT_THROW(MoE{o}, Error);
  o = small_options();
  o.n_group = 3;
  EXPECT_THROW(MoE{o}, Error);
  MoE m(small_options());
  Rng rng(48);
  init_moe(m, rng, 0.5f);
  EXPECT_THROW(m.forward(random_var({3, 7}, rng)), Error);
  m.set_fixed_routing({1, 2, 3});
  EXPECT_THROW(m.forward(random_var({3, 8}, rng)), Error);
}

}  // namespace k3

namespace k3 {
namespace {

// Which batches run every expert on every row on CUDA (MoE::runs_dense): the extra weights read
// (experts no row can have picked) against MoE::kDenseExtraBytes, and M · E against kDenseRows.
TEST(MoE, DenseDecodeOnlyWhereTheExtraWeightsAreFew) {
  MoeOptions small;  // k3-small's MoE: 16 experts of 3 · 384 · 256 fp32 weights (1.1 MiB each)
  small.d_model = 384, small.n_experts = 16, small.top_k = 2, small.expert_hidden = 256;
  const MoE s(small);
  EXPECT_TRUE(s.runs_dense(1));    // 14 unpicked experts: 16 MiB
  EXPECT_TRUE(s.runs_dense(256));  // 4096 rows
  EXPECT_FALSE(s.runs_dense(257));
  MoeOptions big = small;  // 896 experts of 3 · 7168 · 2048 fp32 weights (168 MiB each)
  big.d_model = 7168, big.n_experts = 896, big.top_k = 8, big.expert_hidden = 2048;
  const MoE b(big);
  EXPECT_FALSE(b.runs_dense(1));
  EXPECT_FALSE(b.runs_dense(4));
}

}  // namespace
}  // namespace k3
