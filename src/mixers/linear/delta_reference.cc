// The plain recurrent reference of the delta-rule family: one token at a time, state in double.
// Forward follows fla's naive_recurrent_* order (spec §0, §4, §5.1): decay the old state, then
// write, then read. Backward walks the tokens in reverse, carrying the state adjoint dS (README.md,
// "Backward"). It keeps every pre-decay state S_{t-1}, so it is for tests, not for long sequences.
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "mixers/linear/delta_internal.h"

namespace k3::linear::detail {
namespace {

// Per-channel multiplier exp(g_t[d]) of row r (all equal for a scalar gate, 1 without decay).
void decay_factors(const Problem& p, int64_t r, int64_t hv, std::vector<double>& a) {
  for (int64_t d = 0; d < p.K; ++d) a[d] = std::exp(double(p.g_at(r, hv, d)));
}

}  // namespace

void reference_forward(const Problem& p, const Outputs& out) {
  const int64_t K = p.K, V = p.V;
  parallel_for(p.N * p.H, task_grain(p), [&](int64_t begin, int64_t end) {
    std::vector<double> S(K * V), a(K), delta(V), qs(K);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / p.H, h = task % p.H;
      const Segment seg = p.seqs[n];
      for (int64_t hv = h * p.group; hv < (h + 1) * p.group; ++hv) {
        for (int64_t i = 0; i < K * V; ++i) S[i] = p.h0 ? p.h0[p.state_off(n, hv) + i] : 0.0;
        for (int64_t t = 0; t < seg.len; ++t) {
          const int64_t r = seg.row0 + t;
          const float* q = p.q_row(r, h);  // [K]
          const float* k = p.k_row(r, h);  // [K]
          const float* v = p.v_row(r, hv);  // [V]
          decay_factors(p, r, hv, a);
          for (int64_t d = 0; d < K; ++d)
            for (int64_t j = 0; j < V; ++j) S[d * V + j] *= a[d];
          // δ = β (v − Sᵀk) for the delta rule, δ = v for the additive write.
          const double beta = p.beta_at(r, hv);
          for (int64_t j = 0; j < V; ++j) {
            double u = 0.0;
            if (p.write == Write::Delta)
              for (int64_t d = 0; d < K; ++d) u += S[d * V + j] * k[d];
            delta[j] = p.write == Write::Delta ? beta * (v[j] - u) : double(v[j]);
          }
          for (int64_t d = 0; d < K; ++d)
            for (int64_t j = 0; j < V; ++j) S[d * V + j] += double(k[d]) * delta[j];
          for (int64_t d = 0; d < K; ++d) qs[d] = double(p.scale) * q[d];
          float* o = out.o + (r * p.HV + hv) * V;  // [V]
          for (int64_t j = 0; j < V; ++j) {
            double acc = 0.0;
            for (int64_t d = 0; d < K; ++d) acc += S[d * V + j] * qs[d];
            o[j] = float(acc);
          }
        }
        if (out.ht)
          for (int64_t i = 0; i < K * V; ++i) out.ht[p.state_off(n, hv) + i] = float(S[i]);
      }
    }
  });
}

