// Helpers shared by the delta-core tests (header-only, test code only).
#pragma once

#include <cmath>
#include <string>
#include <vector>

#include "core/random.h"
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

}  // namespace k3::linear::testing
