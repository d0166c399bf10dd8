// The delta-rule family layer (delta_layer.h) and its ops (ag_delta.h, ops/ag_conv.h,
// ops/ag_norms.h): finite-difference gradients of every op and of every layer kind's parameters
// and input; decode (memories, token by token and in pieces) equals the full forward; the
// Kimi checkpoints load by name; the KDA layers match an independent PyTorch reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "io/safetensors.h"
#include "mixers/linear/delta_layer.h"
#include "mixers/linear/delta_test_util.h"
#include "ops/ag_conv.h"
#include "ops/gradcheck.h"

namespace k3 {
namespace {

using linear::testing::rel_l2;

void init(const Mixer& m, uint64_t seed, float scale = 0.3f) {
  Rng rng(seed);
  m.visit("", [&](const std::string& name, Node& p, ParamKind k) {
    p.value = Tensor::empty(p.value.shape());
    float* d = p.value.f32();
    for (int64_t i = 0; i < p.value.numel(); ++i) {
      if (name == "A_log")
        d[i] = std::log(1.0f + 3.0f * rng.uniform());
      else if (name == "dt_bias")
        d[i] = 0.5f * rng.normal();
      else if (k == ParamKind::Norm)
        d[i] = 1.0f + 0.1f * rng.normal();
      else
        d[i] = scale * rng.normal();
    }
  });
}

// Tiny configurations of every kind: D 12, H 2, K 4, V 3 (HV 4 for GDN), conv 4.
std::map<std::string, DeltaLayerOptions> configs() {
  std::map<std::string, DeltaLayerOptions> c;
  const int64_t D = 12;
  auto la = DeltaLayerOptions::fla_linear_attention(D, 2, 4, 3);
  c["la_elu"] = la;
  la.normalize = true;
  la.output_norm = false;
  c["la_normalized"] = la;
  c["deltanet"] = DeltaLayerOptions::fla_delta_net(D, 2, 4);
  auto dn = DeltaLayerOptions::fla_delta_net(D, 2, 4, true);
  dn.head_v_dim = 3;
  c["deltanet_gated"] = dn;
  c["gdn_gva"] = DeltaLayerOptions::fla_gated_delta_net(D, 2, 4, 4, 3);
  auto kl = DeltaLayerOptions::kimi_linear_kda(D, 2, 4, 1e-5f);
  c["kda_kimi_linear"] = kl;
  c["kda_k3"] = DeltaLayerOptions::kimi_k3_kda(D, 2, 4, 1e-5f);
  auto kf = DeltaLayerOptions::kimi_linear_kda(D, 2, 4, 1e-5f);
  kf.naming = DeltaNaming::Fla;
  kf.a_log_shape = {};
  kf.value_heads = 4;
  kf.head_v_dim = 3;
  c["kda_fla_gva"] = kf;
  return c;
}

Var fresh(const Tensor& t) { return constant(t.clone()); }

// ---- ops --------------------------------------------------------------------------------------

TEST(DeltaOps, ShortConvGradients) {
  Rng rng(1);
  Var x = testing::random_var({2 * 6, 5}, rng);
  Var w = testing::random_var({5, 1, 4}, rng);
  EXPECT_LT(testing::gradcheck([](const std::vector<Var>& in) { return ag::short_conv(in[0], in[1], 2, 6); }, {x, w}), 1e-3);
}

TEST(DeltaOps, ShortConvTailContinuesTheSequence) {
  Rng rng(2);
  const int64_t T = 9, C = 3, W = 4;
  Tensor x = linear::testing::randn(rng, {T, C}), w = linear::testing::randn(rng, {C, 1, W});
  Tensor full = Tensor::empty({T, C}), part = Tensor::empty({T, C});
  short_conv_forward(x.f32(), w.f32(), nullptr, T, C, W, full.f32());
  std::vector<float> tail(static_cast<size_t>((W - 1) * C), 0.0f);
  for (int64_t t0 : {0, 2, 3, 8}) {  // pieces [0,2) [2,3) [3,8) [8,9)
    const int64_t t1 = t0 == 0 ? 2 : t0 == 2 ? 3 : t0 == 3 ? 8 : 9;
    short_conv_forward(x.f32() + t0 * C, w.f32(), tail.data(), t1 - t0, C, W, part.f32() + t0 * C);
    short_conv_update_tail(x.f32() + t0 * C, t1 - t0, C, W, tail.data());
  }
  EXPECT_LT(rel_l2(part, full), 1e-6);
}

TEST(DeltaOps, NormGradients) {
  Rng rng(3);
  Var x = testing::random_var({5, 8}, rng), gate = testing::random_var({5, 8}, rng), w = testing::random_var({4}, rng);
  EXPECT_LT(testing::gradcheck([](const std::vector<Var>& in) { return ag::l2norm(in[0], 4); }, {x}), 1e-3);
  for (auto act : {ag::NormGate::Sigmoid, ag::NormGate::Swish}) {
    EXPECT_LT(testing::gradcheck([act](const std::vector<Var>& in) { return ag::gated_rmsnorm(in[0], in[1], in[2], 4, 1e-5f, act); },
                                 {x, gate, w}),
              2e-3);
  }
  EXPECT_LT(testing::gradcheck([](const std::vector<Var>& in) { return ag::gated_rmsnorm(in[0], nullptr, in[1], 4, 1e-5f, ag::NormGate::None); },
                               {x, w}),
            2e-3);
}

TEST(DeltaOps, GatedRmsNormValue) {
  Tensor x = Tensor::from_vector({1, 2, 3, 4}, {1, 4});
  Var y = ag::gated_rmsnorm(constant(x), constant(Tensor::full({1, 4}, 0.0f)), nullptr, 2, 0.0f, ag::NormGate::Sigmoid);
  const float r0 = 1.0f / std::sqrt(2.5f), r1 = 1.0f / std::sqrt(12.5f);
  EXPECT_NEAR(y->value.f32()[1], 2 * r0 * 0.5f, 1e-6);
  EXPECT_NEAR(y->value.f32()[3], 4 * r1 * 0.5f, 1e-6);
}

TEST(DeltaOps, GateAndFeatureMapGradients) {
  Rng rng(4);
  Var x = testing::random_var({3, 2 * 4}, rng), A = testing::random_var({2}, rng, 0.5f), dt = testing::random_var({8}, rng);
  for (auto form : {ag::KdaGateForm::Softplus, ag::KdaGateForm::LowerBound})
    EXPECT_LT(testing::gradcheck([form](const std::vector<Var>& in) { return ag::kda_gate(in[0], in[1], in[2], 2, 4, form); },
                                 {x, A, dt}, 1e-3f),
              2e-3);
  EXPECT_LT(testing::gradcheck([](const std::vector<Var>& in) { return ag::elu1(in[0]); }, {x}, 1e-3f), 2e-3);
}

TEST(DeltaOps, DeltaRuleGradients) {
  Rng rng(5);
  const ag::DeltaShape s{2, 7, 1, 2, 3, 4};
  const int64_t M = s.B * s.T;
  for (int variant = 0; variant < 4; ++variant) {
    linear::DeltaOptions o;
    o.chunk = 4;
    o.write = variant == 0 ? linear::Write::Additive : linear::Write::Delta;
    o.decay = variant == 2 ? linear::Decay::Scalar : variant == 3 ? linear::Decay::PerChannel : linear::Decay::None;
    Var q = testing::random_var({M, s.H * s.K}, rng, 0.5f), k = testing::random_var({M, s.H * s.K}, rng, 0.5f);
    Var v = testing::random_var({M, s.HV * s.V}, rng);
    Var beta = constant(linear::testing::uniform(rng, {M, s.HV}, 0.2f, 0.9f));
    beta->requires_grad = true;
    Var g = constant(linear::testing::uniform(rng, {M, s.HV * (o.decay == linear::Decay::PerChannel ? s.K : 1)}, -1.0f, -0.05f));
    g->requires_grad = true;
    std::vector<Var> in = {q, k, v};
    if (o.write == linear::Write::Delta) in.push_back(beta);
    if (o.decay != linear::Decay::None) in.push_back(g);
    const double err = testing::gradcheck(
        [&](const std::vector<Var>& x) {
          return ag::delta_rule(x[0], x[1], x[2], o.write == linear::Write::Delta ? x[3] : nullptr,
                                o.decay != linear::Decay::None ? x.back() : nullptr, o, s);
        },
        in, 1e-3f);
    EXPECT_LT(err, 5e-3) << "variant " << variant;
  }
}

// ---- layers -----------------------------------------------------------------------------------

class DeltaLayerKinds : public ::testing::TestWithParam<std::string> {};

// Worst relative L2 error, over `params`, of backward's gradient of L = Σ w ⊙ f() against central
// differences with Richardson extrapolation ((4 D(h/2) − D(h)) / 3 cancels the h² term, which
// matters through the l2norm of short vectors), up to `coords` coordinates per tensor.
double richardson_gradcheck(const std::function<Var()>& f, const std::vector<Var>& params, float h, int64_t coords) {
  Rng rng(99);
  Tensor w;
  auto loss = [&]() {
    Var y = f();
    if (!w.defined()) {
      w = Tensor::empty(y->value.shape());
      for (int64_t i = 0; i < w.numel(); ++i) w.f32()[i] = rng.normal();
    }
    double s = 0;
    for (int64_t i = 0; i < w.numel(); ++i) s += double(w.f32()[i]) * y->value.f32()[i];
    return s;
  };
  loss();
  for (const auto& p : params) p->grad = Tensor();
  {
    Recording rec;
    backward(f(), w);
  }
  double worst = 0;
  for (const auto& p : params) {
    const int64_t n = p->value.numel(), stride = std::max<int64_t>(1, n / coords);
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i += stride) {
      float* x = p->value.f32() + i;
      const float x0 = *x;
      auto diff = [&](float step) {
        *x = x0 + step;
        const double lp = loss();
        *x = x0 - step;
        const double lm = loss();
        *x = x0;
        return (lp - lm) / (2.0 * double(step));
      };
      const double fd = (4.0 * diff(h / 2) - diff(h)) / 3.0;
      const double an = p->grad.defined() ? p->grad.f32()[i] : 0.0;
      num += (fd - an) * (fd - an);
      den += an * an;
    }
    worst = std::max(worst, std::sqrt(num) / std::max(std::sqrt(den), 1e-12));
  }
  return worst;
}

TEST_P(DeltaLayerKinds, GradientsMatchFiniteDifferences) {
  DeltaLayerOptions o = configs().at(GetParam());
  o.chunk = 4;
  DeltaLayer m(o);
  init(m, 7);
  Rng rng(8);
  Var x = testing::random_var({2 * 6, o.d_model}, rng);
  std::vector<std::pair<std::string, Var>> inputs = {{"x", x}};
  m.visit("", [&](const std::string& n, Node& p, ParamKind) {
    inputs.push_back({n, std::shared_ptr<Node>(std::shared_ptr<Node>{}, &p)});
  });
  // One input at a time, so that a failure names it.
  for (size_t i = 0; i < inputs.size(); ++i) {
    for (size_t j = 0; j < inputs.size(); ++j) inputs[j].second->requires_grad = i == j;
    const double err = richardson_gradcheck([&] { return m.forward(x, SeqBatch{2, 6, nullptr}); }, {inputs[i].second}, 1e-2f, 24);
    EXPECT_LT(err, 3e-2) << GetParam() << " " << inputs[i].first;
  }
  for (auto& v : inputs) v.second->requires_grad = true;
}

TEST_P(DeltaLayerKinds, DecodeEqualsPrefill) {
  for (int chunk : {4, 16})
    for (int64_t T : {1, 5, 17}) {
      DeltaLayerOptions o = configs().at(GetParam());
      o.chunk = chunk;
      DeltaLayer m(o);
      init(m, 11);
      Rng rng(12);
      const int64_t B = 2, D = o.d_model;
      Tensor x = linear::testing::randn(rng, {B * T, D});
      Tensor full = m.forward(fresh(x), SeqBatch{B, T, nullptr})->value;
      // Token by token (delta_step), and in pieces of 3 (chunked core with h0) then tokens.
      for (int64_t piece : {int64_t(1), int64_t(3)}) {
        std::vector<std::unique_ptr<Memory>> mems;
        for (int64_t b = 0; b < B; ++b) mems.push_back(m.new_memory(T));
        Memory* ptrs[2] = {mems[0].get(), mems[1].get()};
        Tensor out = Tensor::empty({B * T, D});
        for (int64_t t0 = 0; t0 < T;) {
          const int64_t n = std::min(t0 == 0 ? piece : 1, T - t0);
          Tensor xs = Tensor::empty({B * n, D});
          for (int64_t b = 0; b < B; ++b)
            std::memcpy(xs.f32() + b * n * D, x.f32() + (b * T + t0) * D, static_cast<size_t>(n * D) * sizeof(float));
          Tensor y = m.forward(constant(xs), SeqBatch{B, n, ptrs})->value;
          for (int64_t b = 0; b < B; ++b)
            std::memcpy(out.f32() + (b * T + t0) * D, y.f32() + b * n * D, static_cast<size_t>(n * D) * sizeof(float));
          t0 += n;
        }
        EXPECT_LT(rel_l2(out, full), 2e-5) << GetParam() << " chunk " << chunk << " T " << T << " piece " << piece;
        EXPECT_EQ(mems[0]->length(), T);
        EXPECT_EQ(mems[0]->kind(), MemoryKind::RecurrentState);
      }
    }
}

TEST_P(DeltaLayerKinds, MemorySnapshotAndReset) {
  DeltaLayerOptions o = configs().at(GetParam());
  DeltaLayer m(o);
  init(m, 13);
  Rng rng(14);
  Tensor x = linear::testing::randn(rng, {3, o.d_model});
  auto mem = m.new_memory(16);
  Memory* p[1] = {mem.get()};
  m.forward(constant(x.slice(0, 0, 1).clone()), SeqBatch{1, 1, p});
  auto snap = mem->clone();
  Tensor a = m.forward(constant(x.slice(0, 1, 2).clone()), SeqBatch{1, 1, p})->value.clone();
  mem->restore(*snap);
  Tensor b = m.forward(constant(x.slice(0, 1, 2).clone()), SeqBatch{1, 1, p})->value.clone();
  EXPECT_LT(rel_l2(b, a), 1e-7);
  mem->reset();
  EXPECT_EQ(mem->length(), 0);
  Tensor c = m.forward(constant(x.slice(0, 0, 1).clone()), SeqBatch{1, 1, p})->value;
  Tensor d = m.forward(constant(x.slice(0, 0, 1).clone()), SeqBatch{1, 1, nullptr})->value;
  EXPECT_LT(rel_l2(c, d), 1e-6);
  double spec = 0;
  for (const auto& s : m.memory_spec()) spec += s.fixed_bytes;
  EXPECT_EQ(size_t(spec), mem->bytes());
}

INSTANTIATE_TEST_SUITE_P(Delta, DeltaLayerKinds,
                         ::testing::Values("la_elu", "la_normalized", "deltanet", "deltanet_gated", "gdn_gva",
                                           "kda_kimi_linear", "kda_k3", "kda_fla_gva"));

// ---- checkpoints --------------------------------------------------------------------------------

struct Model {
  std::string dir, prefix;
  bool k3;
};
const Model kKimiLinear{"kimi-linear-tiny", "model.layers.0.self_attn", false};
const Model kK3{"kimi-k3-tiny", "language_model.model.layers.0.self_attn", true};

DeltaLayerOptions fixture_options(const Model& md) {
  // Both tiny models: d 128, 4 KDA heads of 32, rms_norm_eps 1e-5. K3's A_log is stored [H*K]
  // with the per-head values first (fla's gate kernel reads A_log[h]).
  return md.k3 ? [] { auto o = DeltaLayerOptions::kimi_k3_kda(128, 4, 32, 1e-5f); o.a_log_shape = {128}; return o; }()
               : DeltaLayerOptions::kimi_linear_kda(128, 4, 32, 1e-5f);
}

std::string model_path(const Model& md) { return std::string(K3_SHARED_DIR) + "/fixtures/models/" + md.dir; }

// Loads layer 0's attention by name; every name and shape must match and none may be left over.
void load(const DeltaLayer& m, const Model& md) {
  Checkpoint ck = Checkpoint::open(model_path(md));
  std::set<std::string> expected;
  for (const auto& n : ck.names())
    if (n.rfind(md.prefix + ".", 0) == 0) expected.insert(n);
  std::set<std::string> seen;
  m.visit(md.prefix, [&](const std::string& name, Node& p, ParamKind) {
    ASSERT_TRUE(ck.has(name)) << name;
    Tensor t = ck.get_f32(name);
    ASSERT_EQ(t.shape(), p.value.shape()) << name;
    p.value = t.clone();
    seen.insert(name);
  });
  EXPECT_EQ(seen, expected);
}

TEST(DeltaLayerCheckpoint, KimiLinearAndK3LoadByName) {
  for (const Model& md : {kKimiLinear, kK3}) {
    DeltaLayer m(fixture_options(md));
    load(m, md);
  }
}

TEST(DeltaLayerCheckpoint, MatchesPyTorchReference) {
  for (const Model& md : {kKimiLinear, kK3}) {
    const std::string ref = std::string(K3_SOURCE_DIR) + "/tests/data/kda_layer/" + md.dir + ".safetensors";
    if (!std::filesystem::exists(ref)) GTEST_SKIP() << "no reference " << ref << " (tools/kda_layer_reference.py)";
    DeltaLayer m(fixture_options(md));
    load(m, md);
    SafeTensors st = SafeTensors::open(ref);
    Tensor x = st.get_f32("x"), y = st.get_f32("y");  // [B, T, D]
    const int64_t B = x.dim(0), T = x.dim(1), D = x.dim(2);
    for (int chunk : {16, 64}) {
      DeltaLayerOptions o = fixture_options(md);
      o.chunk = chunk;
      DeltaLayer mc(o);
      m.visit("", [&](const std::string& n, Node& p, ParamKind) {
        mc.visit("", [&](const std::string& n2, Node& q, ParamKind) {
          if (n == n2) q.value = p.value;
        });
      });
      Tensor out = mc.forward(constant(x.reshape({B * T, D}).clone()), SeqBatch{B, T, nullptr})->value;
      EXPECT_LT(rel_l2(out, y.reshape({B * T, D})), 1e-4) << md.dir << " chunk " << chunk;
    }
    // Decode through the memory too.
    std::vector<std::unique_ptr<Memory>> mems;
    std::vector<Memory*> ptrs;
    for (int64_t b = 0; b < B; ++b) {
      mems.push_back(m.new_memory(T));
      ptrs.push_back(mems.back().get());
    }
    Tensor out = Tensor::empty({B * T, D});
    for (int64_t t = 0; t < T; ++t) {
      Tensor xs = Tensor::empty({B, D});
      for (int64_t b = 0; b < B; ++b) std::memcpy(xs.f32() + b * D, x.f32() + (b * T + t) * D, size_t(D) * 4);
      Tensor ys = m.forward(constant(xs), SeqBatch{B, 1, ptrs.data()})->value;
      for (int64_t b = 0; b < B; ++b) std::memcpy(out.f32() + (b * T + t) * D, ys.f32() + b * D, size_t(D) * 4);
    }
    EXPECT_LT(rel_l2(out, y.reshape({B * T, D})), 1e-4) << md.dir << " decode";
  }
}

}  // namespace
}  // namespace k3
