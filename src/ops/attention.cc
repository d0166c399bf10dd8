#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/fastmath.h"
#include "core/parallel.h"
#include "ops/gemm.h"

namespace k3 {

namespace {

// Softmax over row[0..n) in place; entries past n are zeroed (masked).
void causal_softmax_row(float* row, int64_t n, int64_t total) {
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
  exp_array(row, row, n, mx);
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += row[j];
  float inv = float(1.0 / sum);
  for (int64_t j = 0; j < n; ++j) row[j] *= inv;
  for (int64_t j = n; j < total; ++j) row[j] = 0.0f;
}

// One query token (decode): per-head loops, parallel over heads.
void attention_one_query(const HeadView& q, const HeadView& k, const HeadView& v, const HeadView& y,
                         const AttentionShape& s, float* probs) {
  const int64_t n = s.pos0 + 1;
  parallel_for(s.H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> local(probs ? 0 : size_t(s.S));
    for (int64_t h = h0; h < h1; ++h) {
      float* p = probs ? probs + h * s.S : local.data();
      const float* qh = q.at(0, h);
      for (int64_t j = 0; j < n; ++j) {
        const float* kj = k.at(j, h);
        float d = 0;
        for (int64_t i = 0; i < s.hd; ++i) d += qh[i] * kj[i];
        p[j] = d * s.scale;
      }
      causal_softmax_row(p, n, probs ? s.S : n);
      float* yh = y.at(0, h);
      const int64_t dv = s.vd();
      for (int64_t i = 0; i < dv; ++i) yh[i] = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        const float* vj = v.at(j, h);
        float pj = p[j];
        for (int64_t i = 0; i < dv; ++i) yh[i] += pj * vj[i];
      }
    }
  });
}

}  // namespace

void attention_forward(const HeadView& q, const HeadView& k, const HeadView& v, const HeadView& y,
                       const AttentionShape& s, float* probs) {
  if (s.Tq == 1) return attention_one_query(q, k, v, y, s, probs);
  const int64_t S = s.pos0 + s.Tq;  // keys in play
  std::vector<float> scratch(probs ? 0 : size_t(s.Tq * S));
  for (int64_t h = 0; h < s.H; ++h) {
    float* P = probs ? probs + h * s.Tq * s.S : scratch.data();
    const int64_t ldp = probs ? s.S : S;
    // P[Tq, S] = scale * Q_h K_hᵀ (BLAS reads the strided heads directly)
    gemm(Trans::No, Trans::Yes, s.Tq, S, s.hd, s.scale, q.at(0, h), q.token_stride, k.at(0, h), k.token_stride, 0.0f,
         P, ldp);
    parallel_for(s.Tq, 32, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) causal_softmax_row(P + i * ldp, s.pos0 + i + 1, ldp);
    });
    // Y_h[Tq, hd] = P V_h
    gemm(Trans::No, Trans::No, s.Tq, s.vd(), S, 1.0f, P, ldp, v.at(0, h), v.token_stride, 0.0f, y.at(0, h),
         y.token_stride);
  }
}

void attention_backward(const HeadView& q, const HeadView& k, const HeadView& v, const float* probs,
                        const HeadView& dy, const HeadView& dq, const HeadView& dk, const HeadView& dv,
                        const AttentionShape& s) {
  const int64_t S = s.pos0 + s.Tq;
  std::vector<float> dP(size_t(s.Tq * S));
  for (int64_t h = 0; h < s.H; ++h) {
    const float* P = probs + h * s.Tq * s.S;
    // dV_h += Pᵀ dY_h
    gemm(Trans::Yes, Trans::No, S, s.vd(), s.Tq, 1.0f, P, s.S, dy.at(0, h), dy.token_stride, 1.0f, dv.at(0, h),
         dv.token_stride);
    // dP = dY_h V_hᵀ
    gemm(Trans::No, Trans::Yes, s.Tq, S, s.vd(), 1.0f, dy.at(0, h), dy.token_stride, v.at(0, h), v.token_stride, 0.0f,
         dP.data(), S);
    // dScore = P ⊙ (dP - rowsum(dP ⊙ P)), times scale
    parallel_for(s.Tq, 32, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        const float* pr = P + i * s.S;
        float* dr = dP.data() + i * S;
        double dot = 0;
        for (int64_t j = 0; j < S; ++j) dot += double(pr[j]) * dr[j];
        for (int64_t j = 0; j < S; ++j) dr[j] = pr[j] * (dr[j] - float(dot)) * s.scale;
      }
    });
    // dQ_h += dS K_h ; dK_h += dSᵀ Q_h
    gemm(Trans::No, Trans::No, s.Tq, s.hd, S, 1.0f, dP.data(), S, k.at(0, h), k.token_stride, 1.0f, dq.at(0, h),
         dq.token_stride);
    gemm(Trans::Yes, Trans::No, S, s.hd, s.Tq, 1.0f, dP.data(), S, q.at(0, h), q.token_stride, 1.0f, dk.at(0, h),
         dk.token_stride);
  }
}

}  // namespace k3
