#include "ops/activation.h"

#include <cmath>

#include "core/fastmath.h"
#include "core/parallel.h"

namespace k3 {

namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr int64_t kGrain = 1 << 14;

K3_SIMD_BODY void gelu_forward_kernel_body(const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    y[i] = 0.5f * v * (1.0f + tanh_approx(kSqrt2OverPi * (v + 0.044715f * v * v * v)));
  }
}
K3_SIMD_DISPATCH(gelu_forward_kernel, (const float* x, float* y, int64_t n), (x, y, n))

K3_SIMD_BODY void gelu_backward_kernel_body(const float* x, const float* dy, float* dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float t = tanh_approx(kSqrt2OverPi * (v + 0.044715f * v * v * v));
    const float du = kSqrt2OverPi * (1.0f + 3.0f * 0.044715f * v * v);
    dx[i] += dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
  }
}
K3_SIMD_DISPATCH(gelu_backward_kernel, (const float* x, const float* dy, float* dx, int64_t n), (x, dy, dx, n))

K3_SIMD_BODY void sigmoid_forward_kernel_body(const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = sigmoid_approx(x[i]);
}
K3_SIMD_DISPATCH(sigmoid_forward_kernel, (const float* x, float* y, int64_t n), (x, y, n))

K3_SIMD_BODY void sigmoid_backward_kernel_body(const float* x, const float* dy, float* dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid_approx(x[i]);
    dx[i] += dy[i] * s * (1.0f - s);
  }
}
K3_SIMD_DISPATCH(sigmoid_backward_kernel, (const float* x, const float* dy, float* dx, int64_t n), (x, dy, dx, n))

K3_SIMD_BODY void silu_forward_kernel_body(const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * sigmoid_approx(x[i]);
}
K3_SIMD_DISPATCH(silu_forward_kernel, (const float* x, float* y, int64_t n), (x, y, n))

K3_SIMD_BODY void silu_backward_kernel_body(const float* x, const float* dy, float* dx, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid_approx(x[i]);
    dx[i] += dy[i] * s * (1.0f + x[i] * (1.0f - s));
  }
}
K3_SIMD_DISPATCH(silu_backward_kernel, (const float* x, const float* dy, float* dx, int64_t n), (x, dy, dx, n))

// SiTU's loops, one per combination of caps (the caps are loop-invariant; a select inside the
// loop would evaluate both tanh forms).
template <bool Cap, bool CapLin>
[[gnu::always_inline]] inline void situ_forward_loop(const float* g, const float* u, float* y, int64_t n, float b,
                                                     float bl) {
  const float ib = Cap ? 1.0f / b : 0.0f, ibl = CapLin ? 1.0f / bl : 0.0f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid_approx(g[i]);
    const float gate = Cap ? b * tanh_approx(g[i] * ib) * s : g[i] * s;
    const float up = CapLin ? bl * tanh_approx(u[i] * ibl) : u[i];
    y[i] = gate * up;
  }
}

template <bool Cap, bool CapLin>
[[gnu::always_inline]] inline void situ_backward_loop(const float* g, const float* u, const float* dy, float* dg,
                                                      float* du, int64_t n, float b, float bl) {
  const float ib = Cap ? 1.0f / b : 0.0f, ibl = CapLin ? 1.0f / bl : 0.0f;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i], s = sigmoid_approx(x);
    float gate, dgate;
    if constexpr (Cap) {
      // d/dg [β tanh(g/β) σ(g)] = (1 − tanh²(g/β)) σ(g) + β tanh(g/β) σ(g)(1 − σ(g))
      const float t = tanh_approx(x * ib);
      gate = b * t * s;
      dgate = (1.0f - t * t) * s + gate * (1.0f - s);
    } else {
      gate = x * s;
      dgate = s * (1.0f + x * (1.0f - s));
    }
    float up = u[i], dup = 1.0f;
    if constexpr (CapLin) {
      const float t = tanh_approx(up * ibl);
      up = bl * t;
      dup = 1.0f - t * t;
    }
    dg[i] += dy[i] * dgate * up;
    du[i] += dy[i] * gate * dup;
  }
}

K3_SIMD_BODY void situ_forward_kernel_body(const float* g, const float* u, float* y, int64_t n, float b, float bl) {
  if (b > 0 && bl > 0) return situ_forward_loop<true, true>(g, u, y, n, b, bl);
  if (b > 0) return situ_forward_loop<true, false>(g, u, y, n, b, bl);
  if (bl > 0) return situ_forward_loop<false, true>(g, u, y, n, b, bl);
  situ_forward_loop<false, false>(g, u, y, n, b, bl);
}
K3_SIMD_DISPATCH(situ_forward_kernel, (const float* g, const float* u, float* y, int64_t n, float b, float bl),
                 (g, u, y, n, b, bl))

K3_SIMD_BODY void situ_backward_kernel_body(const float* g, const float* u, const float* dy, float* dg, float* du, int64_t n,
                                     float b, float bl) {
  if (b > 0 && bl > 0) return situ_backward_loop<true, true>(g, u, dy, dg, du, n, b, bl);
  if (b > 0) return situ_backward_loop<true, false>(g, u, dy, dg, du, n, b, bl);
  if (bl > 0) return situ_backward_loop<false, true>(g, u, dy, dg, du, n, b, bl);
  situ_backward_loop<false, false>(g, u, dy, dg, du, n, b, bl);
}
K3_SIMD_DISPATCH(situ_backward_kernel,
                 (const float* g, const float* u, const float* dy, float* dg, float* du, int64_t n, float b, float bl),
                 (g, u, dy, dg, du, n, b, bl))

}  // namespace

void gelu_tanh_forward(const float* x, float* y, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t a, int64_t b) { gelu_forward_kernel(x + a, y + a, b - a); });
}
void gelu_tanh_backward(const float* x, const float* dy, float* dx, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t a, int64_t b) { gelu_backward_kernel(x + a, dy + a, dx + a, b - a); });
}
void sigmoid_forward(const float* x, float* y, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t a, int64_t b) { sigmoid_forward_kernel(x + a, y + a, b - a); });
}
void sigmoid_backward(const float* x, const float* dy, float* dx, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t a, int64_t b) { sigmoid_backward_kernel(x + a, dy + a, dx + a, b - a); });
}
void silu_forward(const float* x, float* y, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t a, int64_t b) { silu_forward_kernel(x + a, y + a, b - a); });
}
void silu_backward(const float* x, const float* dy, float* dx, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t a, int64_t b) { silu_backward_kernel(x + a, dy + a, dx + a, b - a); });
}
void situ_glu_forward(const float* g, const float* u, float* y, int64_t n, float beta, float beta_lin) {
  parallel_for(n, kGrain, [&](int64_t a, int64_t b) { situ_forward_kernel(g + a, u + a, y + a, b - a, beta, beta_lin); });
}
void situ_glu_backward(const float* g, const float* u, const float* dy, float* dg, float* du, int64_t n, float beta,
                       float beta_lin) {
  parallel_for(n, kGrain, [&](int64_t a, int64_t b) {
    situ_backward_kernel(g + a, u + a, dy + a, dg + a, du + a, b - a, beta, beta_lin);
  });
}

void elu1_forward(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] > 0.0f ? x[i] + 1.0f : std::exp(x[i]);
}

void elu1_backward(const float* x, const float* dy, float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] += dy[i] * (x[i] > 0.0f ? 1.0f : std::exp(x[i]));
}

}  // namespace k3
