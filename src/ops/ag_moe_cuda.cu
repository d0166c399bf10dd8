// The routing ops of ops/ag_moe.h on CUDA, forward and backward: row softmax, top-1 argmax, sum
// normalisation, gathers of rows and columns, and the weighted combine of the experts' outputs.
// Backwards accumulate (+=), as the host closures do.
#include <algorithm>
#include <cmath>

#include "ops/kernels_cuda.cuh"

namespace k3::cuda {
namespace {

__global__ void gather_rows_kernel(const float* x, const int64_t* rows, int64_t D, float* y) {
  const int64_t i = blockIdx.x;
  const float* s = x + rows[i] * D;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) y[i * D + j] = s[j];
}

__global__ void scatter_weighted_kernel(const float* ys, const int64_t* rows, const int64_t* slots, const float* w,
                                        int64_t D, float* out) {
  const int64_t p = blockIdx.x;
  const float c = w[slots[p]];
  float* o = out + rows[p] * D;
  // Atomic: a routing that sends a row to one expert twice still sums both (as the CPU does).
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) atomicAdd(o + j, c * ys[p * D + j]);
}

__global__ void gather_cols_kernel(const float* s, const int64_t* idx, const float* offset, int64_t E, int64_t K,
                                   int64_t n, float* y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t m = i / K, e = idx[i];
  y[i] = s[m * E + e] + (offset ? offset[e] : 0.0f);
}

__global__ void softmax_rows_kernel(const float* x, float* y, int64_t N) {
  __shared__ float scratch[32];
  const float* r = x + int64_t(blockIdx.x) * N;
  float* o = y + int64_t(blockIdx.x) * N;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) mx = fmaxf(mx, r[j]);
  // Block max through the sum helper's scratch: negate-free reduction by warps.
  mx = device::warp_max(mx);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = (threadIdx.x & 31) < (blockDim.x >> 5) ? scratch[threadIdx.x & 31] : -INFINITY;
  mx = device::warp_max(mx);
  float z = 0.0f;
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) z += expf(r[j] - mx);
  z = block_sum(z, scratch);
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) o[j] = expf(r[j] - mx) / z;
}

// (value, column) pairs: the larger value wins, then the smaller column; column N is "none yet".
struct ArgMax {
  float v;
  int64_t i;
};
__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b, int64_t N) {
  if (b.i == N) return a;
  if (a.i == N) return b;
  if (a.v != b.v) return a.v > b.v ? a : b;
  return a.i < b.i ? a : b;
}
__global__ void argmax_rows_kernel(const float* x, int64_t N, int64_t* idx) {
  __shared__ ArgMax scratch[32];
  const float* r = x + int64_t(blockIdx.x) * N;
  ArgMax best{-INFINITY, N};
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) {  // a thread's columns rise: strict > keeps the first
    const float v = r[j];
    if (v == v && (best.i == N || v > best.v)) best = {v, j};
  }
  for (int o = 16; o > 0; o /= 2) {
    const ArgMax other{__shfl_xor_sync(0xffffffffu, best.v, o), __shfl_xor_sync(0xffffffffu, best.i, o)};
    best = better(best, other, N);
  }
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x < 32) {
    best = threadIdx.x < (blockDim.x >> 5) ? scratch[threadIdx.x] : ArgMax{-INFINITY, N};
    for (int o = 16; o > 0; o /= 2) {
      const ArgMax other{__shfl_xor_sync(0xffffffffu, best.v, o), __shfl_xor_sync(0xffffffffu, best.i, o)};
      best = better(best, other, N);
    }
    if (threadIdx.x == 0) idx[blockIdx.x] = best.i == N ? 0 : best.i;
  }
}

__global__ void normalize_sum_kernel(const float* x, float* y, int64_t N, float eps) {
  __shared__ float scratch[32];
  const float* r = x + int64_t(blockIdx.x) * N;
  float s = 0.0f;
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) s += r[j];
  s = block_sum(s, scratch) + eps;
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) y[int64_t(blockIdx.x) * N + j] = r[j] / s;
}

__global__ void scatter_add_rows_kernel(const float* dy, const int64_t* rows, int64_t D, float* dx) {
  const int64_t i = blockIdx.x;
  float* d = dx + rows[i] * D;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) atomicAdd(d + j, dy[i * D + j]);
}

__global__ void scatter_cols_kernel(const float* dy, const int64_t* idx, int64_t E, int64_t K, int64_t n, float* ds) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  atomicAdd(ds + (i / K) * E + idx[i], dy[i]);
}

// dx = p ⊙ (dy − Σ dy·p)
__global__ void softmax_bwd_kernel(const float* p, const float* dy, float* dx, int64_t N) {
  __shared__ float scratch[32];
  const int64_t o = int64_t(blockIdx.x) * N;
  float dot = 0.0f;
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) dot += dy[o + j] * p[o + j];
  dot = block_sum(dot, scratch);
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) dx[o + j] += p[o + j] * (dy[o + j] - dot);
}

