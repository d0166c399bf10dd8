#include "ops/norm.h"

#include <cmath>

#include "core/error.h"
#include "core/parallel.h"
#if defined(K3_HAS_CUDA)
#include "ops/ops_cuda.h"
#endif

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

namespace norm {

namespace {
int64_t last(const Tensor& t) { return t.ndim() ? t.dim(-1) : 1; }
float* host(const Tensor& t) { return t.defined() ? t.f32() : nullptr; }
// x's device, every defined tensor on it (the kernels check dtypes and contiguity through f32()).
Device device_of(const char* op, const Tensor& x, std::initializer_list<const Tensor*> others) {
  for (const Tensor* t : others)
    if (t->defined() && t->device() != x.device())
      throw error(op, x.describe(), " is on ", device_words(x.device()), " but ", t->describe(), " is on ",
                  device_words(t->device()));
  if (!x.is_contiguous()) throw error(op, "non-contiguous input ", x.describe());
  return x.device();
}
#if defined(K3_HAS_CUDA)
float* dev(const Tensor& t) { return t.defined() ? t.cuda_f32() : nullptr; }
#endif
}  // namespace

void layernorm(const Tensor& x, const Tensor& w, const Tensor& b, float eps, const Tensor& y, const Tensor& stats) {
  const int64_t D = last(x), M = x.numel() / std::max<int64_t>(1, D);
  if (device_of("layernorm", x, {&w, &b, &y, &stats}) == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    float* st = dev(stats);
    return cuda::layernorm_forward(x.cuda_f32(), w.cuda_f32(), dev(b), eps, M, D, y.cuda_f32(), st,
                                   st ? st + M : nullptr, device::Storage::F32);
#endif
  }
  float* st = host(stats);
  layernorm_forward(x.f32(), w.f32(), host(b), eps, M, D, y.f32(), st, st ? st + M : nullptr);
}

void layernorm_backward(const Tensor& x, const Tensor& w, const Tensor& stats, const Tensor& dy, const Tensor& dx,
                        const Tensor& dw, const Tensor& db) {
  const int64_t D = last(x), M = x.numel() / std::max<int64_t>(1, D);
  if (device_of("layernorm", x, {&w, &stats, &dy, &dx, &dw, &db}) == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    return cuda::layernorm_backward(x.cuda_f32(), w.cuda_f32(), stats.cuda_f32(), stats.cuda_f32() + M, dy.cuda_f32(),
                                    M, D, dev(dx), dev(dw), dev(db), device::Storage::F32, /*accumulate=*/true);
#endif
  }
  ::k3::layernorm_backward(x.f32(), w.f32(), stats.f32(), stats.f32() + M, dy.f32(), M, D, host(dx), host(dw), host(db));
}

void rmsnorm(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd) {
  const int64_t D = last(x), M = x.numel() / std::max<int64_t>(1, D);
  if (device_of("rmsnorm", x, {&w, &y, &rstd}) == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    if (!w.defined()) return cuda::gated_rmsnorm_groups(x.cuda_f32(), nullptr, nullptr, y.cuda_f32(), M, D, eps, 0);
    return cuda::rmsnorm_forward(x.cuda_f32(), w.cuda_f32(), eps, M, D, y.cuda_f32(), dev(rstd), device::Storage::F32);
#endif
  }
  rmsnorm_forward(x.f32(), host(w), eps, M, D, y.f32(), host(rstd));
}

void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, float eps, const Tensor& dy,
                      const Tensor& dx, const Tensor& dw) {
  const int64_t D = last(x), M = x.numel() / std::max<int64_t>(1, D);
  if (device_of("rmsnorm", x, {&w, &rstd, &dy, &dx, &dw}) == Device::CUDA) {
#if defined(K3_HAS_CUDA)
    if (!w.defined())
      return cuda::gated_rmsnorm_groups_backward(x.cuda_f32(), nullptr, nullptr, dy.cuda_f32(), dev(dx), nullptr,
                                                 nullptr, M, D, eps, 0);
    // The kernel writes dx: into scratch, then added.
    Tensor g = dx.defined() ? Tensor::empty_on(Device::CUDA, x.shape()) : Tensor();
    cuda::rmsnorm_backward(x.cuda_f32(), w.cuda_f32(), rstd.cuda_f32(), dy.cuda_f32(), M, D, dev(g), dev(dw),
                           device::Storage::F32);
    if (dx.defined()) cuda::add_inplace(dx.cuda_f32(), g.cuda_f32(), x.numel());
    return;
#endif
  }
  ::k3::rmsnorm_backward(x.f32(), host(w), rstd.f32(), dy.f32(), M, D, host(dx), host(dw));
}

}  // namespace norm

}  // namespace k3
