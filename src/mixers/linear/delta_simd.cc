// Vectorised kernels of the chunked delta-rule form; see delta_simd.h for why they exist.
#include "mixers/linear/delta_simd.h"

// One clone per ISA level, dispatched through an ifunc at load time. GCC only: clang's
// target_clones differs, and sanitizer / fuzz builds do not need the speed.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define K3_SIMD_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define K3_SIMD_CLONES
#endif

namespace k3::linear::detail {

K3_SIMD_CLONES void exp_array(const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = exp_approx(x[i]);
}

K3_SIMD_CLONES void exp_diff(const double* a, const double* b, float* y, int64_t n) {
  if (!b) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = exp_approx(float(a[i]));
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = exp_approx(float(a[i] - b[i]));
}

K3_SIMD_CLONES void scale_exp_diff(const float* x, const double* a, const double* b, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * exp_approx(float(a[i] - b[i]));
}

K3_SIMD_CLONES void diag_gram(const float* Q, const float* Kc, const float* Gb, int64_t m, int64_t K, float* Aqk,
                              float* Abar, int64_t ldm) {
  for (int64_t r = 0; r < m; ++r) {
    const float* q = Q + r * K;
    const float* kr = Kc + r * K;
    const float* gr = Gb + r * K;
    for (int64_t s = 0; s <= r; ++s) {
      const float* ks = Kc + s * K;
      const float* gs = Gb + s * K;
      float aq = 0.0f, ak = 0.0f;
      // One exp per (pair, channel) feeds both grams.
#pragma omp simd reduction(+ : aq, ak)
      for (int64_t d = 0; d < K; ++d) {
        const float e = ks[d] * exp_approx(gr[d] - gs[d]);
        aq += q[d] * e;
        ak += kr[d] * e;
      }
      Aqk[r * ldm + s] = aq;
      if (Abar && s < r) Abar[r * ldm + s] = ak;
    }
  }
}

K3_SIMD_CLONES void diag_gram_backward(const float* Q, const float* Kc, const float* Gb, int64_t m, int64_t K,
                                       const float* dAqk, const float* dA, int64_t ldm, float* tXq, float* tXk,
                                       float* tY) {
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

}  // namespace k3::linear::detail
