// The chunked (WY / UT) form of the delta-rule family, forward and backward (spec §3 steps 1–6,
// §4 and §5.2; derivation in README.md). One unified path: a scalar gate is a per-channel gate
// with equal channels, no decay is g = 0, and the additive write skips the UT transform
// (V_new = V). Cumulative log-decays G are kept in double and only ever exponentiated as
// differences G_r − G_s with r ≥ s (masked BEFORE exponentiating), so every exponent is ≤ 0:
// nothing overflows even when G reaches −300 inside one chunk.
//
// Performance notes (the chunked form must beat the recurrence on a small CPU):
//  * The per-channel grams use fla's secondary chunking (spec §5.2): 16-row sub-chunks; an
//    off-diagonal block (rows of sub-chunk b, columns s < n_b = its first row) factorises as
//    (X_r ⊙ e^{G_r − G_{n_b}}) · (Y_s ⊙ e^{G_{n_b} − G_s})ᵀ, both exponents ≤ 0, so it is one
//    gemm; only the diagonal 16×16 blocks are pairwise (vectorised, delta_simd.h).
//  * Every exp is the vectorised fp32 exp_approx (≈1.4 ulp) of a double difference.
//  * The forward sweep that the backward needs for chunk-entry states skips Aqk and O.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "core/parallel.h"
#include "mixers/linear/delta_internal.h"
#include "mixers/linear/delta_simd.h"
#include "ops/gemm.h"

namespace k3::linear::detail {
namespace {

constexpr int64_t kSub = kDiagLanes;  // secondary (sub-chunk) length of the per-channel grams, spec §5.2

enum class Diag : uint8_t { Strict, Inclusive };

// Scalar gate or no decay: M[r, s] = (X_r · Y_s) e^{G_r − G_s} inside the causal mask, 0 outside,
// as one gemm and C² exps. X, Y, G are [n, K] (a scalar gate repeats G over the channels); M is
// [n, n].
void scalar_gram(const float* X, const float* Y, const double* G, int64_t n, int64_t K, Decay decay, Diag diag,
                 float* M) {
  gemm(Trans::No, Trans::Yes, n, n, K, 1.0f, X, K, Y, K, 0.0f, M, n);
  for (int64_t r = 0; r < n; ++r) {
    float* m = M + r * n;
    const int64_t end = diag == Diag::Strict ? r : r + 1;
    if (decay == Decay::Scalar)
      for (int64_t s = 0; s < end; ++s) m[s] *= exp_approx(float(G[r * K] - G[s * K]));
    std::fill(m + end, m + n, 0.0f);
  }
}

// Backward of scalar_gram for a cotangent dM that is already zero outside the mask:
// dX[r] += Σ_s dM[r,s] e_rs Y[s], dY[s] += Σ_r dM[r,s] e_rs X[r], and since
// ∂e_rs/∂G_r = e_rs = −∂e_rs/∂G_s: dG += X ⊙ (this dX) − Y ⊙ (this dY). tX, tY are [n, K] scratch.
void scalar_gram_backward(const float* X, const float* Y, const double* G, int64_t n, int64_t K, Decay decay,
                          float* dM, float* dX, float* dY, double* dG, float* tX, float* tY) {
  if (decay == Decay::Scalar)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t s = 0; s <= r; ++s) dM[r * n + s] *= exp_approx(float(G[r * K] - G[s * K]));
  gemm(Trans::No, Trans::No, n, K, n, 1.0f, dM, n, Y, K, 0.0f, tX, K);   // [n, K]
  gemm(Trans::Yes, Trans::No, n, K, n, 1.0f, dM, n, X, K, 0.0f, tY, K);  // [n, K]
  for (int64_t i = 0; i < n * K; ++i) {
    dX[i] += tX[i];
    dY[i] += tY[i];
    if (decay != Decay::None) dG[i] += double(X[i]) * tX[i] - double(Y[i]) * tY[i];
  }
}

// T = (I + A)⁻¹ for strictly lower-triangular A [n, n] by forward substitution (spec §3), row by
// row: T_i = e_i − Σ_{m<i} A[i,m] T_m. Each update is a contiguous axpy over T_m's support
// j ≤ m (vectorises, unlike the column-wise form), accumulated in double. acc is [n] scratch.
void unit_lower_inverse(const float* A, int64_t n, float* T, double* acc) {
  for (int64_t i = 0; i < n; ++i) {
    std::fill(acc, acc + i, 0.0);
    for (int64_t m = 0; m < i; ++m) {
      const double a = A[i * n + m];
      if (a == 0.0) continue;
      const float* tm = T + m * n;
      for (int64_t j = 0; j < m; ++j) acc[j] -= a * tm[j];
      acc[m] -= a;  // T[m, m] = 1
    }
    float* ti = T + i * n;
    for (int64_t j = 0; j < i; ++j) ti[j] = float(acc[j]);
    ti[i] = 1.0f;
    std::fill(ti + i + 1, ti + n, 0.0f);
  }
}

// Per-(sequence, value head) scratch for one chunk of at most C rows. Allocated once per worker.
struct Chunk {
  int64_t C, K, V;
  std::vector<float> Qs, Kc, Vc, beta;        // [C, K], [C, K], [C, V], [C]
  std::vector<double> G;                      // [C, K] cumulative log-decay inside the chunk
  std::vector<float> eG, eGd, eGl;            // exp(G), exp(G_last − G) [C, K]; exp(G_last) [K]
  // Per-channel sub-chunk factors (spec §5.2): Gb = G − G_{n_b} (n_b the first row of the row's
  // sub-chunk), E1 = e^{Gb}, Qh = Qs ⊙ E1, Kh = Kc ⊙ E1 [C, K]; for sub-chunk b ≥ 1, F_b[s] =
  // e^{G_{n_b} − G_s} and Ys_b = Kc_s ⊙ F_b[s] for s < n_b, packed (block b from row 16·b(b−1)/2).
  std::vector<float> Gb, E1, Qh, Kh, F, Ys, diag_scratch;
  std::vector<float> Abar, A, T, Aqk;         // [C, C]
  std::vector<float> Kg, Kb, Vb, W, U, Vn, Qg, Kd;  // [C, K] or [C, V]
  // Backward scratch.
  std::vector<float> dVn, dAqk, dQg, dKd, dW, dT, dVb, dKb, dA, tmpCC, tX, tY, tXk, dQs, dK, tmpS;
  std::vector<double> dG, dGl, acc;

