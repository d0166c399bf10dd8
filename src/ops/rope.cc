#include "ops/rope.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace k3 {

double yarn_mscale(double factor, double m) { return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }

RopeTable make_rope(int64_t dim, double theta, const std::optional<YarnScaling>& yarn) {
  K3_CHECK(dim % 2 == 0, "rope dim ", dim, " must be even");
  RopeTable t;
  t.dim = dim;
  t.inv_freq.resize(size_t(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) t.inv_freq[size_t(i)] = 1.0 / std::pow(theta, double(2 * i) / double(dim));
  if (!yarn || yarn->factor <= 1.0) return t;
  const YarnScaling& y = *yarn;
  const double pi = 3.14159265358979323846;
  auto correction_dim = [&](double rotations) {
    return double(dim) * std::log(double(y.original_max_position_embeddings) / (rotations * 2 * pi)) / (2 * std::log(theta));
  };
  double low = std::max(std::floor(correction_dim(y.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(y.beta_slow)), double(dim - 1));
  if (low == high) high += 0.001;
  for (int64_t i = 0; i < dim / 2; ++i) {
    double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
    double extrapolation = 1.0 - ramp;
    double f = t.inv_freq[size_t(i)];
    t.inv_freq[size_t(i)] = f / y.factor * (1 - extrapolation) + f * extrapolation;
  }
  if (y.attention_factor)
    t.attention_factor = *y.attention_factor;
  else if (y.mscale && y.mscale_all_dim)
    t.attention_factor = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim);
  else
    t.attention_factor = yarn_mscale(y.factor, 1.0);
  return t;
}

void RopeTable::angles(int64_t pos, std::vector<float>& c, std::vector<float>& s) const {
  c.resize(inv_freq.size());
  s.resize(inv_freq.size());
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    double a = double(pos) * inv_freq[i];
    c[i] = float(std::cos(a) * attention_factor);
    s[i] = float(std::sin(a) * attention_factor);
  }
}

void rope_apply(float* x, int64_t M, int64_t H, int64_t hd, int64_t offset, const int64_t* positions,
                const RopeTable& table, int direction) {
  std::vector<float> c, s;
  for (int64_t m = 0; m < M; ++m) {
    table.angles(positions[m], c, s);
    for (int64_t h = 0; h < H; ++h) {
      float* p = x + m * H * hd + h * hd + offset;
      const int64_t half = table.dim / 2, step = table.half_pairs ? 1 : 2, partner = table.half_pairs ? half : 1;
      for (int64_t i = 0; i < half; ++i) {
        float& a = p[i * step];
        float& b = p[i * step + partner];
        const float a0 = a, b0 = b;
        float si = direction > 0 ? s[size_t(i)] : -s[size_t(i)];
        // The backward of y = A x with A = f·R(θ) is Aᵀ = f·R(−θ).
        a = a0 * c[size_t(i)] - b0 * si;
        b = a0 * si + b0 * c[size_t(i)];
      }
    }
  }
}

}  // namespace k3
