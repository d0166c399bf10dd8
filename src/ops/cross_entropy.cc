#include "ops/cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "core/device.h"
#include "core/fastmath.h"
#include "core/parallel.h"
#include "ops/gemm.h"

namespace k3::cross_entropy {

double forward(const Tensor& h, const Tensor& w, const std::vector<int64_t>& targets, int64_t vc, float z_loss,
               bool bf16, Saved& saved) {
  if constexpr (device::kCudaBuilt)
    if (h.device() == Device::CUDA) return cross_entropy_cuda::forward(h, w, targets, z_loss, bf16, saved);
  const int64_t N = h.dim(0), D = h.dim(1), V = w.dim(0);
  saved.lse.assign(size_t(N), 0.0f);
  std::vector<float> mx(size_t(N), -INFINITY), se(size_t(N), 0.0f), tgt(size_t(N), 0.0f);
  std::vector<float> chunk(size_t(N * std::min(vc, V)));
  // Online log-sum-exp over vocabulary chunks.
  for (int64_t v0 = 0; v0 < V; v0 += vc) {
    const int64_t n = std::min(vc, V - v0);
    gemm(Trans::No, Trans::Yes, N, n, D, 1.0f, h.f32(), D, w.f32() + v0 * D, D, 0.0f, chunk.data(), n);
    parallel_for(N, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* row = chunk.data() + r * n;
        const int64_t t = targets[size_t(r)];
        if (t >= v0 && t < v0 + n) tgt[size_t(r)] = row[t - v0];
        float m = mx[size_t(r)];
        for (int64_t j = 0; j < n; ++j) m = std::max(m, row[j]);
        exp_array(row, row, n, m);  // the row is scratch from here on
        float s = se[size_t(r)] * std::exp(mx[size_t(r)] - m);
        for (int64_t j = 0; j < n; ++j) s += row[j];
        mx[size_t(r)] = m;
        se[size_t(r)] = s;
      }
    });
  }
  double loss = 0;
  for (int64_t r = 0; r < N; ++r) {
    const float l = mx[size_t(r)] + std::log(se[size_t(r)]);
    saved.lse[size_t(r)] = l;
    if (targets[size_t(r)] >= 0) loss += l - tgt[size_t(r)] + double(z_loss) * l * l;
  }
  return loss;
}

void backward(const Tensor& h, const Tensor& w, const std::vector<int64_t>& targets, int64_t vc, float z_loss,
              bool bf16, const Saved& saved, float g, const Tensor& dh, const Tensor& dw) {
  if constexpr (device::kCudaBuilt)
    if (h.device() == Device::CUDA) return cross_entropy_cuda::backward(h, w, z_loss, bf16, saved, g, dh, dw);
  const int64_t N = h.dim(0), D = h.dim(1), V = w.dim(0);
  std::vector<float> c(size_t(N * std::min(vc, V)));
  for (int64_t v0 = 0; v0 < V; v0 += vc) {
    const int64_t n = std::min(vc, V - v0);
    gemm(Trans::No, Trans::Yes, N, n, D, 1.0f, h.f32(), D, w.f32() + v0 * D, D, 0.0f, c.data(), n);
    parallel_for(N, 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {  // dlogits = g (softmax - onehot), zero for ignored rows
        float* row = c.data() + r * n;
        const int64_t t = targets[size_t(r)];
        if (t < 0) {
          std::fill(row, row + n, 0.0f);
          continue;
        }
        // d/dz of lse - z_t + c·lse² is softmax·(1 + 2c·lse) - onehot.
        const float l = saved.lse[size_t(r)], scale = g * (1.0f + 2.0f * z_loss * l);
        exp_array(row, row, n, l);
        for (int64_t j = 0; j < n; ++j) row[j] *= scale;
        if (t >= v0 && t < v0 + n) row[t - v0] -= g;
      }
    });
    if (dh.defined()) gemm(Trans::No, Trans::No, N, D, n, 1.0f, c.data(), n, w.f32() + v0 * D, D, 1.0f, dh.f32(), D);
    if (dw.defined())
      gemm(Trans::Yes, Trans::No, n, D, N, 1.0f, c.data(), n, h.f32(), D, 1.0f, dw.f32() + v0 * D, D);
  }
}

}  // namespace k3::cross_entropy