  Chunk(int64_t C_, int64_t K_, int64_t V_) : C(C_), K(K_), V(V_) {
    for (auto* b : {&Qs, &Kc, &eG, &eGd, &Gb, &E1, &Qh, &Kh, &Kg, &Kb, &W, &Qg, &Kd, &dQg, &dKd, &dW, &dKb, &tX,
                    &tY, &tXk, &dQs, &dK})
      b->resize(C * K);
    const int64_t nb = (C + kSub - 1) / kSub;
    F.resize(kSub * nb * (nb - 1) / 2 * K);
    Ys.resize(F.size());
    diag_scratch.resize(2 * K * kSub);
    for (auto* b : {&Vc, &Vb, &U, &Vn, &dVn, &dVb}) b->resize(C * V);
    for (auto* b : {&Abar, &A, &T, &Aqk, &dAqk, &dT, &dA, &tmpCC}) b->resize(C * C);
    beta.resize(C);
    eGl.resize(K);
    G.resize(C * K);
    dG.resize(C * K);
    dGl.resize(K);
    acc.resize(C);
    tmpS.resize(K * V);
  }

  // Packed offset (in rows) of sub-chunk b's column factors F_b / Ys_b.
  static int64_t sub_off(int64_t b) { return kSub * b * (b - 1) / 2; }

