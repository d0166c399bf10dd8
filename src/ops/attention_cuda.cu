// Causal softmax attention on CUDA, flash-style: scores live in registers a tile at a time, never
// in memory. fp32 arithmetic, fp32 or bf16 storage (ops/attention.h has the CPU math). With bf16
// storage at the common head dims the tensor-core kernels run instead (attention_mma_cuda.cu).
//
// Forward: one block per (sequence, head, 32 queries); 4 threads share a query row, each holding
// a quarter of its dimensions (d = sub + 4i), so a q·k dot is 4 partial sums and two shuffles.
// Keys and values stream through shared memory 32 at a time; the softmax is online (running max
// and denominator, the accumulator rescaled once per tile).
// Backward: D_i = Σ_d dy·y first; then one block per (sequence, head, 32 keys) walks the queries
// that see those keys, recomputing p = exp(s − lse): dv += p·dy, ds = p (dy·v − D), dk += ds·q,
// and dq += ds·k through atomic adds (FlashAttention-2's scheme).
#include <cfloat>
#include <type_traits>

#include "core/cuda_util.cuh"
#include "ops/attention_mma_cuda.h"
#include "ops/ops_cuda.h"

namespace k3::cuda {
namespace {

using device::from_f32;
using device::to_f32;

constexpr int kTileQ = 32, kTileK = 32, kSub = 4, kThreads = kTileQ * kSub;  // 128 threads
constexpr int kMaxHd = 256;

__device__ __forceinline__ int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }
__device__ __forceinline__ int64_t max64(int64_t x, int64_t y) { return x > y ? x : y; }

template <class T, int DPT>  // DPT: dimensions per thread (hd ≤ 4·DPT)
__global__ void __launch_bounds__(kThreads) fwd_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                       const T* __restrict__ v, T* __restrict__ y,
                                                       float* __restrict__ lse, AttnShape a) {
  extern __shared__ float smem[];
  float* sk = smem;                   // [kTileK][hd]
  float* sv = smem + kTileK * a.hd;   // [kTileK][hdv]
  const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * kTileQ;
  const int row = threadIdx.x / kSub, sub = threadIdx.x % kSub;
  const int64_t qi = q0 + row;
  const bool active = qi < a.Tq;
  float qv[DPT], acc[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) {
    const int d = sub + kSub * i;
    qv[i] = (active && d < a.hd) ? to_f32(q[((b * a.Tq + qi) * a.H + h) * a.hd + d]) * a.scale : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -FLT_MAX, l = 0.0f;
  const int64_t last_key = a.pos0 + min64(q0 + kTileQ, a.Tq) - 1;  // the tile's last visible key
  for (int64_t k0 = 0; k0 <= last_key; k0 += kTileK) {
    __syncthreads();
    const int nk = int(min64(kTileK, a.S - k0));
    for (int idx = threadIdx.x; idx < nk * a.hd; idx += kThreads) {
      const int j = idx / a.hd, d = idx % a.hd;
      sk[j * a.hd + d] = to_f32(k[((b * a.S + k0 + j) * a.H + h) * a.hd + d]);
    }
    for (int idx = threadIdx.x; idx < nk * a.hdv; idx += kThreads) {
      const int j = idx / a.hdv, d = idx % a.hdv;
      sv[j * a.hdv + d] = to_f32(v[((b * a.S + k0 + j) * a.H + h) * a.hdv + d]);
    }
    __syncthreads();
    float s[kTileK];
    float tmax = -FLT_MAX;
#pragma unroll
    for (int j = 0; j < kTileK; ++j) {
      float part = 0.0f;
#pragma unroll
      for (int i = 0; i < DPT; ++i) {
        const int d = sub + kSub * i;
        if (d < a.hd && j < nk) part += qv[i] * sk[j * a.hd + d];
      }
      part += __shfl_xor_sync(0xffffffffu, part, 1);
      part += __shfl_xor_sync(0xffffffffu, part, 2);
      const bool visible = j < nk && k0 + j <= a.pos0 + qi;
      s[j] = visible ? part : -FLT_MAX;
      tmax = fmaxf(tmax, s[j]);
    }
    const float m_new = fmaxf(m, tmax);
    if (m_new == -FLT_MAX) continue;  // nothing visible yet for this row
    const float corr = __expf(m - m_new);
    l *= corr;
#pragma unroll
    for (int i = 0; i < DPT; ++i) acc[i] *= corr;
#pragma unroll
    for (int j = 0; j < kTileK; ++j) {
      const float pj = s[j] == -FLT_MAX ? 0.0f : __expf(s[j] - m_new);
      l += pj;
#pragma unroll
      for (int i = 0; i < DPT; ++i) {
        const int d = sub + kSub * i;
        if (d < a.hdv && j < nk) acc[i] += pj * sv[j * a.hdv + d];
      }
    }
    m = m_new;
  }
  if (!active) return;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
  for (int i = 0; i < DPT; ++i) {
    const int d = sub + kSub * i;
    if (d < a.hdv) y[((b * a.Tq + qi) * a.H + h) * a.hdv + d] = from_f32<T>(acc[i] * inv);
  }
  if (lse && sub == 0) lse[(b * a.H + h) * a.Tq + qi] = m + logf(l);
}

// D[b, h, i] = Σ_d dy·y (one warp per row).
template <class T>
__global__ void rowdot_kernel(const T* y, const T* dy, float* D, AttnShape a) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;  // over B·Tq·H
  const int lane = threadIdx.x & 31;
  if (row >= a.B * a.Tq * a.H) return;
  float s = 0.0f;
  for (int64_t d = lane; d < a.hdv; d += 32) s += to_f32(y[row * a.hdv + d]) * to_f32(dy[row * a.hdv + d]);
  s = device::warp_sum(s);
  const int64_t h = row % a.H, bt = row / a.H, b = bt / a.Tq, i = bt % a.Tq;
  if (lane == 0) D[(b * a.H + h) * a.Tq + i] = s;
}

