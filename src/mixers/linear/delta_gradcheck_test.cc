// Finite-difference gradient checks of the delta-rule core in double. The loss
// L = Σ o·d_o + Σ ht·dht (+ Σ zt·dzt) is evaluated by an independent, test-local double
// recurrence (spec §0 order: decay, write, read); both the recurrent and the chunked backward
// must match its central differences.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "mixers/linear/delta_core.h"
#include "mixers/linear/delta_test_util.h"

namespace k3::linear {
namespace {

using testing::l2_rows;
using testing::randn;
using testing::uniform;

constexpr int64_t B = 2, T = 9, H = 1, HV = 2, K = 3, V = 4;

struct Doubles {
  std::vector<double> q, k, v, beta, g, h0, z0;
};

std::vector<double> to_double(const Tensor& t) {
  if (!t.defined()) return {};
  return std::vector<double>(t.f32(), t.f32() + t.numel());
}

double loss(const Doubles& x, const DeltaCotangents& c, const DeltaOptions& o) {
  const double s = o.scale > 0 ? o.scale : 1.0 / std::sqrt(double(K));
  const int64_t G = HV / H;
  double L = 0.0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hv = 0; hv < HV; ++hv) {
      const int64_t h = hv / G;
      std::vector<double> S(K * V, 0.0), z(K, 0.0);
      for (int64_t i = 0; i < K * V; ++i) S[i] = x.h0[(b * HV + hv) * K * V + i];
      if (!x.z0.empty())
        for (int64_t d = 0; d < K; ++d) z[d] = x.z0[(b * HV + hv) * K + d];
      for (int64_t t = 0; t < T; ++t) {
        const int64_t r = b * T + t;
        const double* q = &x.q[(r * H + h) * K];
        const double* k = &x.k[(r * H + h) * K];
        const double* v = &x.v[(r * HV + hv) * V];
        for (int64_t d = 0; d < K; ++d) {
          double g = 0.0;
          if (o.decay == Decay::Scalar) g = x.g[r * HV + hv];
          if (o.decay == Decay::PerChannel) g = x.g[(r * HV + hv) * K + d];
          for (int64_t j = 0; j < V; ++j) S[d * V + j] *= std::exp(g);
          z[d] = z[d] * std::exp(g) + k[d];
        }
        for (int64_t j = 0; j < V; ++j) {
          double u = 0.0;
          for (int64_t d = 0; d < K; ++d) u += S[d * V + j] * k[d];
          const double delta = o.write == Write::Delta ? x.beta[r * HV + hv] * (v[j] - u) : v[j];
          for (int64_t d = 0; d < K; ++d) S[d * V + j] += k[d] * delta;
        }
        double den = 1.0;
        if (o.normalize == Normalize::On) {
          den = o.eps;
          for (int64_t d = 0; d < K; ++d) den += s * q[d] * z[d];
        }
        for (int64_t j = 0; j < V; ++j) {
          double acc = 0.0;
          for (int64_t d = 0; d < K; ++d) acc += S[d * V + j] * s * q[d];
          L += acc / den * c.d_o.f32()[(r * HV + hv) * V + j];
        }
      }
      for (int64_t i = 0; i < K * V; ++i) L += S[i] * c.dht.f32()[(b * HV + hv) * K * V + i];
      if (c.dzt.defined())
        for (int64_t d = 0; d < K; ++d) L += z[d] * c.dzt.f32()[(b * HV + hv) * K + d];
    }
  return L;
}

struct Variant {
  const char* name;
  Write write;
  Decay decay;
  Normalize normalize;
};

class DeltaGradcheck : public ::testing::TestWithParam<Variant> {};

TEST_P(DeltaGradcheck, MatchesFiniteDifferences) {
  const Variant var = GetParam();
  DeltaOptions opts;
  opts.write = var.write;
  opts.decay = var.decay;
  opts.normalize = var.normalize;
  opts.chunk = 4;  // several chunks and a ragged tail at T = 9
  Rng rng(5);
  DeltaInputs in;
  const bool positive = var.write == Write::Additive;
  in.q = positive ? uniform(rng, {B, T, H, K}, 0.1f, 1.0f) : randn(rng, {B, T, H, K});  // [B, T, H, K]
  in.k = positive ? uniform(rng, {B, T, H, K}, 0.1f, 1.0f) : l2_rows(randn(rng, {B, T, H, K}));
  in.v = randn(rng, {B, T, HV, V});
  if (var.write == Write::Delta) in.beta = uniform(rng, {B, T, HV}, 0.1f, 0.9f);
  if (var.decay == Decay::Scalar) in.g = uniform(rng, {B, T, HV}, -2.0f, 0.0f);
  if (var.decay == Decay::PerChannel) in.g = uniform(rng, {B, T, HV, K}, -2.0f, 0.0f);
  in.h0 = randn(rng, {B, HV, K, V}, 0.5f);
  if (var.normalize == Normalize::On) in.z0 = uniform(rng, {B, HV, K}, 0.5f, 1.5f);
  DeltaCotangents cot;
  cot.d_o = randn(rng, {B, T, HV, V});
  cot.dht = randn(rng, {B, HV, K, V});
  if (var.normalize == Normalize::On) cot.dzt = randn(rng, {B, HV, K});

  Doubles x{to_double(in.q), to_double(in.k),  to_double(in.v), to_double(in.beta),
            to_double(in.g), to_double(in.h0), to_double(in.z0)};
  struct Entry {
    const char* name;
    std::vector<double>* param;
    Tensor DeltaGrads::*grad;
  };
  const std::vector<Entry> entries = {{"q", &x.q, &DeltaGrads::dq},         {"k", &x.k, &DeltaGrads::dk},
                                      {"v", &x.v, &DeltaGrads::dv},         {"beta", &x.beta, &DeltaGrads::dbeta},
                                      {"g", &x.g, &DeltaGrads::dg},         {"h0", &x.h0, &DeltaGrads::dh0},
                                      {"z0", &x.z0, &DeltaGrads::dz0}};
  for (Impl impl : {Impl::Recurrent, Impl::Chunked}) {
    const DeltaGrads grads = delta_backward(in, cot, opts, impl);
    for (const Entry& e : entries) {
      if (e.param->empty()) continue;
      const Tensor& analytic = grads.*(e.grad);
      ASSERT_TRUE(analytic.defined()) << e.name;
      double num = 0.0, den = 0.0;
      for (size_t i = 0; i < e.param->size(); ++i) {
        const double keep = (*e.param)[i], step = 1e-6;
        (*e.param)[i] = keep + step;
        const double up = loss(x, cot, opts);
        (*e.param)[i] = keep - step;
        const double down = loss(x, cot, opts);
        (*e.param)[i] = keep;
        const double fd = (up - down) / (2 * step);
        num += (fd - analytic.f32()[i]) * (fd - analytic.f32()[i]);
        den += fd * fd;
      }
      EXPECT_LE(std::sqrt(num / den), 1e-4)
          << var.name << (impl == Impl::Chunked ? " chunked" : " recurrent") << " grad " << e.name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, DeltaGradcheck,
                         ::testing::Values(Variant{"linear", Write::Additive, Decay::None, Normalize::Off},
                                           Variant{"linear_norm", Write::Additive, Decay::None, Normalize::On},
                                           Variant{"linear_decay", Write::Additive, Decay::PerChannel, Normalize::Off},
                                           Variant{"delta", Write::Delta, Decay::None, Normalize::Off},
                                           Variant{"gdn", Write::Delta, Decay::Scalar, Normalize::Off},
                                           Variant{"kda", Write::Delta, Decay::PerChannel, Normalize::Off}),
                         [](const ::testing::TestParamInfo<Variant>& param_info) {
                           return std::string(param_info.param.name);
                         });

}  // namespace
}  // namespace k3::linear