  // Gathers rows [t0, t0 + n) of sequence `seg` for value head hv (q/k head h).
  void load(const Problem& p, const Segment& seg, int64_t t0, int64_t n, int64_t h, int64_t hv) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = seg.row0 + t0 + i;
      const float* q = p.q_row(r, h);
      const float* k = p.k_row(r, h);
      const float* v = p.v_row(r, hv);
      for (int64_t d = 0; d < K; ++d) {
        Qs[i * K + d] = p.scale * q[d];
        Kc[i * K + d] = k[d];
      }
      double* gi = G.data() + i * K;
      const double* gp = i ? gi - K : nullptr;
      if (p.decay == Decay::None) {
        std::fill(gi, gi + K, 0.0);
      } else if (p.decay == Decay::Scalar) {
        const double g = p.g[r * p.HV + hv];
        for (int64_t d = 0; d < K; ++d) gi[d] = (gp ? gp[d] : 0.0) + g;
      } else {
        const float* g = p.g + (r * p.HV + hv) * K;
        for (int64_t d = 0; d < K; ++d) gi[d] = (gp ? gp[d] : 0.0) + double(g[d]);
      }
      std::copy(v, v + V, Vc.begin() + i * V);
      beta[i] = p.beta_at(r, hv);
    }
    const double* glast = G.data() + (n - 1) * K;
    exp_diff(G.data(), nullptr, eG.data(), n * K);
    for (int64_t i = 0; i < n; ++i) exp_diff(glast, G.data() + i * K, eGd.data() + i * K, K);
    exp_diff(glast, nullptr, eGl.data(), K);
    if (p.decay == Decay::PerChannel) {
      for (int64_t i = 0; i < n; ++i) {
        const double* g0 = G.data() + (i / kSub) * kSub * K;
        const double* gi = G.data() + i * K;
        for (int64_t d = 0; d < K; ++d) Gb[i * K + d] = float(gi[d] - g0[d]);
      }
      exp_array(Gb.data(), E1.data(), n * K);
    }
  }

  // Per-channel Aqk (if need_aqk) and Abar (Delta only), spec §5.2 secondary chunking: diagonal
  // sub-chunk blocks pairwise, off-diagonal blocks as gemms of pre-scaled factors.
  void perchannel_grams(const Problem& p, int64_t n, bool need_aqk) {
    const bool delta = p.write == Write::Delta;
    std::fill(Aqk.begin(), Aqk.begin() + n * n, 0.0f);
    if (delta) std::fill(Abar.begin(), Abar.begin() + n * n, 0.0f);
    for (int64_t i = 0; i < n * K; ++i) {
      Qh[i] = Qs[i] * E1[i];
      Kh[i] = Kc[i] * E1[i];
    }
    for (int64_t n0 = 0; n0 < n; n0 += kSub) {
      const int64_t m = std::min(kSub, n - n0), b = n0 / kSub;
      const int64_t o = n0 * K;
      diag_gram(Qs.data() + o, Kc.data() + o, Gb.data() + o, m, K, Aqk.data() + n0 * n + n0,
                delta ? Abar.data() + n0 * n + n0 : nullptr, n, diag_scratch.data());
      if (b == 0) continue;
      float* f = F.data() + sub_off(b) * K;
      float* ys = Ys.data() + sub_off(b) * K;
      for (int64_t s = 0; s < n0; ++s) exp_diff(G.data() + o, G.data() + s * K, f + s * K, K);
      for (int64_t i = 0; i < n0 * K; ++i) ys[i] = Kc[i] * f[i];
      if (need_aqk) gemm(Trans::No, Trans::Yes, m, n0, K, 1.0f, Qh.data() + o, K, ys, K, 0.0f, Aqk.data() + n0 * n, n);
      if (delta) gemm(Trans::No, Trans::Yes, m, n0, K, 1.0f, Kh.data() + o, K, ys, K, 0.0f, Abar.data() + n0 * n, n);
    }
  }

  // Backward of perchannel_grams for the masked cotangents dAqk, dA (either may be null):
  // accumulates into dQs, dK and dG (dG += Q ⊙ dQ − K ⊙ dK_col + K ⊙ dK_row per gram, README).
  void perchannel_grams_backward(int64_t n, const float* dAq, const float* dAk) {
    std::fill(tX.begin(), tX.begin() + n * K, 0.0f);   // Aqk row side (Q)
    std::fill(tXk.begin(), tXk.begin() + n * K, 0.0f);  // Abar row side (K)
    std::fill(tY.begin(), tY.begin() + n * K, 0.0f);   // column side (K) of both grams
    float* tmp = dKb.data();  // free here: [kSub, K] and [n0, K] gemm outputs (both ≤ C rows)
    for (int64_t n0 = 0; n0 < n; n0 += kSub) {
      const int64_t m = std::min(kSub, n - n0), b = n0 / kSub;
      const int64_t o = n0 * K;
      diag_gram_backward(Qs.data() + o, Kc.data() + o, Gb.data() + o, m, K, dAq ? dAq + n0 * n + n0 : nullptr,
                         dAk ? dAk + n0 * n + n0 : nullptr, n, tX.data() + o, tXk.data() + o, tY.data() + o);
      if (b == 0) continue;
      const float* f = F.data() + sub_off(b) * K;
      const float* ys = Ys.data() + sub_off(b) * K;
      // Row side: tX_r += (dM_b Ys_b)_r ⊙ E1_r.
      for (const auto& [dM, tx] : {std::pair{dAq, tX.data()}, std::pair{dAk, tXk.data()}}) {
        if (!dM) continue;
        gemm(Trans::No, Trans::No, m, K, n0, 1.0f, dM + n0 * n, n, ys, K, 0.0f, tmp, K);
        for (int64_t i = 0; i < m * K; ++i) tx[o + i] += tmp[i] * E1[o + i];
      }
      // Column side: tY_s += (dAqk_bᵀ Qh_b + dA_bᵀ Kh_b)_s ⊙ F_b[s].
      float beta0 = 0.0f;
      if (dAq) {
        gemm(Trans::Yes, Trans::No, n0, K, m, 1.0f, dAq + n0 * n, n, Qh.data() + o, K, 0.0f, tmp, K);
        beta0 = 1.0f;
      }
      if (dAk) gemm(Trans::Yes, Trans::No, n0, K, m, 1.0f, dAk + n0 * n, n, Kh.data() + o, K, beta0, tmp, K);
      if (dAq || dAk)
        for (int64_t i = 0; i < n0 * K; ++i) tY[i] += tmp[i] * f[i];
    }
    for (int64_t i = 0; i < n * K; ++i) {
      dQs[i] += tX[i];
      dK[i] += tXk[i] + tY[i];
      dG[i] += double(Qs[i]) * tX[i] + double(Kc[i]) * (double(tXk[i]) - tY[i]);
    }
  }

  // Everything of the forward pass up to V_new (spec §5.2 steps 1–5) for state S0 [K, V]. Aqk is
  // only formed when need_aqk (the state-only sweep of the backward does not read it).
  void intermediates(const Problem& p, int64_t n, const float* S0, bool need_aqk) {
    for (int64_t i = 0; i < n * K; ++i) {
      Kg[i] = eG[i] * Kc[i];
      Qg[i] = eG[i] * Qs[i];
      Kd[i] = eGd[i] * Kc[i];
    }
    if (p.decay == Decay::PerChannel) {
      perchannel_grams(p, n, need_aqk);
    } else {
      if (need_aqk) scalar_gram(Qs.data(), Kc.data(), G.data(), n, K, p.decay, Diag::Inclusive, Aqk.data());
      if (p.write == Write::Delta)
        scalar_gram(Kc.data(), Kc.data(), G.data(), n, K, p.decay, Diag::Strict, Abar.data());
    }
    if (p.write == Write::Additive) {
      std::copy(Vc.begin(), Vc.begin() + n * V, Vn.begin());
      return;
    }
    for (int64_t r = 0; r < n; ++r)
      for (int64_t s = 0; s < n; ++s) A[r * n + s] = beta[r] * Abar[r * n + s];
    unit_lower_inverse(A.data(), n, T.data(), acc.data());
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t d = 0; d < K; ++d) Kb[r * K + d] = beta[r] * Kg[r * K + d];
      for (int64_t j = 0; j < V; ++j) Vb[r * V + j] = beta[r] * Vc[r * V + j];
    }
    gemm(Trans::No, Trans::No, n, K, n, 1.0f, T.data(), n, Kb.data(), K, 0.0f, W.data(), K);  // W = T Kb
    gemm(Trans::No, Trans::No, n, V, n, 1.0f, T.data(), n, Vb.data(), V, 0.0f, U.data(), V);  // U = T Vb
    std::copy(U.begin(), U.begin() + n * V, Vn.begin());
    gemm(Trans::No, Trans::No, n, V, K, -1.0f, W.data(), K, S0, V, 1.0f, Vn.data(), V);  // V_new = U − W S0
  }

  // O = Qg S0 + Aqk V_new written with row stride ldo (S is still S0).
  void output(int64_t n, const float* S, float* O, int64_t ldo) {
    gemm(Trans::No, Trans::No, n, V, K, 1.0f, Qg.data(), K, S, V, 0.0f, O, ldo);
    gemm(Trans::No, Trans::No, n, V, n, 1.0f, Aqk.data(), n, Vn.data(), V, 1.0f, O, ldo);
  }

  // S ← exp(G_last) ⊙ S + Kdᵀ V_new.
  void advance_state(int64_t n, float* S) {
    for (int64_t d = 0; d < K; ++d)
      for (int64_t j = 0; j < V; ++j) S[d * V + j] *= eGl[d];
    gemm(Trans::Yes, Trans::No, K, V, n, 1.0f, Kd.data(), K, Vn.data(), V, 1.0f, S, V);
  }

  // Backward through one chunk. S0 [K, V] is the state entering it, dO [n, V] (row stride ldo) may
  // be null, dS [K, V] holds the adjoint of the state leaving the chunk and is replaced by that of S0.
  // Accumulates into dQs, dK, dVn (as dV) and dG; returns dβ through `dbeta` [n].
  void backward(const Problem& p, int64_t n, const float* S0, const float* dO, int64_t ldo, float* dS,
                float* dV, float* dbeta) {
    const bool per_channel = p.decay == Decay::PerChannel;
    intermediates(p, n, S0, dO != nullptr);
    std::fill(dQs.begin(), dQs.begin() + n * K, 0.0f);
    std::fill(dK.begin(), dK.begin() + n * K, 0.0f);
    std::fill(dG.begin(), dG.begin() + n * K, 0.0);
    // S_next = exp(G_last) ⊙ S0 + Kdᵀ V_new.
    gemm(Trans::No, Trans::No, n, V, K, 1.0f, Kd.data(), K, dS, V, 0.0f, dVn.data(), V);   // dV_new = Kd dS
    gemm(Trans::No, Trans::Yes, n, K, V, 1.0f, Vn.data(), V, dS, V, 0.0f, dKd.data(), K);  // dKd = V_new dSᵀ
    for (int64_t d = 0; d < K; ++d) {
      double a = 0.0;
      for (int64_t j = 0; j < V; ++j) a += double(dS[d * V + j]) * S0[d * V + j];
      dGl[d] = a * eGl[d];
    }
    std::vector<float>& dS0 = tmpS;
    for (int64_t d = 0; d < K; ++d)
      for (int64_t j = 0; j < V; ++j) dS0[d * V + j] = dS[d * V + j] * eGl[d];
    // O = Qg S0 + Aqk V_new.
    if (dO) {
      gemm(Trans::Yes, Trans::No, n, V, n, 1.0f, Aqk.data(), n, dO, ldo, 1.0f, dVn.data(), V);
      gemm(Trans::No, Trans::Yes, n, n, V, 1.0f, dO, ldo, Vn.data(), V, 0.0f, dAqk.data(), n);
      for (int64_t r = 0; r < n; ++r) std::fill(dAqk.begin() + r * n + r + 1, dAqk.begin() + (r + 1) * n, 0.0f);
      gemm(Trans::No, Trans::Yes, n, K, V, 1.0f, dO, ldo, S0, V, 0.0f, dQg.data(), K);       // dQg = dO S0ᵀ
      gemm(Trans::Yes, Trans::No, K, V, n, 1.0f, Qg.data(), K, dO, ldo, 1.0f, dS0.data(), V);  // += Qgᵀ dO
      if (!per_channel)
        scalar_gram_backward(Qs.data(), Kc.data(), G.data(), n, K, p.decay, dAqk.data(), dQs.data(), dK.data(),
                             dG.data(), tX.data(), tY.data());
      for (int64_t i = 0; i < n * K; ++i) {
        dQs[i] += eG[i] * dQg[i];
        dG[i] += double(Qg[i]) * dQg[i];
      }
    }
    std::fill(dbeta, dbeta + n, 0.0f);
    if (p.write == Write::Delta) {
      // V_new = U − W S0, U = T Vb, W = T Kb, T = (I + A)⁻¹, A = diag(β) Abar.
      gemm(Trans::No, Trans::Yes, n, K, V, -1.0f, dVn.data(), V, S0, V, 0.0f, dW.data(), K);    // dW = −dV_new S0ᵀ
      gemm(Trans::Yes, Trans::No, K, V, n, -1.0f, W.data(), K, dVn.data(), V, 1.0f, dS0.data(), V);  // −= Wᵀ dV_new
      gemm(Trans::No, Trans::Yes, n, n, V, 1.0f, dVn.data(), V, Vb.data(), V, 0.0f, dT.data(), n);   // dT = dU Vbᵀ
      gemm(Trans::No, Trans::Yes, n, n, K, 1.0f, dW.data(), K, Kb.data(), K, 1.0f, dT.data(), n);    // + dW Kbᵀ
      gemm(Trans::Yes, Trans::No, n, V, n, 1.0f, T.data(), n, dVn.data(), V, 0.0f, dVb.data(), V);   // dVb = Tᵀ dU
      gemm(Trans::Yes, Trans::No, n, K, n, 1.0f, T.data(), n, dW.data(), K, 0.0f, dKb.data(), K);    // dKb = Tᵀ dW
      // dA = −Tᵀ dT Tᵀ, kept strictly lower (A's support).
      gemm(Trans::Yes, Trans::No, n, n, n, 1.0f, T.data(), n, dT.data(), n, 0.0f, tmpCC.data(), n);
      gemm(Trans::No, Trans::Yes, n, n, n, -1.0f, tmpCC.data(), n, T.data(), n, 0.0f, dA.data(), n);
      for (int64_t r = 0; r < n; ++r) {
        double db = 0.0;
        for (int64_t j = 0; j < V; ++j) {
          dV[r * V + j] += beta[r] * dVb[r * V + j];
          db += double(dVb[r * V + j]) * Vc[r * V + j];
        }
        for (int64_t d = 0; d < K; ++d) db += double(dKb[r * K + d]) * Kg[r * K + d];
        for (int64_t s = 0; s < n; ++s) {
          float& m = dA[r * n + s];
          if (s >= r) {
            m = 0.0f;
            continue;
          }
          db += double(m) * Abar[r * n + s];
          m *= beta[r];  // now dAbar
        }
        dbeta[r] = float(db);
        // Kb = diag(β) Kg, Kg = exp(G) ⊙ K.
        for (int64_t d = 0; d < K; ++d) {
          const float dkg = beta[r] * dKb[r * K + d];
          dK[r * K + d] += eG[r * K + d] * dkg;
          dG[r * K + d] += double(Kg[r * K + d]) * dkg;
        }
      }
      if (!per_channel)
        scalar_gram_backward(Kc.data(), Kc.data(), G.data(), n, K, p.decay, dA.data(), dK.data(), dK.data(),
                             dG.data(), tX.data(), tY.data());
    } else {
      for (int64_t i = 0; i < n * V; ++i) dV[i] += dVn[i];
    }
    // Both per-channel grams at once (they share the pairwise exps of the diagonal blocks).
    if (per_channel)
      perchannel_grams_backward(n, dO ? dAqk.data() : nullptr, p.write == Write::Delta ? dA.data() : nullptr);
    // Kd = exp(G_last − G) ⊙ K.
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < K; ++d) {
        const float kd = Kd[i * K + d] * dKd[i * K + d];
        dK[i * K + d] += eGd[i * K + d] * dKd[i * K + d];
        dG[i * K + d] -= kd;
        dGl[d] += kd;
      }
    for (int64_t d = 0; d < K; ++d) dG[(n - 1) * K + d] += dGl[d];
    std::copy(dS0.begin(), dS0.end(), dS);
  }
};

}  // namespace

