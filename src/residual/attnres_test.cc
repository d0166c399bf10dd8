// AttnRes mixing operator against fla's naive_attnres (fixtures/ops/attnres.safetensors) and its
// backward against central differences of an independent double evaluation.
#include "residual/attnres.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/random.h"
#include "io/safetensors.h"

namespace k3 {
namespace {

double rel_l2(const float* x, const float* ref, int64_t n) {
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    num += (double(x[i]) - ref[i]) * (double(x[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

// Fixed names: GCC 12 warns falsely (-Wrestrict) on "literal" + std::to_string(...).
const char* const kSources[] = {"r0", "r1", "r2", "r3"};
const char* const kGrads[] = {"grad_r0", "grad_r1", "grad_r2", "grad_r3"};

TEST(AttnRes, MatchesFixture) {
  SafeTensors st = SafeTensors::open(std::string(K3_SHARED_DIR) + "/fixtures/ops/attnres.safetensors");
  const Tensor query = st.get_f32("query");  // [D]
  const Tensor rmsw = st.get_f32("rmsw");    // [D]
  std::vector<Tensor> src;                   // 4 × [B, T, D]
  std::vector<const float*> ptrs;
  for (int j = 0; j < 4; ++j) {
    src.push_back(st.get_f32(kSources[j]));
    ptrs.push_back(src.back().f32());
  }
  const int64_t D = query.numel();
  const AttnResShape s{src[0].numel() / D, D};
  Tensor o = Tensor::empty(src[0].shape());
  attnres_forward(ptrs, query.f32(), rmsw.f32(), 1e-5f, o.f32(), s);
  EXPECT_LE(rel_l2(o.f32(), st.get_f32("o").f32(), o.numel()), 1e-4);

  std::vector<Tensor> dsrc;
  std::vector<float*> dptrs;
  for (const Tensor& r : src) {
    dsrc.push_back(Tensor::zeros(r.shape()));
    dptrs.push_back(dsrc.back().f32());
  }
  Tensor dq = Tensor::zeros({D}), dw = Tensor::zeros({D});
  attnres_backward(ptrs, query.f32(), rmsw.f32(), 1e-5f, st.get_f32("do").f32(), dptrs, dq.f32(), dw.f32(), s);
  EXPECT_LE(rel_l2(dq.f32(), st.get_f32("grad_query").f32(), D), 1e-4);
  EXPECT_LE(rel_l2(dw.f32(), st.get_f32("grad_rmsw").f32(), D), 1e-4);
  for (int j = 0; j < 4; ++j) {
        EXPECT_LE(rel_l2(dsrc[j].f32(), st.get_f32(kGrads[j]).f32(), dsrc[j].numel()), 1e-4) << j;
  }
}

// Σ do·o in double, straight from the formula of spec §10.3.
double attnres_loss(const std::vector<std::vector<double>>& src, const std::vector<double>& query,
                    const std::vector<double>& rmsw, const std::vector<float>& d_o, int64_t rows, int64_t D) {
  double L = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> s(src.size());
    double mx = -1e300, total = 0.0;
    for (size_t j = 0; j < src.size(); ++j) {
      double ss = 0.0, dot = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        ss += src[j][r * D + d] * src[j][r * D + d];
        dot += rmsw[d] * query[d] * src[j][r * D + d];
      }
      s[j] = dot / std::sqrt(ss / D + 1e-5);
      mx = std::max(mx, s[j]);
    }
    for (double& v : s) total += (v = std::exp(v - mx));
    for (int64_t d = 0; d < D; ++d) {
      double o = 0.0;
      for (size_t j = 0; j < src.size(); ++j) o += s[j] / total * src[j][r * D + d];
      L += o * d_o[r * D + d];
    }
  }
  return L;
}

TEST(AttnRes, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 3, D = 6, J = 3;
  Rng rng(9);
  std::vector<std::vector<float>> src(J, std::vector<float>(rows * D));
  std::vector<float> query(D), rmsw(D), d_o(rows * D);
  for (auto& v : src)
    for (auto& x : v) x = rng.normal();
  for (auto& x : query) x = rng.normal();
  for (auto& x : rmsw) x = 1.0f + 0.3f * rng.normal();
  for (auto& x : d_o) x = rng.normal();
  std::vector<const float*> ptrs;
  std::vector<std::vector<float>> dsrc(J, std::vector<float>(rows * D, 0.0f));
  std::vector<float*> dptrs;
  for (int64_t j = 0; j < J; ++j) {
    ptrs.push_back(src[j].data());
    dptrs.push_back(dsrc[j].data());
  }
  std::vector<float> dq(D, 0.0f), dw(D, 0.0f);
  attnres_backward(ptrs, query.data(), rmsw.data(), 1e-5f, d_o.data(), dptrs, dq.data(), dw.data(), {rows, D});

  std::vector<std::vector<double>> sd;
  for (auto& v : src) sd.emplace_back(v.begin(), v.end());
  std::vector<double> qd(query.begin(), query.end()), wd(rmsw.begin(), rmsw.end());
  auto fd_check = [&](std::vector<double>& p, const std::vector<float>& analytic, const char* name, int64_t index) {
    std::vector<float> fd(p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      const double keep = p[i];
      p[i] = keep + 1e-6;
      const double up = attnres_loss(sd, qd, wd, d_o, rows, D);
      p[i] = keep - 1e-6;
      const double down = attnres_loss(sd, qd, wd, d_o, rows, D);
      p[i] = keep;
      fd[i] = float((up - down) / 2e-6);
    }
    EXPECT_LE(rel_l2(analytic.data(), fd.data(), int64_t(fd.size())), 1e-4) << name << " " << index;
  };
  fd_check(qd, dq, "query", 0);
  fd_check(wd, dw, "rmsw", 0);
  for (int64_t j = 0; j < J; ++j) fd_check(sd[j], dsrc[j], "source", j);
}

}  // namespace
}  // namespace k3
