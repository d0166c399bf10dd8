#include "ops/gates.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/fastmath.h"

namespace k3 {

float gate_softplus(float x) {
  // log(1 + e^x) without overflow: max(x, 0) + log1p(e^{−|x|}).
  return std::max(x, 0.0f) + std::log1p(std::exp(-std::fabs(x)));
}

float gate_sigmoid(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + std::exp(-x));
  const float e = std::exp(x);
  return e / (1.0f + e);
}

void gate_softplus_forward(const float* x, const float* A_log, const float* dt_bias, float* g, GateShape s) {
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t h = 0; h < s.H; ++h) {
      const float a = std::exp(A_log[h]);
      for (int64_t k = 0; k < s.K; ++k) {
        const int64_t i = (r * s.H + h) * s.K + k;
        g[i] = -a * gate_softplus(x[i] + dt_bias[h * s.K + k]);
      }
    }
}

// ∂g/∂x = −a·gate_sigmoid(u), ∂g/∂A_log = g (since ∂a/∂A_log = a), u = x + dt_bias.
void gate_softplus_backward(const float* x, const float* A_log, const float* dt_bias, const float* dg, float* dx,
                            float* dA_log, float* ddt_bias, GateShape s) {
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t h = 0; h < s.H; ++h) {
      const float a = std::exp(A_log[h]);
      double da = 0.0;
      for (int64_t k = 0; k < s.K; ++k) {
        const int64_t i = (r * s.H + h) * s.K + k;
        const float u = x[i] + dt_bias[h * s.K + k];
        const float du = -a * gate_sigmoid(u) * dg[i];
        if (dx) dx[i] += du;
        if (ddt_bias) ddt_bias[h * s.K + k] += du;
        da += double(dg[i]) * (-a * gate_softplus(u));
      }
      if (dA_log) dA_log[h] += float(da);
    }
}

// The lower-bound gate's loops over k (one head's channels, contiguous) use fastmath's σ so that
// they vectorise; the sums over rows (ddt_bias, dA_log) stay in row order.
void gate_lowerbound_forward(const float* x, const float* A_log, const float* dt_bias, float lower_bound, float* g,
                             GateShape s) {
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t h = 0; h < s.H; ++h) {
      const float a = std::exp(A_log[h]);
      const int64_t i0 = (r * s.H + h) * s.K;
      const float* bias = dt_bias + h * s.K;
#pragma omp simd
      for (int64_t k = 0; k < s.K; ++k) g[i0 + k] = lower_bound * sigmoid_approx(a * (x[i0 + k] + bias[k]));
    }
}

// g = lb·σ(a u): ∂g/∂u = lb·σ(1−σ)·a, ∂g/∂A_log = lb·σ(1−σ)·a·u.
void gate_lowerbound_backward(const float* x, const float* A_log, const float* dt_bias, float lower_bound,
                              const float* dg, float* dx, float* dA_log, float* ddt_bias, GateShape s) {
  std::vector<float> dz(size_t(s.K)), u(size_t(s.K));
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t h = 0; h < s.H; ++h) {
      const float a = std::exp(A_log[h]);
      const int64_t i0 = (r * s.H + h) * s.K;
      const float* bias = dt_bias + h * s.K;
#pragma omp simd
      for (int64_t k = 0; k < s.K; ++k) {
        u[size_t(k)] = x[i0 + k] + bias[k];
        const float sg = sigmoid_approx(a * u[size_t(k)]);
        dz[size_t(k)] = dg[i0 + k] * lower_bound * sg * (1.0f - sg);  // adjoint of z = a·u
      }
      if (dx)
        for (int64_t k = 0; k < s.K; ++k) dx[i0 + k] += dz[size_t(k)] * a;
      if (ddt_bias)
        for (int64_t k = 0; k < s.K; ++k) ddt_bias[h * s.K + k] += dz[size_t(k)] * a;
      if (dA_log) {
        double da = 0.0;
        for (int64_t k = 0; k < s.K; ++k) da += double(dz[size_t(k)]) * a * u[size_t(k)];
        dA_log[h] += float(da);
      }
    }
}

void beta_sigmoid_forward(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = gate_sigmoid(x[i]);
}

void beta_sigmoid_backward(const float* y, const float* dy, float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] += dy[i] * y[i] * (1.0f - y[i]);
}

}  // namespace k3
