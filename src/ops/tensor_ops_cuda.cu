// The small kernels behind the differentiable ops' CUDA forms (ops/ag_cuda.cc): elementwise maps,
// block copies for slicing and head layouts, MoE gather/scatter, row softmax, the short
// convolution and the grouped norms. Each mirrors the CPU loop of the op it serves (ops/ag.cc,
// ag_heads.cc, ag_moe.cc, ag_conv.cc, ag_norms.cc) and is tested through it (ag_cuda_test.cc).
#include <cmath>

#include "core/cuda_util.cuh"
#include "ops/ops_cuda.h"

namespace k3::cuda {
namespace {

using device::block_sum;
using device::blocks_for;

constexpr int kThreads = 256;

__device__ __forceinline__ float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void unary_kernel(const float* x, float* y, int64_t n, Unary op, float s) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  switch (op) {
    case Unary::Scale: y[i] = v * s; break;
    case Unary::Sigmoid: y[i] = sigm(v); break;
    case Unary::Silu: y[i] = v * sigm(v); break;
    case Unary::Elu1: y[i] = v > 0.0f ? v + 1.0f : expf(v); break;
  }
}

__global__ void binary_kernel(const float* a, const float* b, float* y, int64_t n, Binary op) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  y[i] = op == Binary::Add ? a[i] + b[i] : a[i] * b[i];
}

// One block row per (m, h) pair; threads over the w columns.
__global__ void copy_blocks_kernel(const float* src, int64_t s_row, int64_t s_head, float* dst, int64_t d_row,
                                   int64_t d_head, int64_t H, int64_t w) {
  const int64_t mh = blockIdx.x, m = mh / H, h = mh % H;
  const float* s = src + m * s_row + h * s_head;
  float* d = dst + m * d_row + h * d_head;
  for (int64_t j = threadIdx.x; j < w; j += blockDim.x) d[j] = s[j];
}

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

int threads_for(int64_t w) { return w >= 256 ? 256 : w > 64 ? 128 : 64; }

}  // namespace

void unary(const float* x, float* y, int64_t n, Unary op, float s) {
  if (!n) return;
  unary_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(x, y, n, op, s);
  K3_CUDA_LAUNCHED();
}

void binary(const float* a, const float* b, float* y, int64_t n, Binary op) {
  if (!n) return;
  binary_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(a, b, y, n, op);
  K3_CUDA_LAUNCHED();
}

void copy_blocks(const float* src, int64_t s_row, int64_t s_head, float* dst, int64_t d_row, int64_t d_head, int64_t M,
                 int64_t H, int64_t w) {
  if (!M || !H || !w) return;
  copy_blocks_kernel<<<unsigned(M * H), threads_for(w), 0, device::stream()>>>(src, s_row, s_head, dst, d_row, d_head,
                                                                                H, w);
  K3_CUDA_LAUNCHED();
}

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

void short_conv(const float* x, const float* w, int64_t B, int64_t T, int64_t C, int64_t W, float* y) {
  const int64_t n = B * T * C;
  if (!n) return;
  short_conv_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(x, w, T, C, W, n, y);
  K3_CUDA_LAUNCHED();
}

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

}  // namespace k3::cuda