template <class T, int DPT>
__global__ void __launch_bounds__(kThreads) bwd_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                       const T* __restrict__ v, const float* __restrict__ lse,
                                                       const float* __restrict__ D, const T* __restrict__ dy,
                                                       float* dq, float* dk, float* dv, AttnShape a) {
  extern __shared__ float smem[];
  float* sq = smem;                    // [kTileQ][hd]
  float* sdy = smem + kTileQ * a.hd;   // [kTileQ][hdv]
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t k0 = int64_t(blockIdx.x) * kTileK;
  const int row = threadIdx.x / kSub, sub = threadIdx.x % kSub;
  const int64_t kj = k0 + row;
  const bool active = kj < a.S;
  float kv[DPT], vv[DPT], dka[DPT], dva[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) {
    const int d = sub + kSub * i;
    kv[i] = (active && d < a.hd) ? to_f32(k[((b * a.S + kj) * a.H + h) * a.hd + d]) : 0.0f;
    vv[i] = (active && d < a.hdv) ? to_f32(v[((b * a.S + kj) * a.H + h) * a.hdv + d]) : 0.0f;
    dka[i] = dva[i] = 0.0f;
  }
  // Queries that see key k0 at least: i ≥ k0 − pos0.
  const int64_t first_q = max64(0, k0 - a.pos0);
  for (int64_t i0 = first_q / kTileQ * kTileQ; i0 < a.Tq; i0 += kTileQ) {
    __syncthreads();
    const int nq = int(min64(kTileQ, a.Tq - i0));
    for (int idx = threadIdx.x; idx < nq * a.hd; idx += kThreads) {
      const int r = idx / a.hd, d = idx % a.hd;
      sq[r * a.hd + d] = to_f32(q[((b * a.Tq + i0 + r) * a.H + h) * a.hd + d]);
    }
    for (int idx = threadIdx.x; idx < nq * a.hdv; idx += kThreads) {
      const int r = idx / a.hdv, d = idx % a.hdv;
      sdy[r * a.hdv + d] = to_f32(dy[((b * a.Tq + i0 + r) * a.H + h) * a.hdv + d]);
    }
    __syncthreads();
    for (int r = 0; r < nq; ++r) {
      const int64_t qi = i0 + r;
      float sp = 0.0f, dp = 0.0f;
#pragma unroll
      for (int i = 0; i < DPT; ++i) {
        const int d = sub + kSub * i;
        if (d < a.hd) sp += kv[i] * sq[r * a.hd + d];
        if (d < a.hdv) dp += vv[i] * sdy[r * a.hdv + d];
      }
      sp += __shfl_xor_sync(0xffffffffu, sp, 1);
      sp += __shfl_xor_sync(0xffffffffu, sp, 2);
      dp += __shfl_xor_sync(0xffffffffu, dp, 1);
      dp += __shfl_xor_sync(0xffffffffu, dp, 2);
      const int64_t li = (b * a.H + h) * a.Tq + qi;
      const bool visible = active && kj <= a.pos0 + qi;
      const float p = visible ? __expf(sp * a.scale - lse[li]) : 0.0f;
      const float ds = p * (dp - D[li]);
#pragma unroll
      for (int i = 0; i < DPT; ++i) {
        const int d = sub + kSub * i;
        if (d < a.hdv) dva[i] += p * sdy[r * a.hdv + d];
        if (d < a.hd) dka[i] += ds * sq[r * a.hd + d] * a.scale;
      }
      // dq[qi] += Σ_j ds_j k_j · scale: sum the warp's 8 key rows, then one atomic per warp.
#pragma unroll
      for (int i = 0; i < DPT; ++i) {
        const int d = sub + kSub * i;
        float c = ds * kv[i];
        c += __shfl_xor_sync(0xffffffffu, c, 4);
        c += __shfl_xor_sync(0xffffffffu, c, 8);
        c += __shfl_xor_sync(0xffffffffu, c, 16);
        if ((threadIdx.x & 31) < kSub && d < a.hd && c != 0.0f)
          atomicAdd(&dq[((b * a.Tq + qi) * a.H + h) * a.hd + d], c * a.scale);
      }
    }
  }
  if (!active) return;
#pragma unroll
  for (int i = 0; i < DPT; ++i) {
    const int d = sub + kSub * i;
    if (d < a.hd) dk[((b * a.S + kj) * a.H + h) * a.hd + d] += dka[i];
    if (d < a.hdv) dv[((b * a.S + kj) * a.H + h) * a.hdv + d] += dva[i];
  }
}