// y = x / S, S = Σ x + eps: dx_j = (dy_j − Σ dy·y) / S
__global__ void normalize_sum_bwd_kernel(const float* x, const float* y, const float* dy, float* dx, int64_t N,
                                         float eps) {
  __shared__ float scratch[32];
  const int64_t o = int64_t(blockIdx.x) * N;
  float s = 0.0f, gy = 0.0f;
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) {
    s += x[o + j];
    gy += dy[o + j] * y[o + j];
  }
  s = block_sum(s, scratch) + eps;
  gy = block_sum(gy, scratch);
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) dx[o + j] += (dy[o + j] - gy) / s;
}

// One block per routed row p: dys[p] += w[slot]·dout[row]; dw[slot] += dout[row]·ys[p].
__global__ void scatter_weighted_bwd_kernel(const float* dout, const float* ys, const int64_t* rows,
                                            const int64_t* slots, const float* w, int64_t D, float* dys, float* dw) {
  __shared__ float scratch[32];
  const int64_t p = blockIdx.x;
  const float* g = dout + rows[p] * D;
  const float c = w[slots[p]];
  float dot = 0.0f;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    if (dys) dys[p * D + j] += c * g[j];
    dot += g[j] * ys[p * D + j];
  }
  if (!dw) return;
  dot = block_sum(dot, scratch);
  if (threadIdx.x == 0) atomicAdd(dw + slots[p], dot);
}

}  // namespace

void gather_rows(const float* x, const int64_t* rows, int64_t n, int64_t D, float* y) {
  if (!n || !D) return;
  gather_rows_kernel<<<unsigned(n), threads_for(D), 0, device::stream()>>>(x, rows, D, y);
  K3_CUDA_LAUNCHED();
}

void scatter_weighted(const float* ys, const int64_t* rows, const int64_t* slots, const float* w, int64_t n, int64_t D,
                      float* out) {
  if (!n || !D) return;
  scatter_weighted_kernel<<<unsigned(n), threads_for(D), 0, device::stream()>>>(ys, rows, slots, w, D, out);
  K3_CUDA_LAUNCHED();
}

void gather_cols(const float* s, const int64_t* idx, const float* offset, int64_t M, int64_t E, int64_t K, float* y) {
  const int64_t n = M * K;
  if (!n) return;
  gather_cols_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(s, idx, offset, E, K, n, y);
  K3_CUDA_LAUNCHED();
}

void softmax_rows(const float* x, float* y, int64_t M, int64_t N) {
  if (!M || !N) return;
  softmax_rows_kernel<<<unsigned(M), threads_for(N), 0, device::stream()>>>(x, y, N);
  K3_CUDA_LAUNCHED();
}

void argmax_rows(const float* x, int64_t M, int64_t N, int64_t* idx) {
  if (!M) return;
  if (M > INT32_MAX) throw error("argmax", M, " rows exceed the grid");
  argmax_rows_kernel<<<unsigned(M), 512, 0, device::stream()>>>(x, N, idx);
  K3_CUDA_LAUNCHED();
}

void normalize_sum_rows(const float* x, float* y, int64_t M, int64_t N, float eps) {
  if (!M || !N) return;
  normalize_sum_kernel<<<unsigned(M), threads_for(N), 0, device::stream()>>>(x, y, N, eps);
  K3_CUDA_LAUNCHED();
}

void scatter_add_rows(const float* dy, const int64_t* rows, int64_t n, int64_t D, float* dx) {
  if (!n || !D) return;
  scatter_add_rows_kernel<<<unsigned(n), threads_for(D), 0, device::stream()>>>(dy, rows, D, dx);
  K3_CUDA_LAUNCHED();
}

void scatter_cols_add(const float* dy, const int64_t* idx, int64_t M, int64_t E, int64_t K, float* ds) {
  const int64_t n = M * K;
  if (!n) return;
  scatter_cols_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(dy, idx, E, K, n, ds);
  K3_CUDA_LAUNCHED();
}

void softmax_rows_backward(const float* y, const float* dy, float* dx, int64_t M, int64_t N) {
  if (!M || !N) return;
  softmax_bwd_kernel<<<unsigned(M), threads_for(N), 0, device::stream()>>>(y, dy, dx, N);
  K3_CUDA_LAUNCHED();
}

void normalize_sum_rows_backward(const float* x, const float* y, const float* dy, float* dx, int64_t M, int64_t N,
                                 float eps) {
  if (!M || !N) return;
  normalize_sum_bwd_kernel<<<unsigned(M), threads_for(N), 0, device::stream()>>>(x, y, dy, dx, N, eps);
  K3_CUDA_LAUNCHED();
}

void scatter_weighted_backward(const float* dout, const float* ys, const int64_t* rows, const int64_t* slots,
                               const float* w, int64_t n, int64_t D, float* dys, float* dw) {
  if (!n || !D || (!dys && !dw)) return;
  scatter_weighted_bwd_kernel<<<unsigned(n), threads_for(D), 0, device::stream()>>>(dout, ys, rows, slots, w, D, dys,
                                                                                     dw);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
