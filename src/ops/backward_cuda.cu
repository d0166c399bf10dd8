// The backward kernels of the differentiable ops' CUDA forms (ops/ag_cuda.cc) that the forward
// kernels of tensor_ops_cuda.cu need: each accumulates (+=) into its gradients, as the CPU
// closures of ag.cc, ag_heads.cc, ag_moe.cc, ag_conv.cc and ag_norms.cc do, and is tested against
// them (ag_cuda_test.cc).
#include <cmath>

#include "core/cuda_util.cuh"
#include "ops/ops_cuda.h"

namespace k3::cuda {
namespace {

using device::block_sum;
using device::blocks_for;

constexpr int kThreads = 256;

__device__ __forceinline__ float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }
int threads_for(int64_t w) { return w >= 256 ? 256 : w > 64 ? 128 : 64; }

__global__ void unary_bwd_kernel(const float* x, const float* dy, float* dx, int64_t n, Unary op, float s) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  float d = 0.0f;
  switch (op) {
    case Unary::Scale: d = s; break;
    case Unary::Sigmoid: { const float q = sigm(v); d = q * (1.0f - q); break; }
    case Unary::Silu: { const float q = sigm(v); d = q * (1.0f + v * (1.0f - q)); break; }
    case Unary::Elu1: d = v > 0.0f ? 1.0f : expf(v); break;
  }
  dx[i] += dy[i] * d;
}

__global__ void mul_bwd_kernel(const float* a, const float* b, const float* dy, float* da, float* db, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = dy[i];
  if (da) da[i] += g * b[i];
  if (db) db[i] += g * a[i];
}

__global__ void add_blocks_kernel(const float* src, int64_t s_row, int64_t s_head, float* dst, int64_t d_row,
                                  int64_t d_head, int64_t H, int64_t w) {
  const int64_t mh = blockIdx.x, m = mh / H, h = mh % H;
  const float* s = src + m * s_row + h * s_head;
  float* d = dst + m * d_row + h * d_head;
  for (int64_t j = threadIdx.x; j < w; j += blockDim.x) d[j] += s[j];
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

__global__ void sum_squares_kernel(const float* x, int64_t n, double* out) {
  __shared__ float scratch[32];
  float s = 0.0f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    s += x[i] * x[i];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) atomicAdd(out, double(s));
}

}  // namespace

void unary_backward(const float* x, const float* dy, float* dx, int64_t n, Unary op, float s) {
  if (!n) return;
  unary_bwd_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(x, dy, dx, n, op, s);
  K3_CUDA_LAUNCHED();
}

void mul_backward(const float* a, const float* b, const float* dy, float* da, float* db, int64_t n) {
  if (!n || (!da && !db)) return;
  mul_bwd_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(a, b, dy, da, db, n);
  K3_CUDA_LAUNCHED();
}

void add_blocks(const float* src, int64_t s_row, int64_t s_head, float* dst, int64_t d_row, int64_t d_head, int64_t M,
                int64_t H, int64_t w) {
  if (!M || !H || !w) return;
  add_blocks_kernel<<<unsigned(M * H), threads_for(w), 0, device::stream()>>>(src, s_row, s_head, dst, d_row, d_head,
                                                                               H, w);
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

void sum_squares(const float* x, int64_t n, double* acc) {
  if (!n) return;
  const int64_t blocks = std::min<int64_t>(blocks_for(n, kThreads), 1024);
  sum_squares_kernel<<<unsigned(blocks), kThreads, 0, device::stream()>>>(x, n, acc);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
