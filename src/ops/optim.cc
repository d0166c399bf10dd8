#include "ops/optim.h"

#include <cmath>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/ops_cuda.h"

namespace k3 {

void adamw_update(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWHyper& h) {
  K3_CHECK(w.dtype() == DType::F32 && g.device() == w.device() && m.device() == w.device() && v.device() == w.device() &&
               g.numel() == w.numel() && m.numel() == w.numel() && v.numel() == w.numel(),
           "adamw: parameter ", w.describe(), ", gradient ", g.describe(), ", moments ", m.describe(), " ",
           v.describe());
  if (w.device() == Device::CUDA) {
    if constexpr (device::kCudaBuilt)
      cuda::adamw(w.cuda_f32(), g.cuda_f32(), m.cuda_f32(), v.cuda_f32(), w.numel(),
                  cuda::AdamWStep{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step});
    return;
  }
  const float b1 = h.beta1, b2 = h.beta2, lr = h.lr, eps = h.eps, wd = h.weight_decay;
  const double c1 = 1.0 - std::pow(double(b1), double(h.step)), c2 = 1.0 - std::pow(double(b2), double(h.step));
  float* pw = w.f32();
  const float* pg = g.f32();
  float* pm = m.f32();
  float* pv = v.f32();
  parallel_for(w.numel(), 1 << 14, [&](int64_t i0, int64_t i1) {  // elementwise: any split, same values
    for (int64_t i = i0; i < i1; ++i) {
      pm[i] = b1 * pm[i] + (1 - b1) * pg[i];
      pv[i] = b2 * pv[i] + (1 - b2) * pg[i] * pg[i];
      double mhat = pm[i] / c1, vhat = pv[i] / c2;
      pw[i] -= lr * float(mhat / (std::sqrt(vhat) + eps) + wd * pw[i]);
    }
  });
}

void SquareSum::add(const Tensor& g) {
  if (g.device() == Device::CUDA) {
    if constexpr (device::kCudaBuilt) {
      if (!device_.get()) device_ = device::zeros_f32(2);
      cuda::sum_squares(g.cuda_f32(), g.numel(), device_.as<double>());
    }
    return;
  }
  const float* p = g.f32();
  for (int64_t i = 0, n = g.numel(); i < n; ++i) host_ += double(p[i]) * p[i];
}

double SquareSum::total() const {
  double d = 0;
  if (device_.get()) device::download(&d, device_.get(), sizeof d);
  return host_ + d;
}

void scale_inplace(const Tensor& t, float s) {
  if (t.device() == Device::CUDA) {
    if constexpr (device::kCudaBuilt) cuda::unary(t.cuda_f32(), t.cuda_f32(), t.numel(), cuda::Unary::Scale, s);
    return;
  }
  float* p = t.f32();
  for (int64_t i = 0, n = t.numel(); i < n; ++i) p[i] *= s;
}

}  // namespace k3
