// The chunked (WY / UT) form of the delta-rule family, forward and backward (spec §3 steps 1–6,
// §4 and §5.2; derivation in README.md). One unified path: a scalar gate is a per-channel gate
// with equal channels, no decay is g = 0, and the additive write skips the UT transform
// (V_new = V). Cumulative log-decays G are kept in double and only ever exponentiated as
// differences G_r − G_s with r ≥ s (masked BEFORE exponentiating), so every exponent is ≤ 0:
// nothing overflows even when G reaches −300 inside one chunk.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "mixers/linear/delta_internal.h"
#include "ops/gemm.h"

namespace k3::linear::detail {
namespace {

enum class Diag : uint8_t { Strict, Inclusive };

bool in_mask(int64_t r, int64_t s, Diag diag) { return diag == Diag::Strict ? s < r : s <= r; }

// M[r, s] = Σ_d X[r, d] Y[s, d] exp(G[r, d] − G[s, d]) inside the causal mask, 0 outside.
// X, Y, G are [n, K]; M is [n, n]. With a scalar gate (all channels of a row equal) the gram is
// one gemm times exp(G_r − G_s); per channel the CPU reference computes each pair directly
// (spec §5.2, "A CPU reference can compute exp(G_r[d] − G_s[d]) per pair").
void decay_gram(const float* X, const float* Y, const double* G, int64_t n, int64_t K, Decay decay, Diag diag,
                float* M) {
  if (decay != Decay::PerChannel) {
    gemm(Trans::No, Trans::Yes, n, n, K, 1.0f, X, K, Y, K, 0.0f, M, n);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t s = 0; s < n; ++s) {
        float& m = M[r * n + s];
        if (!in_mask(r, s, diag))
          m = 0.0f;
        else if (decay == Decay::Scalar)
          m *= float(std::exp(G[r * K] - G[s * K]));
      }
    return;
  }
  for (int64_t r = 0; r < n; ++r)
    for (int64_t s = 0; s < n; ++s) {
      if (!in_mask(r, s, diag)) {
        M[r * n + s] = 0.0f;
        continue;
      }
      const float* x = X + r * K;
      const float* y = Y + s * K;
      const double* gr = G + r * K;
      const double* gs = G + s * K;
      float acc = 0.0f;
      for (int64_t d = 0; d < K; ++d) acc += x[d] * y[d] * std::exp(float(gr[d] - gs[d]));
      M[r * n + s] = acc;
    }
}

// Backward of decay_gram for a cotangent dM that is already zero outside the mask:
// dX[r] += Σ_s dM[r,s] e_rs ⊙ Y[s], dY[s] += Σ_r dM[r,s] e_rs ⊙ X[r], and since
// ∂e_rs/∂G_r = e_rs = −∂e_rs/∂G_s: dG += X ⊙ (this dX) − Y ⊙ (this dY). tX, tY are [n, K] scratch.
void decay_gram_backward(const float* X, const float* Y, const double* G, int64_t n, int64_t K, Decay decay,
                         float* dM, float* dX, float* dY, double* dG, float* tX, float* tY) {
  if (decay != Decay::PerChannel) {
    if (decay == Decay::Scalar)
      for (int64_t r = 0; r < n; ++r)
        for (int64_t s = 0; s <= r; ++s) dM[r * n + s] *= float(std::exp(G[r * K] - G[s * K]));
    gemm(Trans::No, Trans::No, n, K, n, 1.0f, dM, n, Y, K, 0.0f, tX, K);   // [n, K]
    gemm(Trans::Yes, Trans::No, n, K, n, 1.0f, dM, n, X, K, 0.0f, tY, K);  // [n, K]
  } else {
    std::fill(tX, tX + n * K, 0.0f);
    std::fill(tY, tY + n * K, 0.0f);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t s = 0; s <= r; ++s) {
        const float m = dM[r * n + s];
        if (m == 0.0f) continue;
        for (int64_t d = 0; d < K; ++d) {
          const float e = m * std::exp(float(G[r * K + d] - G[s * K + d]));
          tX[r * K + d] += e * Y[s * K + d];
          tY[s * K + d] += e * X[r * K + d];
        }
      }
  }
  for (int64_t i = 0; i < n * K; ++i) {
    dX[i] += tX[i];
    dY[i] += tY[i];
    if (decay != Decay::None) dG[i] += double(X[i]) * tX[i] - double(Y[i]) * tY[i];
  }
}

// T = (I + A)⁻¹ for strictly lower-triangular A [n, n] by forward substitution (spec §3).
void unit_lower_inverse(const float* A, int64_t n, float* T) {
  std::fill(T, T + n * n, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    T[i * n + i] = 1.0f;
    for (int64_t j = 0; j < i; ++j) {
      double acc = -double(A[i * n + j]);
      for (int64_t m = j + 1; m < i; ++m) acc -= double(A[i * n + m]) * T[m * n + j];
      T[i * n + j] = float(acc);
    }
  }
}

