#include "residual/attnres.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/parallel.h"

namespace k3 {
namespace {

constexpr int64_t kRowGrain = 32;

// Per-token scores: inv_rms[j] = 1/sqrt(mean(v_j²) + eps), u[j] = Σ_d w[d] v_j[d] with
// w = rmsw ⊙ query, p = softmax(inv_rms ⊙ u).
void scores(const std::vector<const float*>& src, const std::vector<double>& w, float eps, int64_t row, int64_t D,
            std::vector<double>& inv_rms, std::vector<double>& u, std::vector<double>& p) {
  const size_t J = src.size();
  double mx = -INFINITY;
  for (size_t j = 0; j < J; ++j) {
    const float* v = src[j] + row * D;
    double ss = 0.0, dot = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      ss += double(v[d]) * v[d];
      dot += w[d] * v[d];
    }
    inv_rms[j] = 1.0 / std::sqrt(ss / double(D) + double(eps));
    u[j] = dot;
    p[j] = inv_rms[j] * dot;
    mx = std::max(mx, p[j]);
  }
  double total = 0.0;
  for (size_t j = 0; j < J; ++j) total += (p[j] = std::exp(p[j] - mx));
  for (size_t j = 0; j < J; ++j) p[j] /= total;
}

std::vector<double> effective_query(const float* query, const float* rmsw, int64_t D) {
  std::vector<double> w(D);
  for (int64_t d = 0; d < D; ++d) w[d] = double(rmsw[d]) * query[d];
  return w;
}

}  // namespace

void attnres_forward(const std::vector<const float*>& sources, const float* query, const float* rmsw, float eps,
                     float* o, AttnResShape s) {
  if (sources.empty()) throw error("attnres", "needs at least one source");
  const size_t J = sources.size();
  const std::vector<double> w = effective_query(query, rmsw, s.D);
  parallel_for(s.rows, kRowGrain, [&](int64_t r0, int64_t r1) {  // rows are independent
    std::vector<double> inv_rms(J), u(J), p(J);
    for (int64_t r = r0; r < r1; ++r) {
      scores(sources, w, eps, r, s.D, inv_rms, u, p);
      for (int64_t d = 0; d < s.D; ++d) {
        double acc = 0.0;
        for (size_t j = 0; j < J; ++j) acc += p[j] * sources[j][r * s.D + d];
        o[r * s.D + d] = float(acc);
      }
    }
  });
}

// With c_j = Σ_d do[d] v_j[d]: ds_j = p_j (c_j − Σ_i p_i c_i). s_j = ρ_j u_j with
// ρ_j = (mean(v_j²) + eps)^{-1/2}, so du_j = ds_j ρ_j, dρ_j = ds_j u_j and ∂ρ_j/∂v_j = −ρ_j³ v_j / D.
// dv_j = p_j do + du_j w − dρ_j ρ_j³ v_j / D;  dw = Σ_j du_j v_j → dquery = dw ⊙ rmsw, drmsw = dw ⊙ query.
void attnres_backward(const std::vector<const float*>& sources, const float* query, const float* rmsw, float eps,
                      const float* d_o, const std::vector<float*>& dsources, float* dquery, float* drmsw,
                      AttnResShape s) {
  const size_t J = sources.size();
  K3_CHECK(dsources.size() == J);
  const int64_t D = s.D;
  const std::vector<double> w = effective_query(query, rmsw, D);
  // Rows in parallel (each writes its own rows of dv); du per (row, source) is kept so that dw,
  // a sum over rows, is accumulated afterwards in row order, as a serial loop would.
  std::vector<double> du_all(size_t(s.rows) * J), dw(D, 0.0);
  parallel_for(s.rows, kRowGrain, [&](int64_t r0, int64_t r1) {
    std::vector<double> inv_rms(J), u(J), p(J), c(J);
    for (int64_t r = r0; r < r1; ++r) {
      scores(sources, w, eps, r, D, inv_rms, u, p);
      const float* dy = d_o + r * D;
      double mean_c = 0.0;
      for (size_t j = 0; j < J; ++j) {
        const float* v = sources[j] + r * D;
        double acc = 0.0;
        for (int64_t d = 0; d < D; ++d) acc += double(dy[d]) * v[d];
        c[j] = acc;
        mean_c += p[j] * acc;
      }
      for (size_t j = 0; j < J; ++j) {
        const float* v = sources[j] + r * D;
        const double ds = p[j] * (c[j] - mean_c);
        const double du = ds * inv_rms[j];
        const double drho = ds * u[j];
        const double k = drho * inv_rms[j] * inv_rms[j] * inv_rms[j] / double(D);
        if (float* dv = dsources[j] ? dsources[j] + r * D : nullptr)
          for (int64_t d = 0; d < D; ++d) dv[d] += float(p[j] * dy[d] + du * w[d] - k * v[d]);
        du_all[size_t(r) * J + j] = du;
      }
    }
  });
  for (int64_t r = 0; r < s.rows; ++r)
    for (size_t j = 0; j < J; ++j) {
      const float* v = sources[j] + r * D;
      const double du = du_all[size_t(r) * J + j];
      for (int64_t d = 0; d < D; ++d) dw[d] += du * v[d];
    }
  for (int64_t d = 0; d < D; ++d) {
    if (dquery) dquery[d] += float(dw[d] * rmsw[d]);
    if (drmsw) drmsw[d] += float(dw[d] * query[d]);
  }
}

}  // namespace k3
