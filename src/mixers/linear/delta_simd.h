// Vectorised kernels of the chunked delta-rule form (delta_chunked.cc): the per-channel decayed
// gram of the diagonal 16×16 sub-chunk blocks (spec §5.2), over core/fastmath.h's branch-free exp.
//
// Why: the per-channel gram needs exp(G_r[d] − G_s[d]) for every pair of a diagonal block and
// every channel. glibc's scalar expf cannot be vectorised, and this build targets baseline
// x86-64, so these kernels are compiled once per ISA level (AVX-512 / AVX2+FMA / baseline SSE2,
// picked by the CPU's features on first use: core/fastmath.h) around `#pragma omp simd` loops
// that inline exp_approx.
#pragma once

#include <cstdint>
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "core/fastmath.h"

namespace k3::linear::detail {

using k3::exp_approx;  // core/fastmath.h
using k3::exp_array;

// Sets flush-to-zero and denormals-are-zero on the calling thread for its lifetime, then restores
// the previous mode. Why: with strong decay, e^G ⊙ Q, e^G ⊙ K, the decayed state and many gram
// entries land below FLT_MIN (1.2e-38); fp32 arithmetic on denormals takes a microcode assist of
// ~100 cycles per operation, which made BLAS on these operands ~10x slower. The values flushed are
// < 1.2e-38 next to O(1) terms, far below the 1e-4 tolerance. MXCSR is per thread, so each
// parallel_for worker sets its own (OpenBLAS then runs on that thread with the same mode).
class FlushDenormals {
 public:
#if defined(__SSE__) || defined(__x86_64__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#else
  FlushDenormals() = default;
#endif
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

// y[i] = exp(float(a[i] − b[i])): a difference of double cumulative log-decays, then fp32 exp
// (b null: exp(float(a[i]))).
void exp_diff(const double* a, const double* b, float* y, int64_t n);
// y[i] = x[i] · exp(float(a[i] − b[i])).
void scale_exp_diff(const float* x, const double* a, const double* b, float* y, int64_t n);

// Diagonal sub-chunk block of the per-channel decayed grams, pairwise (spec §5.2). Rows r, s of
// the block are 0..m−1; Gb [m, K] is the cumulative log-decay relative to the block's first row
// (so |Gb| spans at most m tokens and the fp32 difference Gb_r − Gb_s is accurate), Q, Kc [m, K].
// Writes, for s ≤ r (mask before exponentiating: only r ≥ s is ever evaluated),
//   Aqk[r, s]  = Σ_d Q_r[d] Kc_s[d] e^{Gb_r[d] − Gb_s[d]}           (s ≤ r)
//   Abar[r, s] = Σ_d Kc_r[d] Kc_s[d] e^{Gb_r[d] − Gb_s[d]}          (s < r; Abar may be null)
// with row stride ldm. Entries above the diagonal are not touched.
// m ≤ kDiagLanes; scratch holds 2·K·kDiagLanes floats.
constexpr int64_t kDiagLanes = 16;
void diag_gram(const float* Q, const float* Kc, const float* Gb, int64_t m, int64_t K, float* Aqk, float* Abar,
               int64_t ldm, float* scratch);

// Backward of diag_gram for cotangents dAqk (s ≤ r) and dA (s < r), either may be null:
//   tXq_r += Σ_s dAqk[r,s] e_rs ⊙ Kc_s,   tXk_r += Σ_s dA[r,s] e_rs ⊙ Kc_s,
//   tY_s  += Σ_r (dAqk[r,s] e_rs ⊙ Q_r + dA[r,s] e_rs ⊙ Kc_r).
void diag_gram_backward(const float* Q, const float* Kc, const float* Gb, int64_t m, int64_t K, const float* dAqk,
                        const float* dA, int64_t ldm, float* tXq, float* tXk, float* tY);

}  // namespace k3::linear::detail
