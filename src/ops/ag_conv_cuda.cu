// The causal depthwise short convolution on CUDA (ops/ag_conv.h), forward and backward (dx and dw
// accumulate).
#include <algorithm>
#include <cmath>

#include "ops/kernels_cuda.cuh"

namespace k3::cuda {
namespace {

// y[b, t, c] = Σ_{i<W} w[c, i] x[b, t − W + 1 + i, c], rows before the sequence's start are zero.
__global__ void short_conv_kernel(const float* x, const float* w, int64_t T, int64_t C, int64_t W, int64_t n,
                                  float* y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t c = i % C, bt = i / C, t = bt % T;
  float acc = 0.0f;
  for (int64_t k = 0; k < W; ++k) {
    const int64_t s = t - (W - 1) + k;
    if (s >= 0) acc += w[c * W + k] * x[(bt - t + s) * C + c];
  }
  y[i] = acc;
}

// dx[b, s, c] += Σ_i w[c, i] dy[b, s + W − 1 − i, c] (rows past the sequence's end are absent).
__global__ void short_conv_dx_kernel(const float* w, const float* dy, int64_t T, int64_t C, int64_t W, int64_t n,
                                     float* dx) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t c = i % C, bs = i / C, s = bs % T;
  float acc = 0.0f;
  for (int64_t k = 0; k < W; ++k) {
    const int64_t t = s + (W - 1) - k;
    if (t < T) acc += w[c * W + k] * dy[(bs - s + t) * C + c];
  }
  dx[i] += acc;
}

// dw[c, k] += Σ_{b,t} x[b, t − W + 1 + k, c] dy[b, t, c]: one block per (c, k).
__global__ void short_conv_dw_kernel(const float* x, const float* dy, int64_t B, int64_t T, int64_t C, int64_t W,
                                     float* dw) {
  __shared__ float scratch[32];
  const int64_t c = blockIdx.x / W, k = blockIdx.x % W;
  float acc = 0.0f;
  for (int64_t bt = threadIdx.x; bt < B * T; bt += blockDim.x) {
    const int64_t t = bt % T, s = t - (W - 1) + k;
    if (s >= 0) acc += x[(bt - t + s) * C + c] * dy[bt * C + c];
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) dw[c * W + k] += acc;
}

}  // namespace

void short_conv(const float* x, const float* w, int64_t B, int64_t T, int64_t C, int64_t W, float* y) {
  const int64_t n = B * T * C;
  if (!n) return;
  short_conv_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(x, w, T, C, W, n, y);
  K3_CUDA_LAUNCHED();
}

void short_conv_backward(const float* x, const float* w, const float* dy, int64_t B, int64_t T, int64_t C, int64_t W,
                         float* dx, float* dw) {
  const int64_t n = B * T * C;
  if (!n) return;
  if (dx) {
    short_conv_dx_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(w, dy, T, C, W, n, dx);
    K3_CUDA_LAUNCHED();
  }
  if (dw) {
    short_conv_dw_kernel<<<unsigned(C * W), kThreads, 0, device::stream()>>>(x, dy, B, T, C, W, dw);
    K3_CUDA_LAUNCHED();
  }
}

}  // namespace k3::cuda