// Per-(sequence, value head) scratch for one chunk of at most C rows.
struct Chunk {
  int64_t C, K, V;
  std::vector<float> Qs, Kc, Vc, beta;        // [C, K], [C, K], [C, V], [C]
  std::vector<double> G;                      // [C, K] cumulative log-decay inside the chunk
  std::vector<float> eG, eGd, eGl;            // exp(G), exp(G_last − G) [C, K]; exp(G_last) [K]
  std::vector<float> Abar, A, T, Aqk;         // [C, C]
  std::vector<float> Kg, Kb, Vb, W, U, Vn, Qg, Kd;  // [C, K] or [C, V]
  // Backward scratch.
  std::vector<float> dVn, dAqk, dQg, dKd, dW, dT, dVb, dKb, dA, tmpCC, tX, tY, dQs, dK;
  std::vector<double> dG, dGl;

  Chunk(int64_t C_, int64_t K_, int64_t V_) : C(C_), K(K_), V(V_) {
    for (auto* b : {&Qs, &Kc, &eG, &eGd, &Kg, &Kb, &W, &Qg, &Kd, &dQg, &dKd, &dW, &dKb, &tX, &tY, &dQs, &dK})
      b->resize(C * K);
    for (auto* b : {&Vc, &Vb, &U, &Vn, &dVn, &dVb}) b->resize(C * V);
    for (auto* b : {&Abar, &A, &T, &Aqk, &dAqk, &dT, &dA, &tmpCC}) b->resize(C * C);
    beta.resize(C);
    eGl.resize(K);
    G.resize(C * K);
    dG.resize(C * K);
    dGl.resize(K);
  }

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
        G[i * K + d] = (i ? G[(i - 1) * K + d] : 0.0) + double(p.g_at(r, hv, d));
      }
      for (int64_t j = 0; j < V; ++j) Vc[i * V + j] = v[j];
      beta[i] = p.beta_at(r, hv);
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < K; ++d) {
        eG[i * K + d] = float(std::exp(G[i * K + d]));
        eGd[i * K + d] = float(std::exp(G[(n - 1) * K + d] - G[i * K + d]));
      }
    for (int64_t d = 0; d < K; ++d) eGl[d] = float(std::exp(G[(n - 1) * K + d]));
  }

  // Everything of the forward pass up to V_new (spec §5.2 steps 1–5) for state S0 [K, V].
  void intermediates(const Problem& p, int64_t n, const float* S0) {
    for (int64_t i = 0; i < n * K; ++i) {
      Kg[i] = eG[i] * Kc[i];
      Qg[i] = eG[i] * Qs[i];
      Kd[i] = eGd[i] * Kc[i];
    }
    decay_gram(Qs.data(), Kc.data(), G.data(), n, K, p.decay, Diag::Inclusive, Aqk.data());
    if (p.write == Write::Additive) {
      std::copy(Vc.begin(), Vc.begin() + n * V, Vn.begin());
      return;
    }
    decay_gram(Kc.data(), Kc.data(), G.data(), n, K, p.decay, Diag::Strict, Abar.data());
    for (int64_t r = 0; r < n; ++r)
      for (int64_t s = 0; s < n; ++s) A[r * n + s] = beta[r] * Abar[r * n + s];
    unit_lower_inverse(A.data(), n, T.data());
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t d = 0; d < K; ++d) Kb[r * K + d] = beta[r] * Kg[r * K + d];
      for (int64_t j = 0; j < V; ++j) Vb[r * V + j] = beta[r] * Vc[r * V + j];
    }
    gemm(Trans::No, Trans::No, n, K, n, 1.0f, T.data(), n, Kb.data(), K, 0.0f, W.data(), K);  // W = T Kb
    gemm(Trans::No, Trans::No, n, V, n, 1.0f, T.data(), n, Vb.data(), V, 0.0f, U.data(), V);  // U = T Vb
    std::copy(U.begin(), U.begin() + n * V, Vn.begin());
    gemm(Trans::No, Trans::No, n, V, K, -1.0f, W.data(), K, S0, V, 1.0f, Vn.data(), V);  // V_new = U − W S0
  }

  // O = Qg S0 + Aqk V_new written with row stride ldo; S ← exp(G_last) ⊙ S + Kdᵀ V_new.
  void output_and_state(int64_t n, float* S, float* O, int64_t ldo) {
    gemm(Trans::No, Trans::No, n, V, K, 1.0f, Qg.data(), K, S, V, 0.0f, O, ldo);
    gemm(Trans::No, Trans::No, n, V, n, 1.0f, Aqk.data(), n, Vn.data(), V, 1.0f, O, ldo);
    for (int64_t d = 0; d < K; ++d)
      for (int64_t j = 0; j < V; ++j) S[d * V + j] *= eGl[d];
    gemm(Trans::Yes, Trans::No, K, V, n, 1.0f, Kd.data(), K, Vn.data(), V, 1.0f, S, V);
  }

  // Backward through one chunk. S0 [K, V] is the state entering it, dO [n, V] (row stride ldo) may
  // be null, dS [K, V] holds the adjoint of the state leaving the chunk and is replaced by that of S0.
  // Accumulates into dQs, dK, dVn (as dV) and dG; returns dβ through `dbeta` [n].
  void backward(const Problem& p, int64_t n, const float* S0, const float* dO, int64_t ldo, float* dS,
                float* dV, float* dbeta) {
    intermediates(p, n, S0);
    std::fill(dQs.begin(), dQs.begin() + n * K, 0.0f);
    std::fill(dK.begin(), dK.begin() + n * K, 0.0f);
    std::fill(dG.begin(), dG.begin() + n * K, 0.0);
    // S_next = exp(G_last) ⊙ S0 + Kdᵀ V_new.
    gemm(Trans::No, Trans::No, n, V, K, 1.0f, Kd.data(), K, dS, V, 0.0f, dVn.data(), V);   // dV_new = Kd dS
    gemm(Trans::No, Trans::Yes, n, K, V, 1.0f, Vn.data(), V, dS, V, 0.0f, dKd.data(), K);  // dKd = V_new dSᵀ
    for (int64_t d = 0; d < K; ++d) {
      double acc = 0.0;
      for (int64_t j = 0; j < V; ++j) acc += double(dS[d * V + j]) * S0[d * V + j];
      dGl[d] = acc * eGl[d];
    }
    std::vector<float>& dS0 = tmpS;
    dS0.assign(dS, dS + K * V);
    for (int64_t d = 0; d < K; ++d)
      for (int64_t j = 0; j < V; ++j) dS0[d * V + j] *= eGl[d];
    // O = Qg S0 + Aqk V_new.
    if (dO) {
      gemm(Trans::Yes, Trans::No, n, V, n, 1.0f, Aqk.data(), n, dO, ldo, 1.0f, dVn.data(), V);
      gemm(Trans::No, Trans::Yes, n, n, V, 1.0f, dO, ldo, Vn.data(), V, 0.0f, dAqk.data(), n);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t s = r + 1; s < n; ++s) dAqk[r * n + s] = 0.0f;
      gemm(Trans::No, Trans::Yes, n, K, V, 1.0f, dO, ldo, S0, V, 0.0f, dQg.data(), K);       // dQg = dO S0ᵀ
      gemm(Trans::Yes, Trans::No, K, V, n, 1.0f, Qg.data(), K, dO, ldo, 1.0f, dS0.data(), V);  // += Qgᵀ dO
      decay_gram_backward(Qs.data(), Kc.data(), G.data(), n, K, p.decay, dAqk.data(), dQs.data(), dK.data(),
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
      decay_gram_backward(Kc.data(), Kc.data(), G.data(), n, K, p.decay, dA.data(), dK.data(), dK.data(), dG.data(),
                          tX.data(), tY.data());
    } else {
      for (int64_t i = 0; i < n * V; ++i) dV[i] += dVn[i];
    }
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

  std::vector<float> tmpS;
};

}  // namespace

void chunked_forward(const Problem& p, const Outputs& out) {
  const int64_t K = p.K, V = p.V, C = p.chunk;
  parallel_for(p.N * p.H, task_grain(p), [&](int64_t begin, int64_t end) {
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
          c.intermediates(p, len, S.data());
          c.output_and_state(len, S.data(), out.o + ((seg.row0 + t0) * p.HV + hv) * V, p.HV * V);
        }
        if (out.ht) std::copy(S.begin(), S.end(), out.ht + p.state_off(n, hv));
      }
    }
  });
}

void chunked_backward(const Problem& p, const Grads& gr) {
  const int64_t K = p.K, V = p.V, C = p.chunk;
  parallel_for(p.N * p.H, task_grain(p), [&](int64_t begin, int64_t end) {
    Chunk c(C, K, V);
    std::vector<float> S(K * V), dS(K * V), starts, scratch_o(C * V), dV(C * V), dbeta(C);
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
          c.intermediates(p, len, S.data());
          c.output_and_state(len, S.data(), scratch_o.data(), V);
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
          std::vector<double> carry(K, 0.0);
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
