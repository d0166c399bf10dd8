// LayerNorm and RMSNorm on CUDA (ops/norm.h has the math): the forwards one block per row, the
// backwards 16 rows per block, and LayerNorm over fp32 rows of up to 1,024 columns (a multiple of
// 128) a warp per row; fp32 statistics; the weight/bias gradients are per-block partial sums added
// atomically.
#include <algorithm>
#include <initializer_list>

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
                              int64_t M, int64_t D, int rows, T* dx, float* dw, float* db, bool acc) {
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
      if (dx) {
        const float d0 = acc ? to_f32(dx[row * D + d]) : 0.0f;
        dx[row * D + d] = from_f32<T>(d0 + rs * (g * w[d] - ma - xh * mc));
      }
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

// fp32 rows of D = 128·v4 columns (v4 ≤ kMaxVec, 16-byte aligned arrays): a warp per row, each
// lane holding v4 float4s in registers, the sums by shuffles (the block-per-row kernels above
// pay a block barrier per reduction and re-read the row from memory for every pass).
constexpr int kMaxVec = 8;
constexpr int kWarpRowsBlock = 8;  // warps per block
bool warp_rows(int64_t D, std::initializer_list<const void*> arrays) {
  if (D % 128 != 0 || D / 128 > kMaxVec) return false;
  for (const void* p : arrays)
    if (reinterpret_cast<uintptr_t>(p) & 15) return false;
  return true;
}
template <class TY>
__global__ void __launch_bounds__(32 * kWarpRowsBlock) layernorm_fwd_warp(const float* x, const float* w,
                                                                          const float* b, float eps, int64_t M,
                                                                          int v4, TY* y, float* mean_out,
                                                                          float* rstd_out) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarpRowsBlock + (threadIdx.x >> 5);
  if (row >= M) return;
  const int64_t D = int64_t(v4) * 128;
  const float4* xr = reinterpret_cast<const float4*>(x + row * D);
  float4 v[kMaxVec];
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxVec; ++i)
    if (i < v4) {
      v[i] = xr[lane + 32 * i];
      s += (v[i].x + v[i].y) + (v[i].z + v[i].w);
    }
  const float mu = device::warp_sum(s) / float(D);
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxVec; ++i)
    if (i < v4) {
      v[i] = make_float4(v[i].x - mu, v[i].y - mu, v[i].z - mu, v[i].w - mu);
      ss += (v[i].x * v[i].x + v[i].y * v[i].y) + (v[i].z * v[i].z + v[i].w * v[i].w);
    }
  const float rs = rsqrtf(device::warp_sum(ss) / float(D) + eps);