void chunked_forward(const Problem& p, const Outputs& out) {
  const int64_t K = p.K, V = p.V, C = p.chunk;
  parallel_for(p.N * p.H, task_grain(p), [&](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    Chunk c(C, K, V);
    std::vector<float> S(K * V);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / p.H, h = task % p.H;
      const Segment seg = p.seqs[n];
      for (int64_t hv = h * p.group; hv < (h + 1) * p.group; ++hv) {
        for (int64_t i = 0; i < K * V; ++i) S[i] = p.h0 ? p.h0[p.state_off(n, hv) + i] : 0.0f;
        for (int64_t t0 = 0; t0 < seg.len; t0 += C) {
          const int64_t len = std::min(C, seg.len - t0);
          c.load(p, seg, t0, len, h, hv);
          c.intermediates(p, len, S.data(), true);
          c.output(len, S.data(), out.o + ((seg.row0 + t0) * p.HV + hv) * V, p.HV * V);
          c.advance_state(len, S.data());
        }
        if (out.ht) std::copy(S.begin(), S.end(), out.ht + p.state_off(n, hv));
      }
    }
  });
}

void chunked_backward(const Problem& p, const Grads& gr) {
  const int64_t K = p.K, V = p.V, C = p.chunk;
  parallel_for(p.N * p.H, task_grain(p), [&](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    Chunk c(C, K, V);
    std::vector<float> S(K * V), dS(K * V), starts, dV(C * V), dbeta(C);
    std::vector<double> carry(K);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / p.H, h = task % p.H;
      const Segment seg = p.seqs[n];
      const int64_t chunks = (seg.len + C - 1) / C;
      for (int64_t hv = h * p.group; hv < (h + 1) * p.group; ++hv) {
        // Forward once for the state entering each chunk.
        starts.resize(size_t(std::max<int64_t>(chunks, 1) * K * V));
        for (int64_t i = 0; i < K * V; ++i) S[i] = p.h0 ? p.h0[p.state_off(n, hv) + i] : 0.0f;
        for (int64_t ci = 0; ci < chunks; ++ci) {
          const int64_t t0 = ci * C, len = std::min(C, seg.len - t0);
          std::copy(S.begin(), S.end(), starts.begin() + ci * K * V);
          c.load(p, seg, t0, len, h, hv);
          c.intermediates(p, len, S.data(), false);
          c.advance_state(len, S.data());
        }
        for (int64_t i = 0; i < K * V; ++i) dS[i] = gr.dht ? gr.dht[p.state_off(n, hv) + i] : 0.0f;
        for (int64_t ci = chunks - 1; ci >= 0; --ci) {
          const int64_t t0 = ci * C, len = std::min(C, seg.len - t0);
          const int64_t row0 = seg.row0 + t0;
          c.load(p, seg, t0, len, h, hv);
          std::fill(dV.begin(), dV.end(), 0.0f);
          const float* dO = gr.d_o ? gr.d_o + (row0 * p.HV + hv) * V : nullptr;
          c.backward(p, len, starts.data() + ci * K * V, dO, p.HV * V, dS.data(), dV.data(), dbeta.data());
          // Scatter: dq = scale · dQs; G = cumsum(g) inside the chunk, so dg = reverse cumsum of dG.
          std::fill(carry.begin(), carry.end(), 0.0);
          for (int64_t i = len - 1; i >= 0; --i) {
            const int64_t r = row0 + i;
            float* dq = gr.dq + (r * p.H + h) * K;
            float* dk = gr.dk + (r * p.H + h) * K;
            for (int64_t d = 0; d < K; ++d) {
              dq[d] += p.scale * c.dQs[i * K + d];
              dk[d] += c.dK[i * K + d];
            }
            float* dv = gr.dv + (r * p.HV + hv) * V;
            for (int64_t j = 0; j < V; ++j) dv[j] += dV[i * V + j];
            if (p.write == Write::Delta && gr.dbeta) gr.dbeta[r * p.HV + hv] += dbeta[i];
            if (p.decay != Decay::None && gr.dg) {
              double total = 0.0;
              for (int64_t d = 0; d < K; ++d) {
                carry[d] += c.dG[i * K + d];
                total += carry[d];
                if (p.decay == Decay::PerChannel) gr.dg[(r * p.HV + hv) * K + d] += float(carry[d]);
              }
              if (p.decay == Decay::Scalar) gr.dg[r * p.HV + hv] += float(total);
            }
          }
        }
        if (gr.dh0) std::copy(dS.begin(), dS.end(), gr.dh0 + p.state_off(n, hv));
      }
    }
  });
}

}  // namespace k3::linear::detail
