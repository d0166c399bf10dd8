// Vectorised kernels of the chunked delta-rule form; see delta_simd.h for why they exist.
#include "mixers/linear/delta_simd.h"

#include <algorithm>
#include <cstring>

// K3_SIMD_BODY / K3_SIMD_DISPATCH (core/fastmath.h): one form per ISA level, picked by the CPU's
// features.

namespace k3::linear::detail {

K3_SIMD_BODY void exp_diff_body(const double* a, const double* b, float* y, int64_t n) {
  if (!b) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = exp_approx(float(a[i]));
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = exp_approx(float(a[i] - b[i]));
}
K3_SIMD_DISPATCH(exp_diff, (const double* a, const double* b, float* y, int64_t n), (a, b, y, n))

K3_SIMD_BODY void scale_exp_diff_body(const float* x, const double* a, const double* b, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * exp_approx(float(a[i] - b[i]));
}
K3_SIMD_DISPATCH(scale_exp_diff, (const float* x, const double* a, const double* b, float* y, int64_t n),
                 (x, a, b, y, n))

// GCC/clang vector extensions for the diagonal-block kernel: a vf8 holds 8 columns of a row of
// the 16×16 block, so the sums over channels stay in registers (neither GCC's omp-simd
// reductions, which are summed lane by lane in order, nor its outer-loop vectoriser handled this
// loop well). 8 lanes, not 16: wider than the ISA's vectors (AVX2), GCC lowered the selects of a
// 16-lane vector to scalar compares and spilled the halves to the stack.
constexpr int64_t kVecLanes = 8;
typedef float vf8 __attribute__((vector_size(kVecLanes * sizeof(float))));
typedef int32_t vi8 __attribute__((vector_size(kVecLanes * sizeof(int32_t))));

// exp_approx on 8 lanes (same constants, same clamps; see delta_simd.h). Vectors are passed by
// reference: by value, the baseline form would warn (-Wpsabi) about the 32-byte vector ABI.
[[gnu::always_inline]] inline void exp_vec(const vf8& x, vf8& out) {
  constexpr float kLo = -87.33654f, kHi = 88.0f;
  const vf8 lo = vf8{} + kLo, hi = vf8{} + kHi;
  vf8 xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const vf8 n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;
  vf8 r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vf8 p = vf8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi8 bits = (__builtin_convertvector(n, vi8) + 127) << 23;
  vf8 scale;  // 2^n from the exponent bits (memcpy: std::bit_cast would return a vector by value)
  std::memcpy(&scale, &bits, sizeof scale);
  const vf8 y = p * scale;
  out = x < lo ? vf8{} : y;
}

[[gnu::always_inline]] inline void load8(const float* p, vf8& v) { std::memcpy(&v, p, sizeof v); }

// Lanes run over 8 columns s of the block at a time, the loop over channels d accumulates. Kc and
// Gb of the block are transposed into `scratch` first. Lanes s > r are masked to a very negative
// exponent BEFORE exp (exp_vec gives exactly 0 there), so a positive exponent is never evaluated;
// a half whose columns all lie above row r is skipped.
K3_SIMD_BODY void diag_gram_body(const float* Q, const float* Kc, const float* Gb, int64_t m, int64_t K,
                                 float* Aqk, float* Abar, int64_t ldm, float* scratch) {
  constexpr int64_t L = kDiagLanes, W = kVecLanes;
  static_assert(L % W == 0);
  float* KT = scratch;          // [K, L]
  float* GT = scratch + K * L;  // [K, L]
  for (int64_t d = 0; d < K; ++d)
    for (int64_t s = 0; s < L; ++s) {
      KT[d * L + s] = s < m ? Kc[s * K + d] : 0.0f;
      GT[d * L + s] = s < m ? Gb[s * K + d] : 0.0f;
    }
  vi8 lane;
  for (int32_t s = 0; s < int32_t(W); ++s) lane[s] = s;
  const vf8 masked = vf8{} - 1000.0f;
  for (int64_t s0 = 0; s0 < m; s0 += W) {
    for (int64_t r = s0; r < m; ++r) {
      const vi8 keep = lane <= int32_t(r - s0);
      const float* q = Q + r * K;
      const float* kr = Kc + r * K;
      const float* gr = Gb + r * K;
      vf8 aq = {}, ak = {};
      for (int64_t d = 0; d < K; ++d) {
        vf8 gt, kt, e;
        load8(GT + d * L + s0, gt);
        load8(KT + d * L + s0, kt);
        const vf8 x = keep ? gr[d] - gt : masked;  // mask, then exponentiate
        exp_vec(x, e);
        e *= kt;
        aq += q[d] * e;
        ak += kr[d] * e;
      }
      const int64_t end = std::min(r, s0 + W - 1);
      for (int64_t s = s0; s <= end; ++s) Aqk[r * ldm + s] = aq[s - s0];
      if (Abar)
        for (int64_t s = s0; s <= end && s < r; ++s) Abar[r * ldm + s] = ak[s - s0];
    }
  }
}
K3_SIMD_DISPATCH(diag_gram,
                 (const float* Q, const float* Kc, const float* Gb, int64_t m, int64_t K, float* Aqk, float* Abar,
                  int64_t ldm, float* scratch),
                 (Q, Kc, Gb, m, K, Aqk, Abar, ldm, scratch))

K3_SIMD_BODY void diag_gram_backward_body(const float* Q, const float* Kc, const float* Gb, int64_t m,
                                          int64_t K, const float* dAqk, const float* dA, int64_t ldm, float* tXq,
                                          float* tXk, float* tY) {
  for (int64_t r = 0; r < m; ++r) {
    const float* q = Q + r * K;
    const float* kr = Kc + r * K;
    const float* gr = Gb + r * K;
    float* xq = tXq + r * K;
    float* xk = tXk + r * K;
    for (int64_t s = 0; s <= r; ++s) {
      const float mq = dAqk ? dAqk[r * ldm + s] : 0.0f;
      const float mk = dA && s < r ? dA[r * ldm + s] : 0.0f;
      if (mq == 0.0f && mk == 0.0f) continue;
      const float* ks = Kc + s * K;
      const float* gs = Gb + s * K;
      float* y = tY + s * K;
#pragma omp simd
      for (int64_t d = 0; d < K; ++d) {
        const float e = exp_approx(gr[d] - gs[d]);
        const float eq = mq * e, ek = mk * e;
        xq[d] += eq * ks[d];
        xk[d] += ek * ks[d];
        y[d] += eq * q[d] + ek * kr[d];
      }
    }
  }
}

K3_SIMD_DISPATCH(diag_gram_backward,
                 (const float* Q, const float* Kc, const float* Gb, int64_t m, int64_t K, const float* dAqk,
                  const float* dA, int64_t ldm, float* tXq, float* tXk, float* tY),
                 (Q, Kc, Gb, m, K, dAqk, dA, ldm, tXq, tXk, tY))

}  // namespace k3::linear::detail