#pragma unroll
  for (int i = 0; i < kMaxVec; ++i)
    if (i < v4) {
      const int c = lane + 32 * i;
      const float4 wc = reinterpret_cast<const float4*>(w)[c];
      const float4 bc = b ? reinterpret_cast<const float4*>(b)[c] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      device::store4(y + row * D + 4 * c, make_float4(v[i].x * rs * wc.x + bc.x, v[i].y * rs * wc.y + bc.y,
                                                     v[i].z * rs * wc.z + bc.z, v[i].w * rs * wc.w + bc.w));
    }
  if (lane == 0) {
    if (mean_out) mean_out[row] = mu;
    if (rstd_out) rstd_out[row] = rs;
  }
}
// The backward on the same layout: each warp walks `rows` rows, its lanes summing dw and db for
// their columns in registers; the block's warps meet in shared memory ([2][D]), one atomic per
// column per block. The row's second pass reloads x, dy and w (L1 hits) rather than holding them:
// registers for them would halve the blocks an SM holds.
__global__ void __launch_bounds__(32 * kWarpRowsBlock) layernorm_bwd_warp(const float* x, const float* w,
                                                                          const float* mean, const float* rstd,
                                                                          const float* dy, int64_t M, int v4,
                                                                          int rows, float* dx, float* dw, float* db,
                                                                          bool acc) {
  extern __shared__ float part[];  // [2][D]
  const int64_t D = int64_t(v4) * 128;
  for (int64_t d = threadIdx.x; d < 2 * D; d += blockDim.x) part[d] = 0.0f;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const float4* w4 = reinterpret_cast<const float4*>(w);
  float4 adw[kMaxVec], adb[kMaxVec];
#pragma unroll
  for (int i = 0; i < kMaxVec; ++i) adw[i] = adb[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const int64_t r0 = (int64_t(blockIdx.x) * kWarpRowsBlock + (threadIdx.x >> 5)) * rows;
  const int64_t r1 = r0 + rows < M ? r0 + rows : M;
  for (int64_t row = r0; row < r1; ++row) {
    const float mu = mean[row], rs = rstd[row];
    const float4* xr = reinterpret_cast<const float4*>(x + row * D);
    const float4* gr = reinterpret_cast<const float4*>(dy + row * D);
    float a = 0.0f, c = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxVec; ++i)
      if (i < v4) {
        const int k = lane + 32 * i;
        const float4 xv = xr[k], g = gr[k], wc = w4[k];
        const float4 gw = make_float4(g.x * wc.x, g.y * wc.y, g.z * wc.z, g.w * wc.w);
        a += (gw.x + gw.y) + (gw.z + gw.w);
        c += (gw.x * (xv.x - mu) + gw.y * (xv.y - mu)) + (gw.z * (xv.z - mu) + gw.w * (xv.w - mu));
      }
    const float ma = device::warp_sum(a) / float(D), mc = device::warp_sum(c) * rs / float(D);
#pragma unroll
    for (int i = 0; i < kMaxVec; ++i)
      if (i < v4) {
        const int k = lane + 32 * i;
        const float4 xv = xr[k], g = gr[k], wc = w4[k];
        const float4 xh = make_float4((xv.x - mu) * rs, (xv.y - mu) * rs, (xv.z - mu) * rs, (xv.w - mu) * rs);
        if (dx) {
          float4* dr = reinterpret_cast<float4*>(dx + row * D) + k;
          const float4 d0 = acc ? *dr : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          *dr = make_float4(d0.x + rs * (g.x * wc.x - ma - xh.x * mc), d0.y + rs * (g.y * wc.y - ma - xh.y * mc),
                            d0.z + rs * (g.z * wc.z - ma - xh.z * mc), d0.w + rs * (g.w * wc.w - ma - xh.w * mc));
        }
        adw[i] = make_float4(adw[i].x + g.x * xh.x, adw[i].y + g.y * xh.y, adw[i].z + g.z * xh.z,
                             adw[i].w + g.w * xh.w);
        adb[i] = make_float4(adb[i].x + g.x, adb[i].y + g.y, adb[i].z + g.z, adb[i].w + g.w);
      }
  }
#pragma unroll
  for (int i = 0; i < kMaxVec; ++i)
    if (i < v4) {
      float* pw = part + 4 * (lane + 32 * i);
      atomicAdd(pw, adw[i].x), atomicAdd(pw + 1, adw[i].y), atomicAdd(pw + 2, adw[i].z), atomicAdd(pw + 3, adw[i].w);
      atomicAdd(pw + D, adb[i].x), atomicAdd(pw + D + 1, adb[i].y), atomicAdd(pw + D + 2, adb[i].z),
          atomicAdd(pw + D + 3, adb[i].w);
    }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    if (dw) atomicAdd(&dw[d], part[d]);
    if (db) atomicAdd(&db[d], part[D + d]);
  }
}

