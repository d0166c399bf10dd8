// The grouped norms of ops/ag_norms.h on CUDA (l2norm and gated RMSNorm over groups of d values): a
// block per group; the backward recomputes the norm.
#include <algorithm>
#include <cmath>

#include "ops/kernels_cuda.cuh"

namespace k3::cuda {
namespace {

// One block per group of d values. mode 0: l2norm (rstd over the sum); 1: gated RMSNorm (mean).
__global__ void group_norm_kernel(const float* x, const float* gate, const float* w, float* y, int64_t d, float eps,
                                  int mode, int act) {
  __shared__ float scratch[32];
  const float* r = x + int64_t(blockIdx.x) * d;
  float ss = 0.0f;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) ss += r[j] * r[j];
  ss = block_sum(ss, scratch);
  const float rs = mode == 0 ? rsqrtf(ss + eps) : rsqrtf(ss / float(d) + eps);
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const int64_t i = int64_t(blockIdx.x) * d + j;
    float v = r[j] * rs;
    if (w) v *= w[j];
    if (gate) {
      const float g = gate[i];
      v *= act == 1 ? sigm(g) : g * sigm(g);
    }
    y[i] = v;
  }
}

// One block per group of d values; mode 0: l2norm, 1: gated RMSNorm (ag_norms.cc's closures).
__global__ void group_norm_bwd_kernel(const float* x, const float* gate, const float* w, const float* dy, float* dx,
                                      float* dgate, float* dw, int64_t d, float eps, int mode, int act) {
  __shared__ float scratch[32];
  const int64_t o = int64_t(blockIdx.x) * d;
  float ss = 0.0f;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) ss += x[o + j] * x[o + j];
  ss = block_sum(ss, scratch);
  if (mode == 0) {
    // y = x r, r = (Σx² + eps)^-½: dx = r (dy − y (y·dy))
    const float r = rsqrtf(ss + eps);
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) dot += x[o + j] * r * dy[o + j];
    dot = block_sum(dot, scratch);
    for (int64_t j = threadIdx.x; j < d; j += blockDim.x) dx[o + j] += r * (dy[o + j] - x[o + j] * r * dot);
    return;
  }
  const float r = rsqrtf(ss / float(d) + eps);
  float dot = 0.0f;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const int64_t i = o + j;
    const float n = x[i] * r, wj = w ? w[j] : 1.0f;
    float a = 1.0f;
    if (gate) {
      const float g = gate[i], s = sigm(g);
      a = act == 1 ? s : g * s;
      if (dgate) dgate[i] += dy[i] * n * wj * (act == 1 ? s * (1.0f - s) : s * (1.0f + g * (1.0f - s)));
    }
    if (dw) atomicAdd(dw + j, dy[i] * n * a);
    dot += dy[i] * wj * a * n;
  }
  if (!dx) return;
  const float m = block_sum(dot, scratch) / float(d);
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const int64_t i = o + j;
    float a = 1.0f;
    if (gate) {
      const float g = gate[i], s = sigm(g);
      a = act == 1 ? s : g * s;
    }
    dx[i] += r * (dy[i] * (w ? w[j] : 1.0f) * a - x[i] * r * m);
  }
}

}  // namespace

void l2norm_groups(const float* x, float* y, int64_t G, int64_t d, float eps) {
  if (!G) return;
  group_norm_kernel<<<unsigned(G), threads_for(d), 0, device::stream()>>>(x, nullptr, nullptr, y, d, eps, 0, 0);
  K3_CUDA_LAUNCHED();
}

void gated_rmsnorm_groups(const float* x, const float* gate, const float* w, float* y, int64_t G, int64_t d, float eps,
                          int act) {
  if (!G) return;
  group_norm_kernel<<<unsigned(G), threads_for(d), 0, device::stream()>>>(x, act ? gate : nullptr, w, y, d, eps, 1,
                                                                          act);
  K3_CUDA_LAUNCHED();
}

void l2norm_groups_backward(const float* x, const float* dy, float* dx, int64_t G, int64_t d, float eps) {
  if (!G || !dx) return;
  group_norm_bwd_kernel<<<unsigned(G), threads_for(d), 0, device::stream()>>>(x, nullptr, nullptr, dy, dx, nullptr,
                                                                               nullptr, d, eps, 0, 0);
  K3_CUDA_LAUNCHED();
}

void gated_rmsnorm_groups_backward(const float* x, const float* gate, const float* w, const float* dy, float* dx,
                                   float* dgate, float* dw, int64_t G, int64_t d, float eps, int act) {
  if (!G || (!dx && !dgate && !dw)) return;
  group_norm_bwd_kernel<<<unsigned(G), threads_for(d), 0, device::stream()>>>(x, act ? gate : nullptr, w, dy, dx,
                                                                               act ? dgate : nullptr, dw, d, eps, 1,
                                                                               act);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