void reference_backward(const Problem& p, const Grads& gr) {
  const int64_t K = p.K, V = p.V;
  parallel_for(p.N * p.H, task_grain(p), [&](int64_t begin, int64_t end) {
    std::vector<double> S(K * V), Sd(K * V), dS(K * V), a(K), u(V), delta(V), ddelta(V), du(V);
    std::vector<double> hist;  // pre-decay states S_{t-1}, [len, K, V]
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / p.H, h = task % p.H;
      const Segment seg = p.seqs[n];
      for (int64_t hv = h * p.group; hv < (h + 1) * p.group; ++hv) {
        // Forward again, keeping S_{t-1} of every step.
        hist.assign(size_t(seg.len * K * V), 0.0);
        for (int64_t i = 0; i < K * V; ++i) S[i] = p.h0 ? p.h0[p.state_off(n, hv) + i] : 0.0;
        for (int64_t t = 0; t < seg.len; ++t) {
          const int64_t r = seg.row0 + t;
          const float* k = p.k_row(r, h);
          const float* v = p.v_row(r, hv);
          std::copy(S.begin(), S.end(), hist.begin() + t * K * V);
          decay_factors(p, r, hv, a);
          for (int64_t d = 0; d < K; ++d)
            for (int64_t j = 0; j < V; ++j) S[d * V + j] *= a[d];
          const double beta = p.beta_at(r, hv);
          for (int64_t j = 0; j < V; ++j) {
            double uj = 0.0;
            if (p.write == Write::Delta)
              for (int64_t d = 0; d < K; ++d) uj += S[d * V + j] * k[d];
            delta[j] = p.write == Write::Delta ? beta * (v[j] - uj) : double(v[j]);
          }
          for (int64_t d = 0; d < K; ++d)
            for (int64_t j = 0; j < V; ++j) S[d * V + j] += double(k[d]) * delta[j];
        }
        for (int64_t i = 0; i < K * V; ++i) dS[i] = gr.dht ? gr.dht[p.state_off(n, hv) + i] : 0.0;
        // Reverse sweep: dS is the adjoint of S_t on entry and of S_{t-1} on exit.
        for (int64_t t = seg.len - 1; t >= 0; --t) {
          const int64_t r = seg.row0 + t;
          const float* q = p.q_row(r, h);
          const float* k = p.k_row(r, h);
          const float* v = p.v_row(r, hv);
          const double* Sprev = hist.data() + t * K * V;
          decay_factors(p, r, hv, a);
          const double beta = p.beta_at(r, hv);
          for (int64_t d = 0; d < K; ++d)
            for (int64_t j = 0; j < V; ++j) Sd[d * V + j] = a[d] * Sprev[d * V + j];
          for (int64_t j = 0; j < V; ++j) {
            double uj = 0.0;
            if (p.write == Write::Delta)
              for (int64_t d = 0; d < K; ++d) uj += Sd[d * V + j] * k[d];
            u[j] = uj;
            delta[j] = p.write == Write::Delta ? beta * (v[j] - uj) : double(v[j]);
          }
          // S_t = Sd + k δᵀ; o_t = S_tᵀ (s q_t).
          const float* dout = gr.d_o ? gr.d_o + (r * p.HV + hv) * V : nullptr;  // [V]
          if (dout) {
            float* dq = gr.dq + (r * p.H + h) * K;
            for (int64_t d = 0; d < K; ++d) {
              double acc = 0.0;
              for (int64_t j = 0; j < V; ++j) acc += (Sd[d * V + j] + double(k[d]) * delta[j]) * dout[j];
              dq[d] += float(p.scale * acc);
              const double qs = double(p.scale) * q[d];
              for (int64_t j = 0; j < V; ++j) dS[d * V + j] += qs * dout[j];
            }
          }
          float* dk = gr.dk + (r * p.H + h) * K;
          for (int64_t j = 0; j < V; ++j) {
            double acc = 0.0;
            for (int64_t d = 0; d < K; ++d) acc += dS[d * V + j] * k[d];
            ddelta[j] = acc;
          }
          for (int64_t d = 0; d < K; ++d) {
            double acc = 0.0;
            for (int64_t j = 0; j < V; ++j) acc += dS[d * V + j] * delta[j];
            dk[d] += float(acc);
          }
          float* dv = gr.dv + (r * p.HV + hv) * V;
          if (p.write == Write::Delta) {
            // δ = β (v − Sdᵀk): dv = β dδ, dβ = dδ·(v − u), du = −β dδ → dSd += k duᵀ, dk += Sd du.
            double dbeta = 0.0;
            for (int64_t j = 0; j < V; ++j) {
              dv[j] += float(beta * ddelta[j]);
              dbeta += ddelta[j] * (v[j] - u[j]);
              du[j] = -beta * ddelta[j];
            }
            if (gr.dbeta) gr.dbeta[r * p.HV + hv] += float(dbeta);
            for (int64_t d = 0; d < K; ++d) {
              double acc = 0.0;
              for (int64_t j = 0; j < V; ++j) {
                acc += Sd[d * V + j] * du[j];
                dS[d * V + j] += double(k[d]) * du[j];
              }
              dk[d] += float(acc);
            }
          } else {
            for (int64_t j = 0; j < V; ++j) dv[j] += float(ddelta[j]);
          }
          // Sd = diag(a) S_{t-1}: dg[d] = Σ_j dSd[d,j] Sd[d,j]; dS_{t-1} = diag(a) dSd.
          if (p.decay != Decay::None && gr.dg) {
            double total = 0.0;
            for (int64_t d = 0; d < K; ++d) {
              double acc = 0.0;
              for (int64_t j = 0; j < V; ++j) acc += dS[d * V + j] * Sd[d * V + j];
              if (p.decay == Decay::PerChannel) gr.dg[(r * p.HV + hv) * K + d] += float(acc);
              total += acc;
            }
            if (p.decay == Decay::Scalar) gr.dg[r * p.HV + hv] += float(total);
          }
          for (int64_t d = 0; d < K; ++d)
            for (int64_t j = 0; j < V; ++j) dS[d * V + j] *= a[d];
        }
        if (gr.dh0)
          for (int64_t i = 0; i < K * V; ++i) gr.dh0[p.state_off(n, hv) + i] = float(dS[i]);
      }
    }
  });
}

}  // namespace k3::linear::detail