// The backward over fp32 rows of D = 4·n4 columns (n4 ≤ 256, 16-byte aligned) with a residual
// stream's extras: dx accumulated in fp32, its bf16 copy (dx_b, may be null) and its column sums
// (dsum += Σ_rows dx, may be null: the bias gradient of the GEMM that reads dx next). Each thread
// owns one column quad for all of the block's rows, so dw, db and dsum stay in registers and
// meet other blocks' by one atomic per column; rows go kLnRows at a time: each thread issues
// the loads of all kLnRows rows first, the rows' two sums meet across the block's warps through
// shared memory (two barriers per kLnRows rows). The warp-per-row kernel above held 64 registers
// of dw/db sums per lane and ran at half the copy bandwidth.
constexpr int kLnRows = 4;
template <class TD>  // dy's storage: fp32, or bf16 from a bf16 GEMM
__global__ void __launch_bounds__(256) layernorm_bwd_cols(const float* x, const float* w, const float* mean,
                                                         const float* rstd, const TD* dy, int64_t M, int n4,
                                                         int64_t rows_per_block, float* dx, uint2* dx_b, float* dw,
                                                         float* db, float* dsum, bool acc) {
  __shared__ float red[kLnRows][8][2];  // [row][warp][Σ dŷ, Σ dŷ (x − μ)]
  __shared__ float fin[kLnRows][2];
  const int c = threadIdx.x, lane = c & 31, warp = c >> 5, warps = int(blockDim.x + 31) >> 5;
  const bool on = c < n4;
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float4* dx4 = reinterpret_cast<float4*>(dx);
  const float4 wc = on ? reinterpret_cast<const float4*>(w)[c] : zero;
  const float inv_d = 1.0f / float(4 * n4);
  float4 adw = zero, adb = zero, ads = zero;
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block, r1 = r0 + rows_per_block < M ? r0 + rows_per_block : M;
  for (int64_t rb = r0; rb < r1; rb += kLnRows) {
    float4 xv[kLnRows], g[kLnRows], d0[kLnRows];
    float mu[kLnRows], rs[kLnRows];
#pragma unroll
    for (int i = 0; i < kLnRows; ++i) {
      const int64_t row = rb + i;
      const bool ok = on && row < r1;
      xv[i] = ok ? x4[row * n4 + c] : zero;
      g[i] = ok ? device::load4(dy + 4 * (row * n4 + c)) : zero;
      d0[i] = ok && acc ? dx4[row * n4 + c] : zero;
      mu[i] = row < r1 ? mean[row] : 0.0f;
      rs[i] = row < r1 ? rstd[row] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kLnRows; ++i) {
      const float4 gw = make_float4(g[i].x * wc.x, g[i].y * wc.y, g[i].z * wc.z, g[i].w * wc.w);
      float a = (gw.x + gw.y) + (gw.z + gw.w);
      float cc = (gw.x * (xv[i].x - mu[i]) + gw.y * (xv[i].y - mu[i])) +
                 (gw.z * (xv[i].z - mu[i]) + gw.w * (xv[i].w - mu[i]));
      a = device::warp_sum(a);
      cc = device::warp_sum(cc);
      if (lane == 0) red[i][warp][0] = a, red[i][warp][1] = cc;
    }
    __syncthreads();
    if (c < 2 * kLnRows) {
      float t = 0.0f;
      for (int q = 0; q < warps; ++q) t += red[c >> 1][q][c & 1];
      fin[c >> 1][c & 1] = t;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kLnRows; ++i) {
      const int64_t row = rb + i;
      if (!on || row >= r1) continue;
      const float ma = fin[i][0] * inv_d, mc = fin[i][1] * rs[i] * inv_d, r = rs[i];
      const float4 xh = make_float4((xv[i].x - mu[i]) * r, (xv[i].y - mu[i]) * r, (xv[i].z - mu[i]) * r,
                                    (xv[i].w - mu[i]) * r);
      const float4 o = make_float4(d0[i].x + r * (g[i].x * wc.x - ma - xh.x * mc),
                                   d0[i].y + r * (g[i].y * wc.y - ma - xh.y * mc),
                                   d0[i].z + r * (g[i].z * wc.z - ma - xh.z * mc),
                                   d0[i].w + r * (g[i].w * wc.w - ma - xh.w * mc));
      dx4[row * n4 + c] = o;
      if (dx_b) dx_b[row * n4 + c] = device::pack_bf16x4(o);
      adw = make_float4(adw.x + g[i].x * xh.x, adw.y + g[i].y * xh.y, adw.z + g[i].z * xh.z, adw.w + g[i].w * xh.w);
      adb = make_float4(adb.x + g[i].x, adb.y + g[i].y, adb.z + g[i].z, adb.w + g[i].w);
      ads = make_float4(ads.x + o.x, ads.y + o.y, ads.z + o.z, ads.w + o.w);
    }
  }
  if (!on) return;
  if (dw) atomicAdd(dw + 4 * c, adw.x), atomicAdd(dw + 4 * c + 1, adw.y), atomicAdd(dw + 4 * c + 2, adw.z),
      atomicAdd(dw + 4 * c + 3, adw.w);
  if (db) atomicAdd(db + 4 * c, adb.x), atomicAdd(db + 4 * c + 1, adb.y), atomicAdd(db + 4 * c + 2, adb.z),
      atomicAdd(db + 4 * c + 3, adb.w);
  if (dsum) atomicAdd(dsum + 4 * c, ads.x), atomicAdd(dsum + 4 * c + 1, ads.y), atomicAdd(dsum + 4 * c + 2, ads.z),
      atomicAdd(dsum + 4 * c + 3, ads.w);
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
  if (st == Storage::F32) return layernorm_forward_to(static_cast<const float*>(x), w, b, eps, M, D, y, st, mean, rstd);
  K3_DISPATCH_STORAGE(st, T,
                      layernorm_fwd<T><<<unsigned(M), kThreads, 0, device::stream()>>>(
                          static_cast<const T*>(x), w, b, eps, D, static_cast<T*>(y), mean, rstd));
  K3_CUDA_LAUNCHED();
}
void layernorm_forward_to(const float* x, const float* w, const float* b, float eps, int64_t M, int64_t D, void* y,
                          Storage y_st, float* mean, float* rstd) {
  if (!M) return;
  if (warp_rows(D, {x, w, b, y})) {
    K3_DISPATCH_STORAGE(y_st, TY,
                        layernorm_fwd_warp<TY><<<unsigned((M + kWarpRowsBlock - 1) / kWarpRowsBlock),
                                                 32 * kWarpRowsBlock, 0, device::stream()>>>(
                            x, w, b, eps, M, int(D / 128), static_cast<TY*>(y), mean, rstd));
    K3_CUDA_LAUNCHED();
    return;
  }
  K3_DISPATCH_STORAGE(y_st, TY,
                      layernorm_fwd<float, TY><<<unsigned(M), kThreads, 0, device::stream()>>>(
                          x, w, b, eps, D, static_cast<TY*>(y), mean, rstd));
  K3_CUDA_LAUNCHED();
}
void layernorm_backward(const void* x, const float* w, const float* mean, const float* rstd, const void* dy,
                        int64_t M, int64_t D, void* dx, float* dw, float* db, Storage st, bool accumulate) {
  if (!M) return;
  if (st == Storage::F32 && warp_rows(D, {x, w, dy, dx})) {
    // Rows per warp: about two waves of blocks (one block of dw/db atomics each).
    const int64_t waves = 2 * int64_t(device::sm_count());
    const int64_t per_warp = std::max<int64_t>(1, (M + kWarpRowsBlock * waves - 1) / (kWarpRowsBlock * waves));
    const int64_t blocks = (M + kWarpRowsBlock * per_warp - 1) / (kWarpRowsBlock * per_warp);
    layernorm_bwd_warp<<<unsigned(blocks), 32 * kWarpRowsBlock, size_t(2 * D) * sizeof(float), device::stream()>>>(
        static_cast<const float*>(x), w, mean, rstd, static_cast<const float*>(dy), M, int(D / 128), int(per_warp),
        static_cast<float*>(dx), dw, db, accumulate);
    K3_CUDA_LAUNCHED();
    return;
  }
  const int rows = partial_sums(D) && (dw || db) ? kRowsPerBlock : 1;
  const size_t smem = rows > 1 ? size_t(2 * D) * sizeof(float) : 0;
  K3_DISPATCH_STORAGE(st, T,
                      layernorm_bwd<T><<<unsigned((M + rows - 1) / rows), kThreads, smem, device::stream()>>>(
                          static_cast<const T*>(x), w, mean, rstd, static_cast<const T*>(dy), M, D, rows,
                          static_cast<T*>(dx), dw, db, accumulate));
  K3_CUDA_LAUNCHED();
}
template <class TD>
void launch_bwd_cols(const float* x, const float* w, const float* mean, const float* rstd, const TD* dy, int64_t M,
                     int64_t D, float* dx, void* dx_bf16, float* dw, float* db, float* dsum, bool accumulate) {
  const int n4 = int(D / 4), threads = (n4 + 31) / 32 * 32;
  // One wave of as many blocks as the SMs hold (a second, part-filled wave left most SMs idle
  // for its length), at least kLnRows rows each.
  static const int per_sm = [] {
    int n = 0;
    K3_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, layernorm_bwd_cols<TD>, 256, 0));
    return std::max(n, 1);
  }();
  const int64_t target = int64_t(per_sm) * (256 / threads) * int64_t(device::sm_count());
  const int64_t per = std::max<int64_t>(kLnRows, ((M + target - 1) / target + kLnRows - 1) / kLnRows * kLnRows);
  layernorm_bwd_cols<TD><<<unsigned((M + per - 1) / per), threads, 0, device::stream()>>>(
      x, w, mean, rstd, dy, M, n4, per, dx, static_cast<uint2*>(dx_bf16), dw, db, dsum, accumulate);
  K3_CUDA_LAUNCHED();
}
void layernorm_backward_residual(const float* x, const float* w, const float* mean, const float* rstd, const void* dy,
                                 Storage dy_st, int64_t M, int64_t D, float* dx, void* dx_bf16, float* dw, float* db,
                                 float* dsum, bool accumulate) {
  if (!M) return;
  const auto a16 = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  const bool bf = dy_st == Storage::BF16;
  if (D % 4 == 0 && D / 4 <= 256 && a16(x) && a16(w) && (reinterpret_cast<uintptr_t>(dy) & (bf ? 7 : 15)) == 0 &&
      a16(dx) && (reinterpret_cast<uintptr_t>(dx_bf16) & 7) == 0) {
    if (bf)
      launch_bwd_cols(x, w, mean, rstd, static_cast<const __nv_bfloat16*>(dy), M, D, dx, dx_bf16, dw, db, dsum,
                      accumulate);
    else
      launch_bwd_cols(x, w, mean, rstd, static_cast<const float*>(dy), M, D, dx, dx_bf16, dw, db, dsum, accumulate);
    return;
  }
  // Other shapes: the composed ops (a bf16 dy widened first).
  device::Buffer wide;
  if (bf) {
    wide = device::Buffer(size_t(M * D) * sizeof(float));
    widen(dy, wide.as<float>(), M * D, Storage::BF16);
    dy = wide.get();
  }
  layernorm_backward(x, w, mean, rstd, dy, M, D, dx, dw, db, Storage::F32, accumulate);
  if (dx_bf16) cast(dx, dx_bf16, M * D, Storage::BF16);
  if (dsum) bias_grad(dx, dsum, M, D);
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
