// LayerNorm and RMSNorm on CUDA (ops/norm.h has the math): the forwards one block per row, the
// backwards 16 rows per block; fp32 statistics; the weight/bias gradients are per-block partial
// sums added atomically.
#include "core/cuda_util.cuh"
#include "ops/ops_cuda.h"

namespace k3::cuda {
namespace {

using device::block_sum;
using device::from_f32;
using device::to_f32;

constexpr int kThreads = 256;

template <class T, class TY = T>
__global__ void layernorm_fwd(const T* x, const float* w, const float* b, float eps, int64_t D, TY* y,
                              float* mean_out, float* rstd_out) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * D;
  float s = 0.0f;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) s += to_f32(xr[d]);
  const float mean = block_sum(s, scratch) / float(D);
  float ss = 0.0f;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    const float c = to_f32(xr[d]) - mean;
    ss += c * c;
  }
  const float rstd = rsqrtf(block_sum(ss, scratch) / float(D) + eps);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x)
    y[row * D + d] = from_f32<TY>((to_f32(xr[d]) - mean) * rstd * w[d] + (b ? b[d] : 0.0f));
  if (threadIdx.x == 0) {
    if (mean_out) mean_out[row] = mean;
    if (rstd_out) rstd_out[row] = rstd;
  }
}

// The backward kernels take kRowsPerBlock rows per block and sum the weight (and bias) gradients
// of those rows in shared memory first ([2, D] floats: each thread owns columns d ≡ tid), then add
// them with one atomic per column: per-row atomics on the same D addresses serialised in L2 (GPT-2's
// backward spent more time in them than in the LayerNorm's arithmetic). Wider rows than
// kMaxPartialCols keep the per-row atomics (one row per block, no shared memory).
constexpr int kRowsPerBlock = 16;
constexpr int64_t kMaxPartialCols = 6144;  // 2 · D floats within the default 48 KB
inline bool partial_sums(int64_t D) { return D <= kMaxPartialCols; }

// dx = rstd (dŷ − mean(dŷ) − x̂ mean(dŷ x̂)), dŷ = dy ⊙ w; dw += dy x̂; db += dy.
template <class T>
__global__ void layernorm_bwd(const T* x, const float* w, const float* mean, const float* rstd, const T* dy,
                              int64_t M, int64_t D, int rows, T* dx, float* dw, float* db) {
  extern __shared__ float part[];  // [2][D] when rows > 1
  __shared__ float scratch[32];
  const bool partial = rows > 1;
  if (partial)
    for (int64_t d = threadIdx.x; d < 2 * D; d += blockDim.x) part[d] = 0.0f;
  const int64_t r0 = int64_t(blockIdx.x) * rows, r1 = r0 + rows < M ? r0 + rows : M;
  for (int64_t row = r0; row < r1; ++row) {
    const float mu = mean[row], rs = rstd[row];
    float a = 0.0f, c = 0.0f;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      const float xh = (to_f32(x[row * D + d]) - mu) * rs, g = to_f32(dy[row * D + d]) * w[d];
      a += g;
      c += g * xh;
    }
    const float ma = block_sum(a, scratch) / float(D), mc = block_sum(c, scratch) / float(D);
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      const float xh = (to_f32(x[row * D + d]) - mu) * rs, g = to_f32(dy[row * D + d]);
      if (dx) dx[row * D + d] = from_f32<T>(rs * (g * w[d] - ma - xh * mc));
      if (partial) {
        part[d] += g * xh;
        part[D + d] += g;
      } else {
        if (dw) atomicAdd(&dw[d], g * xh);
        if (db) atomicAdd(&db[d], g);
      }
    }
  }
  if (!partial) return;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {  // the thread's own columns: no barrier needed
    if (dw) atomicAdd(&dw[d], part[d]);
    if (db) atomicAdd(&db[d], part[D + d]);
  }
}

template <class T>
__global__ void rmsnorm_fwd(const T* x, const float* w, float eps, int64_t D, T* y, float* rstd_out) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  float ss = 0.0f;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    const float v = to_f32(x[row * D + d]);
    ss += v * v;
  }
  const float rstd = rsqrtf(block_sum(ss, scratch) / float(D) + eps);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) y[row * D + d] = from_f32<T>(w[d] * to_f32(x[row * D + d]) * rstd);
  if (threadIdx.x == 0 && rstd_out) rstd_out[row] = rstd;
}