// Decode (Tq = 1), split over the keys (flash-decoding): block (sequence·head, split) scores its
// keys with one warp per key (lanes over dimensions, coalesced rows), keeps a running max,
// denominator and weighted sum per warp, merges its 4 warps, and writes (m, l, acc[hdv]); a
// second kernel merges the splits. Bound by reading the KV cache once.
constexpr int kDecWarps = 4, kDecKeys = 256, kDecDims = kMaxHd / 32;

template <class T>
__global__ void __launch_bounds__(kDecWarps * 32) decode_split_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                                      const T* __restrict__ v, float* __restrict__ part,
                                                                      int nsplit, AttnShape a) {
  __shared__ float sm[kDecWarps], sl[kDecWarps], sacc[kDecWarps][kMaxHd];
  const int64_t bh = blockIdx.x, b = bh / a.H, h = bh % a.H;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t nkeys = a.pos0 + 1;  // keys visible to the single query
  const int64_t j0 = int64_t(blockIdx.y) * kDecKeys, j1 = min64(j0 + kDecKeys, nkeys);
  float qv[kDecDims], acc[kDecDims];
#pragma unroll
  for (int i = 0; i < kDecDims; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < a.hd ? to_f32(q[(b * a.H + h) * a.hd + d]) * a.scale : 0.0f;
    acc[i] = 0.0f;
  }
  float m = -FLT_MAX, l = 0.0f;
  for (int64_t j = j0 + warp; j < j1; j += kDecWarps) {
    const T* kr = k + ((b * a.S + j) * a.H + h) * a.hd;
    const T* vr = v + ((b * a.S + j) * a.H + h) * a.hdv;
    float sc = 0.0f;
#pragma unroll
    for (int i = 0; i < kDecDims; ++i) {
      const int d = lane + 32 * i;
      if (d < a.hd) sc += qv[i] * to_f32(kr[d]);
    }
    sc = device::warp_sum(sc);
    const float m_new = fmaxf(m, sc), corr = __expf(m - m_new), pj = __expf(sc - m_new);
    l = l * corr + pj;
#pragma unroll
    for (int i = 0; i < kDecDims; ++i) {
      const int d = lane + 32 * i;
      acc[i] = acc[i] * corr + (d < a.hdv ? pj * to_f32(vr[d]) : 0.0f);
    }
    m = m_new;
  }
  if (lane == 0) sm[warp] = m, sl[warp] = l;
#pragma unroll
  for (int i = 0; i < kDecDims; ++i) {
    const int d = lane + 32 * i;
    if (d < a.hdv) sacc[warp][d] = acc[i];
  }
  __syncthreads();
  float M = -FLT_MAX;
  for (int w = 0; w < kDecWarps; ++w) M = fmaxf(M, sm[w]);
  float* out = part + (bh * nsplit + blockIdx.y) * (a.hdv + 2);
  for (int d = threadIdx.x; d < a.hdv; d += blockDim.x) {
    float x = 0.0f;
    for (int w = 0; w < kDecWarps; ++w)
      if (sm[w] != -FLT_MAX) x += sacc[w][d] * __expf(sm[w] - M);
    out[2 + d] = x;
  }
  if (threadIdx.x == 0) {
    float L = 0.0f;
    for (int w = 0; w < kDecWarps; ++w)
      if (sm[w] != -FLT_MAX) L += sl[w] * __expf(sm[w] - M);
    out[0] = M;
    out[1] = L;
  }
}

