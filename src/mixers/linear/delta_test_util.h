// Helpers shared by the delta-core tests (header-only, test code only).
#pragma once

#include <cmath>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/random.h"
#include "mixers/linear/delta_core.h"
#include "core/tensor.h"

namespace k3::linear::testing {

// ‖x − ref‖ / ‖ref‖ in double (‖x‖ when ref is all zeros).
inline double rel_l2(const Tensor& x, const Tensor& ref) {
  K3_CHECK(x.numel() == ref.numel(), x.describe(), " vs ", ref.describe());
  Tensor a = x.to(DType::F32), b = ref.to(DType::F32);
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = double(a.f32()[i]) - b.f32()[i];
    num += d * d;
    den += double(b.f32()[i]) * b.f32()[i];
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline Tensor randn(Rng& rng, Shape shape, float stddev = 1.0f) {
  Tensor t = Tensor::empty(std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = stddev * rng.normal();
  return t;
}

inline Tensor uniform(Rng& rng, Shape shape, float lo, float hi) {
  Tensor t = Tensor::empty(std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = lo + (hi - lo) * rng.uniform();
  return t;
}

// Rows of the last dimension scaled to unit L2 norm (keys of the delta rule, spec §3).
inline Tensor l2_rows(Tensor t) {
  const int64_t D = t.dim(-1);
  for (int64_t r = 0; r < t.numel() / D; ++r) {
    double s = 0.0;
    for (int64_t d = 0; d < D; ++d) s += double(t.f32()[r * D + d]) * t.f32()[r * D + d];
    const float inv = float(1.0 / std::sqrt(s + 1e-6));
    for (int64_t d = 0; d < D; ++d) t.f32()[r * D + d] *= inv;
  }
  return t;
}

struct Variant {
  const char* name;
  Write write;
  Decay decay;
  Normalize normalize;
};

inline const Variant kVariants[] = {
    {"linear", Write::Additive, Decay::None, Normalize::Off},
    {"linear_norm", Write::Additive, Decay::None, Normalize::On},
    {"delta", Write::Delta, Decay::None, Normalize::Off},
    {"gdn", Write::Delta, Decay::Scalar, Normalize::Off},
    {"kda", Write::Delta, Decay::PerChannel, Normalize::Off},
};

inline DeltaOptions options(const Variant& var) {
  DeltaOptions o;
  o.write = var.write;
  o.decay = var.decay;
  o.normalize = var.normalize;
  return o;
}

// Random inputs: unit keys, β in (0, 1), log-decays uniform in [−5, 0] (the K3 lower bound).
inline DeltaInputs random_inputs(const Variant& var, int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V,
                          int64_t N, uint64_t seed) {
  Rng rng(seed);
  DeltaInputs in;
  const bool positive = var.write == Write::Additive;  // linear attention sees φ(q), φ(k) > 0
  in.q = positive ? uniform(rng, {B, T, H, K}, 0.05f, 1.0f) : randn(rng, {B, T, H, K});  // [B, T, H, K]
  in.k = positive ? uniform(rng, {B, T, H, K}, 0.05f, 1.0f) : l2_rows(randn(rng, {B, T, H, K}));
  in.v = randn(rng, {B, T, HV, V});  // [B, T, HV, V]
  if (var.write == Write::Delta) in.beta = uniform(rng, {B, T, HV}, 0.0f, 1.0f);  // [B, T, HV]
  if (var.decay == Decay::Scalar) in.g = uniform(rng, {B, T, HV}, -5.0f, 0.0f);   // [B, T, HV]
  if (var.decay == Decay::PerChannel) in.g = uniform(rng, {B, T, HV, K}, -5.0f, 0.0f);  // [B, T, HV, K]
  in.h0 = randn(rng, {N, HV, K, V}, 0.5f);  // [N, HV, K, V]
  if (var.normalize == Normalize::On) in.z0 = uniform(rng, {N, HV, K}, 0.0f, 2.0f);  // [N, HV, K]
  return in;
}

inline DeltaCotangents random_cotangents(const Variant& var, int64_t B, int64_t T, int64_t HV, int64_t K, int64_t V,
                                  int64_t N, uint64_t seed) {
  Rng rng(seed);
  DeltaCotangents c;
  c.d_o = randn(rng, {B, T, HV, V});
  c.dht = randn(rng, {N, HV, K, V});
  if (var.normalize == Normalize::On) c.dzt = randn(rng, {N, HV, K});
  return c;
}

// Options of an ops fixture from its "fixture" metadata (fixtures/README.md); unknown ops throw.
inline DeltaOptions fixture_options(const nlohmann::json& meta) {
  const std::string op = meta.at("op");
  DeltaOptions o;
  if (op == "linear_attn") {
    o.write = Write::Additive;
    o.normalize = meta.value("normalize", false) ? Normalize::On : Normalize::Off;
    o.eps = meta.value("eps", 1e-10f);
  } else if (op == "delta_rule") {
    o.write = Write::Delta;
  } else if (op == "gated_delta_rule") {
    o.decay = Decay::Scalar;
  } else if (op == "kda") {
    o.decay = Decay::PerChannel;
  } else {
    throw std::runtime_error("unexpected op " + op);
  }
  o.scale = meta.value("scale", 0.0f);
  return o;
}

}  // namespace k3::linear::testing