// y = w x r, r = (mean(x²) + eps)^-½: dx = r (w dy) − x r³ mean(w dy x); dw += dy x r.
template <class T>
__global__ void rmsnorm_bwd(const T* x, const float* w, const float* rstd, const T* dy, int64_t M, int64_t D, int rows,
                            T* dx, float* dw) {
  extern __shared__ float part[];  // [D] when rows > 1
  __shared__ float scratch[32];
  const bool partial = rows > 1;
  if (partial)
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) part[d] = 0.0f;
  const int64_t r0 = int64_t(blockIdx.x) * rows, r1 = r0 + rows < M ? r0 + rows : M;
  for (int64_t row = r0; row < r1; ++row) {
    const float r = rstd[row];
    float c = 0.0f;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) c += w[d] * to_f32(dy[row * D + d]) * to_f32(x[row * D + d]);
    const float mc = block_sum(c, scratch) / float(D);
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
      const float xv = to_f32(x[row * D + d]), g = to_f32(dy[row * D + d]);
      if (dx) dx[row * D + d] = from_f32<T>(r * w[d] * g - xv * r * r * r * mc);
      if (partial) part[d] += g * xv * r;
      else if (dw) atomicAdd(&dw[d], g * xv * r);
    }
  }
  if (!partial || !dw) return;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) atomicAdd(&dw[d], part[d]);
}

}  // namespace

void layernorm_forward(const void* x, const float* w, const float* b, float eps, int64_t M, int64_t D, void* y,
                       float* mean, float* rstd, Storage st) {
  if (!M) return;
  K3_DISPATCH_STORAGE(st, T,
                      layernorm_fwd<T><<<unsigned(M), kThreads, 0, device::stream()>>>(
                          static_cast<const T*>(x), w, b, eps, D, static_cast<T*>(y), mean, rstd));
  K3_CUDA_LAUNCHED();
}
void layernorm_forward_to(const float* x, const float* w, const float* b, float eps, int64_t M, int64_t D, void* y,
                          Storage y_st, float* mean, float* rstd) {
  if (!M) return;
  K3_DISPATCH_STORAGE(y_st, TY,
                      layernorm_fwd<float, TY><<<unsigned(M), kThreads, 0, device::stream()>>>(
                          x, w, b, eps, D, static_cast<TY*>(y), mean, rstd));
  K3_CUDA_LAUNCHED();
}
void layernorm_backward(const void* x, const float* w, const float* mean, const float* rstd, const void* dy,
                        int64_t M, int64_t D, void* dx, float* dw, float* db, Storage st) {
  if (!M) return;
  const int rows = partial_sums(D) && (dw || db) ? kRowsPerBlock : 1;
  const size_t smem = rows > 1 ? size_t(2 * D) * sizeof(float) : 0;
  K3_DISPATCH_STORAGE(st, T,
                      layernorm_bwd<T><<<unsigned((M + rows - 1) / rows), kThreads, smem, device::stream()>>>(
                          static_cast<const T*>(x), w, mean, rstd, static_cast<const T*>(dy), M, D, rows,
                          static_cast<T*>(dx), dw, db));
  K3_CUDA_LAUNCHED();
}
void rmsnorm_forward(const void* x, const float* w, float eps, int64_t M, int64_t D, void* y, float* rstd,
                     Storage st) {
  if (!M) return;
  K3_DISPATCH_STORAGE(st, T,
                      rmsnorm_fwd<T><<<unsigned(M), kThreads, 0, device::stream()>>>(static_cast<const T*>(x), w, eps,
                                                                                     D, static_cast<T*>(y), rstd));
  K3_CUDA_LAUNCHED();
}
void rmsnorm_backward(const void* x, const float* w, const float* rstd, const void* dy, int64_t M, int64_t D,
                      void* dx, float* dw, Storage st) {
  if (!M) return;
  const int rows = partial_sums(D) && dw ? kRowsPerBlock : 1;
  const size_t smem = rows > 1 ? size_t(D) * sizeof(float) : 0;
  K3_DISPATCH_STORAGE(st, T,
                      rmsnorm_bwd<T><<<unsigned((M + rows - 1) / rows), kThreads, smem, device::stream()>>>(
                          static_cast<const T*>(x), w, rstd, static_cast<const T*>(dy), M, D, rows,
                          static_cast<T*>(dx), dw));
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