template <class T>
__global__ void decode_merge_kernel(const float* __restrict__ part, int nsplit, T* __restrict__ y,
                                    float* __restrict__ lse, AttnShape a) {
  const int64_t bh = blockIdx.x;
  const float* p = part + bh * nsplit * (a.hdv + 2);
  float M = -FLT_MAX;
  for (int s = 0; s < nsplit; ++s) M = fmaxf(M, p[s * (a.hdv + 2)]);
  float L = 0.0f;
  for (int s = 0; s < nsplit; ++s)
    if (p[s * (a.hdv + 2)] != -FLT_MAX) L += p[s * (a.hdv + 2) + 1] * __expf(p[s * (a.hdv + 2)] - M);
  for (int d = threadIdx.x; d < a.hdv; d += blockDim.x) {
    float x = 0.0f;
    for (int s = 0; s < nsplit; ++s)
      if (p[s * (a.hdv + 2)] != -FLT_MAX) x += p[s * (a.hdv + 2) + 2 + d] * __expf(p[s * (a.hdv + 2)] - M);
    y[bh * a.hdv + d] = from_f32<T>(x / L);  // [B, 1, H, hdv]: row b·H + h
  }
  if (lse && threadIdx.x == 0) lse[bh] = M + logf(L);  // [B, H, 1]
}

template <class T>
void launch_decode(const void* q, const void* k, const void* v, void* y, float* lse, const AttnShape& a) {
  const int nsplit = int((a.pos0 + 1 + kDecKeys - 1) / kDecKeys);
  device::Buffer part(size_t(a.B * a.H) * size_t(nsplit) * size_t(a.hdv + 2) * sizeof(float));
  const dim3 grid(unsigned(a.B * a.H), unsigned(nsplit));
  decode_split_kernel<T><<<grid, kDecWarps * 32, 0, device::stream()>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), part.as<float>(), nsplit, a);
  K3_CUDA_LAUNCHED();
  decode_merge_kernel<T><<<unsigned(a.B * a.H), 128, 0, device::stream()>>>(part.as<float>(), nsplit,
                                                                           static_cast<T*>(y), lse, a);
  K3_CUDA_LAUNCHED();
}

