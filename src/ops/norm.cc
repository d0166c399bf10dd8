#include "ops/norm.h"

#include <cmath>

#include "core/parallel.h"

namespace k3 {

void layernorm_forward(const float* x, const float* w, const float* b, float eps, int64_t M, int64_t D, float* y,
                       float* mean, float* rstd) {
  parallel_for(M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * D;
      float* yr = y + m * D;
      double s = 0;
      for (int64_t i = 0; i < D; ++i) s += xr[i];
      float mu = float(s / double(D));
      double v = 0;
      for (int64_t i = 0; i < D; ++i) {
        float d = xr[i] - mu;
        v += double(d) * d;
      }
      float rs = 1.0f / std::sqrt(float(v / double(D)) + eps);
      for (int64_t i = 0; i < D; ++i) yr[i] = (xr[i] - mu) * rs * w[i] + (b ? b[i] : 0.0f);
      if (mean) mean[m] = mu;
      if (rstd) rstd[m] = rs;
    }
  });
}

void layernorm_backward(const float* x, const float* w, const float* mean, const float* rstd, const float* dy,
                        int64_t M, int64_t D, float* dx, float* dw, float* db) {
  // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w. dw, db accumulate serially
  // (they are small, and accumulating in a fixed order keeps results bit-reproducible).
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * D;
    const float* dyr = dy + m * D;
    float mu = mean[m], rs = rstd[m];
    double sg = 0, sgx = 0;
    for (int64_t i = 0; i < D; ++i) {
      float xh = (xr[i] - mu) * rs;
      float g = dyr[i] * w[i];
      sg += g;
      sgx += double(g) * xh;
      if (dw) dw[i] += dyr[i] * xh;
      if (db) db[i] += dyr[i];
    }
    if (dx) {
      float mg = float(sg / double(D)), mgx = float(sgx / double(D));
      float* dxr = dx + m * D;
      for (int64_t i = 0; i < D; ++i) {
        float xh = (xr[i] - mu) * rs;
        dxr[i] += rs * (dyr[i] * w[i] - mg - xh * mgx);
      }
    }
  }
}

void rmsnorm_forward(const float* x, const float* w, float eps, int64_t M, int64_t D, float* y, float* rstd) {
  parallel_for(M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * D;
      double s = 0;
      for (int64_t i = 0; i < D; ++i) s += double(xr[i]) * xr[i];
      float rs = 1.0f / std::sqrt(float(s / double(D)) + eps);
      for (int64_t i = 0; i < D; ++i) y[m * D + i] = xr[i] * rs * (w ? w[i] : 1.0f);
      if (rstd) rstd[m] = rs;
    }
  });
}

void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t M, int64_t D,
                      float* dx, float* dw) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * D;
    const float* dyr = dy + m * D;
    float rs = rstd[m];
    double sgx = 0;
    for (int64_t i = 0; i < D; ++i) {
      float g = dyr[i] * (w ? w[i] : 1.0f);
      sgx += double(g) * xr[i];
      if (dw) dw[i] += dyr[i] * xr[i] * rs;
    }
    if (dx) {
      float c = float(sgx / double(D)) * rs * rs;
      for (int64_t i = 0; i < D; ++i) dx[m * D + i] += rs * (dyr[i] * (w ? w[i] : 1.0f) - xr[i] * c);
    }
  }
}

}  // namespace k3