void check(const AttnShape& a) {
  if (a.hd < 1 || a.hdv < 1 || a.hd > kMaxHd || a.hdv > kMaxHd)
    throw error("attention", "the CUDA kernels take head dims 1..", kMaxHd, ", got hd = ", a.hd, ", hdv = ", a.hdv);
  if (a.S < a.pos0 + a.Tq)
    throw error("attention", "S = ", a.S, " keys cannot cover queries at positions ", a.pos0, "..", a.pos0 + a.Tq - 1);
}

template <class T, int DPT>
void launch_fwd(const void* q, const void* k, const void* v, void* y, float* lse, const AttnShape& a) {
  const size_t smem = size_t(kTileK) * size_t(a.hd + a.hdv) * sizeof(float);
  K3_CUDA_CHECK(cudaFuncSetAttribute(fwd_kernel<T, DPT>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned((a.Tq + kTileQ - 1) / kTileQ), unsigned(a.H), unsigned(a.B));
  fwd_kernel<T, DPT><<<grid, kThreads, smem, device::stream()>>>(static_cast<const T*>(q), static_cast<const T*>(k),
                                                                 static_cast<const T*>(v), static_cast<T*>(y), lse, a);
  K3_CUDA_LAUNCHED();
}

template <class T, int DPT>
void launch_bwd(const void* q, const void* k, const void* v, const void* y, const float* lse, const void* dy,
                float* dq, float* dk, float* dv, const AttnShape& a) {
  device::Buffer D(size_t(a.B * a.H * a.Tq) * sizeof(float));
  const int64_t rows = a.B * a.Tq * a.H;
  rowdot_kernel<T><<<device::blocks_for(rows, 8), 256, 0, device::stream()>>>(
      static_cast<const T*>(y), static_cast<const T*>(dy), D.as<float>(), a);
  K3_CUDA_LAUNCHED();
  if constexpr (std::is_same_v<T, __nv_bfloat16>)  // tensor cores where the shape allows
    if (attention_backward_mma(q, k, v, lse, D.as<float>(), dy, dq, dk, dv, a)) return;
  const size_t smem = size_t(kTileQ) * size_t(a.hd + a.hdv) * sizeof(float);
  K3_CUDA_CHECK(cudaFuncSetAttribute(bwd_kernel<T, DPT>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned((a.S + kTileK - 1) / kTileK), unsigned(a.H), unsigned(a.B));
  bwd_kernel<T, DPT><<<grid, kThreads, smem, device::stream()>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), lse, D.as<float>(),
      static_cast<const T*>(dy), dq, dk, dv, a);
  K3_CUDA_LAUNCHED();
}

}  // namespace

void attention_forward(const void* q, const void* k, const void* v, void* y, float* lse, const AttnShape& a,
                       Storage st) {
  check(a);
  if (!a.B || !a.Tq || !a.H) return;
  if (a.Tq == 1) {  // a decode step: split the keys across blocks
    K3_DISPATCH_STORAGE(st, T, launch_decode<T>(q, k, v, y, lse, a));
    return;
  }
  if (st == device::Storage::BF16 && attention_forward_mma(q, k, v, y, lse, a)) return;  // tensor cores
  const bool wide = a.hd > 128 || a.hdv > 128;  // two register layouts: head dims ≤ 128 and ≤ 256
  K3_DISPATCH_STORAGE(st, T, wide ? launch_fwd<T, 64>(q, k, v, y, lse, a) : launch_fwd<T, 32>(q, k, v, y, lse, a));
}

void attention_backward(const void* q, const void* k, const void* v, const void* y, const float* lse,
                        const void* dy, float* dq, float* dk, float* dv, const AttnShape& a, Storage st) {
  check(a);
  if (!a.B || !a.Tq || !a.H) return;
  const bool wide = a.hd > 128 || a.hdv > 128;
  K3_DISPATCH_STORAGE(st, T,
                      wide ? launch_bwd<T, 64>(q, k, v, y, lse, dy, dq, dk, dv, a)
                           : launch_bwd<T, 32>(q, k, v, y, lse, dy, dq, dk, dv, a));
}

}  // namespace k3::cuda
