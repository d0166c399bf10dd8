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
#include <algorithm>
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

// The same over bf16 rows of hdv = 8·G values: G lanes per row, 16 bytes each, summed by shuffles
// (a warp per row read 64 two-byte values at a fraction of the bandwidth).
template <int G>
__global__ void rowdot_bf16_kernel(const __nv_bfloat16* y, const __nv_bfloat16* dy, float* D, AttnShape a) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = t / G, rows = a.B * a.Tq * a.H;
  const int part = int(t % G);
  float s = 0.0f;
  if (row < rows) {
    const uint4 u = reinterpret_cast<const uint4*>(y + row * a.hdv)[part];
    const uint4 w = reinterpret_cast<const uint4*>(dy + row * a.hdv)[part];
    const unsigned uu[4] = {u.x, u.y, u.z, u.w}, ww[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 p = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&uu[i]));
      const float2 q = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ww[i]));
      s += p.x * q.x + p.y * q.y;
    }
  }
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (row >= rows || part != 0) return;
  const int64_t h = row % a.H, bt = row / a.H, b = bt / a.Tq, i = bt % a.Tq;
  D[(b * a.H + h) * a.Tq + i] = s;
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

// Decode-shaped attention (flash-decoding): a few new queries per sequence over that sequence's
// keys. Block (query row · head, split) walks the split's keys with 4 warps; a warp takes U keys
// per pass, lanes over the head's dimensions (DPL each: 2, 4 or 8 for head dims ≤ 64, 128, 256),
// and the U scores' shuffles interleave. Heads that fill the lanes exactly (hd = hdv = 32·DPL)
// stream through a cp.async ring in shared memory (decode_ring_kernel; each lane reads dims
// lane·DPL + i as one vector); other dims load into registers, strided (lane + 32·i). The
// warps' (m, l, acc) meet in shared memory; with one split the block writes y itself, else a
// partial (m, l, acc[hdv]) that a second kernel merges. Scores in log₂ units. Bound by reading
// the keys and values once.
constexpr int kDecWarps = 4, kDecMaxSplits = 256;
constexpr float kLog2e = 1.44269504f, kLn2 = 0.69314718f;

template <class T>
struct DecArgs {
  const T* q;  // query row b·Tq + t, head h at q + row·ldq + h·hd
  int64_t ldq;
  const T* k;  // contiguous caches: sequence b's rows at k + b·kseq, v + b·vseq (ks null) ...
  const T* v;
  int64_t kseq, vseq;
  const T* const* ks;  // ... or per-sequence rows ([rows, H·hd] and [rows, H·hdv] each), device arrays
  const T* const* vs;
  const int64_t* p0s;  // query t of sequence b sees keys 0 .. p0 + t: p0 = p0s[b], or pos0 when null
  int64_t pos0;
  T* y;        // [B·Tq, H, hdv]
  float* lse;  // [B, H, Tq] (natural log) or null
  float* part;
  int64_t Tq, H, hd, hdv, keys;  // keys per split
  float scale;                   // the softmax scale · log₂ e
  int nsplit;
  int64_t group = 1;  // query heads per stored key/value head (the cached decode's grouped-query attention)
};

// DPL values of T from p (vector loads of DPL·sizeof(T) bytes, aligned to min(16, that); the
// ring's shared rows).
template <class T, int DPL>
__device__ __forceinline__ void load_packed(const T* p, float (&x)[DPL]) {
  constexpr int W = DPL * int(sizeof(T)) / 4;  // 32-bit words
  uint32_t w[W];
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int c = 0; c < W / 4; ++c) {
      const uint4 u = reinterpret_cast<const uint4*>(p)[c];
      w[4 * c] = u.x, w[4 * c + 1] = u.y, w[4 * c + 2] = u.z, w[4 * c + 3] = u.w;
    }
  } else if constexpr (W == 2) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    w[0] = u.x, w[1] = u.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  }
#pragma unroll
  for (int i = 0; i < W; ++i) {
    if constexpr (sizeof(T) == 4) {
      x[i] = __uint_as_float(w[i]);
    } else {  // two bf16, the lower address in the low half
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
}
// This lane's dims lane + 32·i of a row (zeros past n).
template <class T, int DPL>
__device__ __forceinline__ void load_dims(const T* row, int lane, int64_t n, float (&x)[DPL]) {
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const int d = lane + 32 * i;
    x[i] = d < n ? to_f32(row[d]) : 0.0f;
  }
}

// What a split block works on: its (query row, head), keys [j0, j1) and the head's rows.
template <class T>
struct Split {
  int64_t pair, b, h, t, j0, j1, ldk, ldv;
  const T* kb;  // key 0 of this head
  const T* vb;
};
template <class T>
__device__ __forceinline__ Split<T> split_of(const DecArgs<T>& a) {
  Split<T> s;
  s.pair = blockIdx.x;
  const int64_t row = s.pair / a.H;
  s.h = s.pair % a.H, s.b = row / a.Tq, s.t = row % a.Tq;
  const int64_t visible = (a.p0s ? a.p0s[s.b] : a.pos0) + s.t + 1;
  s.j0 = int64_t(blockIdx.y) * a.keys, s.j1 = min64(s.j0 + a.keys, visible);
  const int64_t kvh = s.h / a.group, KVH = a.H / a.group;
  s.kb = (a.ks ? a.ks[s.b] : a.k + s.b * a.kseq) + kvh * a.hd;
  s.vb = (a.vs ? a.vs[s.b] : a.v + s.b * a.vseq) + kvh * a.hdv;
  s.ldk = KVH * a.hd, s.ldv = KVH * a.hdv;
  return s;
}
// This lane's dims of the scaled query: lane·DPL + i (packed) or lane + 32·i.
template <class T, int DPL>
__device__ __forceinline__ void load_query(const DecArgs<T>& a, const Split<T>& s, bool packed, int lane,
                                           float (&qv)[DPL]) {
  const T* qr = a.q + (s.b * a.Tq + s.t) * a.ldq + s.h * a.hd;
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const int d = packed ? lane * DPL + i : lane + 32 * i;
    qv[i] = d < a.hd ? to_f32(qr[d]) * a.scale : 0.0f;
  }
}
// One pass of the online softmax over U keys whose partial dots (this lane's dims) are in s; the
// first `valid` of them are keys (≥ 1). value(u, x) gives key u's value dims.
template <int U, int DPL, class Value>
__device__ __forceinline__ void softmax_pass(float (&s)[U], int64_t valid, float& m, float& l, float (&acc)[DPL],
                                             Value value) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int u = 0; u < U; ++u) s[u] += __shfl_xor_sync(0xffffffffu, s[u], o);
  float mx = m;
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (u < valid) mx = fmaxf(mx, s[u]);
  const float corr = exp2f(m - mx);
  l *= corr;
#pragma unroll
  for (int i = 0; i < DPL; ++i) acc[i] *= corr;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const float p = u < valid ? exp2f(s[u] - mx) : 0.0f;
    l += p;
    float vx[DPL];
    value(u, vx);
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] = fmaf(p, vx[i], acc[i]);
  }
  m = mx;
}
// The block's warps meet: warp 0 always has a key, so M is finite; a warp without one has l = acc
// = 0. One split: y = acc / l (and lse); else the partial (m, l, acc).
template <class T, int DPL>
__device__ __forceinline__ void finish_split(const DecArgs<T>& a, const Split<T>& s, bool packed, float m, float l,
                                             const float (&acc)[DPL]) {
  __shared__ float sm[kDecWarps], sl[kDecWarps], sacc[kDecWarps][32 * DPL];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (lane == 0) sm[warp] = m, sl[warp] = l;
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const int d = packed ? lane * DPL + i : lane + 32 * i;
    if (d < a.hdv) sacc[warp][d] = acc[i];
  }
  __syncthreads();
  float M = sm[0];
  for (int w = 1; w < kDecWarps; ++w) M = fmaxf(M, sm[w]);
  float wt[kDecWarps], L = 0.0f;
#pragma unroll
  for (int w = 0; w < kDecWarps; ++w) wt[w] = exp2f(sm[w] - M), L += sl[w] * wt[w];
  const bool direct = a.nsplit == 1;
  float* out = direct ? nullptr : a.part + (s.pair * a.nsplit + blockIdx.y) * (a.hdv + 2);
  for (int d = threadIdx.x; d < a.hdv; d += blockDim.x) {
    float x = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) x += sacc[w][d] * wt[w];
    if (direct)
      a.y[s.pair * a.hdv + d] = from_f32<T>(x / L);
    else
      out[2 + d] = x;
  }
  if (threadIdx.x == 0) {
    if (!direct)
      out[0] = M, out[1] = L;
    else if (a.lse)
      a.lse[(s.b * a.H + s.h) * a.Tq + s.t] = (M + log2f(L)) * kLn2;
  }
}

// Head dims that do not fill the lanes (hd or hdv ≠ 32·DPL): a warp loads its U keys' rows into
// registers, dims strided over the lanes, then scores and sums them.
template <class T, int DPL>
__global__ void __launch_bounds__(kDecWarps * 32) decode_split_kernel(DecArgs<T> a) {
  constexpr int U = DPL <= 4 ? 4 : 2;
  const Split<T> sp = split_of(a);
  if (sp.j0 >= sp.j1) return;  // past this row's keys (a grid sized for longer caches): the merge skips it
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  float qv[DPL], acc[DPL] = {};
  load_query(a, sp, false, lane, qv);
  float m = -FLT_MAX, l = 0.0f;
  for (int64_t j = sp.j0 + warp * U; j < sp.j1; j += kDecWarps * U) {
    float kx[U][DPL], vx[U][DPL], s[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // past j1: the last key again, its weight zero
      const int64_t jj = min64(j + u, sp.j1 - 1);
      load_dims<T, DPL>(sp.kb + jj * sp.ldk, lane, a.hd, kx[u]);
      load_dims<T, DPL>(sp.vb + jj * sp.ldv, lane, a.hdv, vx[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      s[u] = 0.0f;
#pragma unroll
      for (int i = 0; i < DPL; ++i) s[u] = fmaf(qv[i], kx[u][i], s[u]);
    }
    softmax_pass<U, DPL>(s, sp.j1 - j, m, l, acc, [&](int u, float (&x)[DPL]) {
#pragma unroll
      for (int i = 0; i < DPL; ++i) x[i] = vx[u][i];
    });
  }
  finish_split(a, sp, false, m, l, acc);
}

// Heads that fill the lanes (hd = hdv = 32·DPL): each warp streams its groups of U keys through
// a ring of S stages in shared memory by cp.async (16-byte pieces; rows off 16-byte alignment
// are copied by plain loads instead), so S − 1 groups' rows are in flight while one is scored.
template <class T, int DPL>
struct DecRing {
  static constexpr int U = 4;
  static constexpr int R = 32 * DPL * int(sizeof(T));        // bytes per row
  static constexpr int S = R >= 1024 ? 2 : R >= 512 ? 4 : 8;  // stages per warp
  static constexpr int kStage = 2 * U * R;                    // K rows then V rows
  static constexpr int kSmem = kDecWarps * S * kStage;        // ≤ 64 KB
};
template <class T, int DPL>
__global__ void __launch_bounds__(kDecWarps * 32) decode_ring_kernel(DecArgs<T> a) {
  using Ring = DecRing<T, DPL>;
  constexpr int U = Ring::U, S = Ring::S, R = Ring::R, kPieces = 2 * U * R / 16;
  extern __shared__ __align__(16) unsigned char dec_ring[];
  const Split<T> sp = split_of(a);
  if (sp.j0 >= sp.j1) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const bool async = ((reinterpret_cast<uintptr_t>(sp.kb) | reinterpret_cast<uintptr_t>(sp.vb)) & 15) == 0;
  unsigned char* ring = dec_ring + warp * S * Ring::kStage;
  const int64_t groups = (sp.j1 - sp.j0 + U - 1) / U;  // the warps take groups warp, warp + 4, ...
  const int64_t passes = groups > warp ? (groups - warp + kDecWarps - 1) / kDecWarps : 0;
  auto issue = [&](int64_t it) {  // pass it's rows into stage it % S (zeros past j1)
    if (it >= passes) return;
    unsigned char* st = ring + (it % S) * Ring::kStage;
    const int64_t key0 = sp.j0 + (warp + kDecWarps * it) * U;
    if (async) {
#pragma unroll
      for (int c = lane; c < kPieces; c += 32) {
        const int kv = c / (U * R / 16), u = (c / (R / 16)) % U, piece = c % (R / 16);
        const bool ok = key0 + u < sp.j1;
        const T* row = kv ? sp.vb + (ok ? key0 + u : sp.j0) * sp.ldv : sp.kb + (ok ? key0 + u : sp.j0) * sp.ldk;
        device::cp_async16_zfill(st + c * 16, reinterpret_cast<const char*>(row) + piece * 16, ok);
      }
    } else {
      constexpr int E = R / int(sizeof(T));  // elements per row
      T* dst = reinterpret_cast<T*>(st);
      for (int e = lane; e < 2 * U * E; e += 32) {
        const int kv = e / (U * E), u = (e / E) % U, d = e % E;
        const bool ok = key0 + u < sp.j1;
        dst[e] = ok ? (kv ? sp.vb[(key0 + u) * sp.ldv + d] : sp.kb[(key0 + u) * sp.ldk + d]) : from_f32<T>(0.0f);
      }
    }
  };
#pragma unroll
  for (int it = 0; it < S - 1; ++it) {
    issue(it);
    device::cp_async_commit();
  }
  float qv[DPL], acc[DPL] = {};
  load_query(a, sp, true, lane, qv);
  float m = -FLT_MAX, l = 0.0f;
  for (int64_t it = 0; it < passes; ++it) {
    issue(it + S - 1);
    device::cp_async_commit();
    device::cp_async_wait<S - 1>();  // this lane's pieces of pass it have landed ...
    __syncwarp();                    // ... and the other lanes'
    const T* st = reinterpret_cast<const T*>(ring + (it % S) * Ring::kStage);
    float s[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kx[DPL];
      load_packed<T, DPL>(st + u * (R / int(sizeof(T))) + lane * DPL, kx);
      s[u] = 0.0f;
#pragma unroll
      for (int i = 0; i < DPL; ++i) s[u] = fmaf(qv[i], kx[i], s[u]);
    }
    const int64_t key0 = sp.j0 + (warp + kDecWarps * it) * U;
    softmax_pass<U, DPL>(s, sp.j1 - key0, m, l, acc, [&](int u, float (&x)[DPL]) {
      load_packed<T, DPL>(st + (U + u) * (R / int(sizeof(T))) + lane * DPL, x);
    });
    __syncwarp();  // the stage is refilled by the next pass's issue (and orders the reads before it)
  }
  finish_split(a, sp, true, m, l, acc);
}

// The splits of one (query row, head): those that hold its visible keys wrote (m, l, acc).
template <class T>
__global__ void __launch_bounds__(128) decode_merge_kernel(DecArgs<T> a) {
  __shared__ float wt[kDecMaxSplits];
  __shared__ float red[2];
  const int64_t pair = blockIdx.x, row = pair / a.H, h = pair % a.H, b = row / a.Tq, t = row % a.Tq;
  const int64_t visible = (a.p0s ? a.p0s[b] : a.pos0) + t + 1;
  const int n = int(min64((visible + a.keys - 1) / a.keys, a.nsplit));
  const int64_t stride = a.hdv + 2;
  const float* p = a.part + pair * a.nsplit * stride;
  if (threadIdx.x < 32) {
    float M = -FLT_MAX;
    for (int s = threadIdx.x; s < n; s += 32) M = fmaxf(M, p[s * stride]);
    M = device::warp_max(M);
    float L = 0.0f;
    for (int s = threadIdx.x; s < n; s += 32) {
      wt[s] = exp2f(p[s * stride] - M);
      L += p[s * stride + 1] * wt[s];
    }
    L = device::warp_sum(L);
    if (threadIdx.x == 0) red[0] = M, red[1] = L;
  }
  __syncthreads();
  const float L = red[1];
  for (int d = threadIdx.x; d < a.hdv; d += blockDim.x) {
    float x = 0.0f;
    for (int s = 0; s < n; ++s) x += p[s * stride + 2 + d] * wt[s];
    a.y[pair * a.hdv + d] = from_f32<T>(x / L);
  }
  if (a.lse && threadIdx.x == 0) a.lse[(b * a.H + h) * a.Tq + t] = (red[0] + log2f(L)) * kLn2;
}

// Splits for `longest` keys (every row's p0 + Tq ≤ longest; keys past it would be dropped): the
// count (≤ kDecMaxSplits and ≤ ⌈longest / 64⌉) that minimises waves of resident blocks × (keys
// per split + 64), the 64 standing for a block's fixed cost and its partial's write and merge.
template <class T, int DPL>
void launch_decode_dpl(DecArgs<T> a, int64_t B, int64_t longest) {
  // The ring kernel where a head fills the lanes, else the register kernel.
  const bool ring = a.hd == 32 * DPL && a.hdv == 32 * DPL;
  static const int per_sm_regs = [] {
    int n = 0;
    K3_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_split_kernel<T, DPL>, kDecWarps * 32, 0));
    return n > 0 ? n : 1;
  }();
  constexpr int kSmem = DecRing<T, DPL>::kSmem;
  static const int per_sm_ring = [] {
    K3_CUDA_CHECK(cudaFuncSetAttribute(decode_ring_kernel<T, DPL>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    int n = 0;
    K3_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_ring_kernel<T, DPL>, kDecWarps * 32, kSmem));
    return n > 0 ? n : 1;
  }();
  const int64_t pairs = B * a.Tq * a.H, resident = int64_t(device::sm_count()) * (ring ? per_sm_ring : per_sm_regs);
  int64_t nsplit = 1, best = INT64_MAX;
  for (int64_t ns = 1; ns <= std::min<int64_t>(kDecMaxSplits, (longest + 63) / 64); ++ns) {
    const int64_t cost = (pairs * ns + resident - 1) / resident * ((longest + ns - 1) / ns + 64);
    if (cost < best) best = cost, nsplit = ns;
  }
  a.keys = (longest + nsplit - 1) / nsplit;
  a.nsplit = int((longest + a.keys - 1) / a.keys);
  if (pairs > INT32_MAX)
    throw error("attention", "a decode step takes at most 2^31 - 1 (query, head) pairs, got ", pairs);
  device::Buffer part;
  if (a.nsplit > 1) part = device::Buffer(size_t(pairs) * size_t(a.nsplit) * size_t(a.hdv + 2) * sizeof(float));
  a.part = part.as<float>();
  const dim3 grid(unsigned(pairs), unsigned(a.nsplit));
  if (ring)
    decode_ring_kernel<T, DPL><<<grid, kDecWarps * 32, kSmem, device::stream()>>>(a);
  else
    decode_split_kernel<T, DPL><<<grid, kDecWarps * 32, 0, device::stream()>>>(a);
  K3_CUDA_LAUNCHED();
  if (a.nsplit == 1) return;
  decode_merge_kernel<T><<<unsigned(pairs), 128, 0, device::stream()>>>(a);
  K3_CUDA_LAUNCHED();
}
template <class T>
void launch_decode(DecArgs<T> a, int64_t B, int64_t longest) {
  const int64_t widest = std::max(a.hd, a.hdv);
  if (widest <= 64)
    launch_decode_dpl<T, 2>(a, B, longest);
  else if (widest <= 128)
    launch_decode_dpl<T, 4>(a, B, longest);
  else
    launch_decode_dpl<T, 8>(a, B, longest);
}

void check_dims(int64_t hd, int64_t hdv) {
  if (hd < 1 || hdv < 1 || hd > kMaxHd || hdv > kMaxHd)
    throw error("attention", "the CUDA kernels take head dims 1..", kMaxHd, ", got hd = ", hd, ", hdv = ", hdv);
}
void check(const AttnShape& a) {
  check_dims(a.hd, a.hdv);
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

// D = Σ dy·y of every query row, [B, H, Tq] fp32: the backward's correction term.
template <class T>
device::Buffer row_dots(const void* y, const void* dy, const AttnShape& a) {
  device::Buffer D(size_t(a.B * a.H * a.Tq) * sizeof(float));
  const int64_t rows = a.B * a.Tq * a.H;
  const bool aligned16 = ((reinterpret_cast<uintptr_t>(y) | reinterpret_cast<uintptr_t>(dy)) & 15) == 0;
  if (std::is_same_v<T, __nv_bfloat16> && aligned16 && (a.hdv == 64 || a.hdv == 128)) {
    const auto* yb = static_cast<const __nv_bfloat16*>(y);
    const auto* dyb = static_cast<const __nv_bfloat16*>(dy);
    if (a.hdv == 64)
      rowdot_bf16_kernel<8><<<device::blocks_for(rows * 8, 256), 256, 0, device::stream()>>>(yb, dyb, D.as<float>(), a);
    else
      rowdot_bf16_kernel<16><<<device::blocks_for(rows * 16, 256), 256, 0, device::stream()>>>(yb, dyb, D.as<float>(),
                                                                                                 a);
  } else {
    rowdot_kernel<T><<<device::blocks_for(rows, 8), 256, 0, device::stream()>>>(
        static_cast<const T*>(y), static_cast<const T*>(dy), D.as<float>(), a);
  }
  K3_CUDA_LAUNCHED();
  return D;
}

template <class T, int DPT>
void launch_bwd(const void* q, const void* k, const void* v, const void* y, const float* lse, const void* dy,
                float* dq, float* dk, float* dv, const AttnShape& a, bool accumulate_kv) {
  const device::Buffer D = row_dots<T>(y, dy, a);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // tensor cores where the shape allows
    AttnGrads g;
    g.dq = dq, g.dk = dk, g.dv = dv, g.accumulate_kv = accumulate_kv;
    if (attention_backward_mma(q, k, v, lse, D.as<float>(), dy, g, a)) return;
  }
  if (!accumulate_kv) {  // the SIMT kernel adds: start dk and dv from zero
    device::zero(dk, size_t(a.B * a.S * a.H * a.hd) * sizeof(float));
    device::zero(dv, size_t(a.B * a.S * a.H * a.hdv) * sizeof(float));
  }
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
    K3_DISPATCH_STORAGE(st, T, {
      DecArgs<T> d{};
      d.q = static_cast<const T*>(q), d.ldq = a.H * a.hd;
      d.k = static_cast<const T*>(k), d.v = static_cast<const T*>(v);
      d.kseq = a.S * a.H * a.hd, d.vseq = a.S * a.H * a.hdv;
      d.pos0 = a.pos0;
      d.y = static_cast<T*>(y), d.lse = lse;
      d.Tq = 1, d.H = a.H, d.hd = a.hd, d.hdv = a.hdv, d.scale = a.scale * kLog2e;
      launch_decode<T>(d, a.B, a.pos0 + 1);
    });
    return;
  }
  if (st == device::Storage::BF16 && attention_forward_mma(q, k, v, y, lse, a)) return;  // tensor cores
  const bool wide = a.hd > 128 || a.hdv > 128;  // two register layouts: head dims ≤ 128 and ≤ 256
  K3_DISPATCH_STORAGE(st, T, wide ? launch_fwd<T, 64>(q, k, v, y, lse, a) : launch_fwd<T, 32>(q, k, v, y, lse, a));
}

void attention_cached(const void* q, int64_t ldq, const void* const* ks, const void* const* vs, const int64_t* p0s,
                      int64_t longest, void* y, int64_t B, int64_t Tq, int64_t H, int64_t hd, int64_t hdv, float scale,
                      Storage st, int64_t group) {
  check_dims(hd, hdv);
  if (group < 1 || H % group != 0) throw error("attention", H, " heads cannot share keys in groups of ", group);
  if (longest < Tq) throw error("attention", "longest = ", longest, " cannot hold ", Tq, " new queries");
  if (!B || !Tq || !H) return;
  K3_DISPATCH_STORAGE(st, T, {
    DecArgs<T> d{};
    d.q = static_cast<const T*>(q), d.ldq = ldq;
    d.ks = reinterpret_cast<const T* const*>(ks), d.vs = reinterpret_cast<const T* const*>(vs);
    d.p0s = p0s;
    d.y = static_cast<T*>(y);
    d.Tq = Tq, d.H = H, d.hd = hd, d.hdv = hdv, d.scale = scale * kLog2e, d.group = group;
    launch_decode<T>(d, B, longest);
  });
}

void attention_backward(const void* q, const void* k, const void* v, const void* y, const float* lse,
                        const void* dy, float* dq, float* dk, float* dv, const AttnShape& a, Storage st,
                        bool accumulate_kv) {
  check(a);
  if (!a.B || !a.Tq || !a.H) {
    if (!accumulate_kv && a.B && a.H) {  // no queries: the key and value gradients are zero
      device::zero(dk, size_t(a.B * a.S * a.H * a.hd) * sizeof(float));
      device::zero(dv, size_t(a.B * a.S * a.H * a.hdv) * sizeof(float));
    }
    return;
  }
  const bool wide = a.hd > 128 || a.hdv > 128;
  K3_DISPATCH_STORAGE(st, T,
                      wide ? launch_bwd<T, 64>(q, k, v, y, lse, dy, dq, dk, dv, a, accumulate_kv)
                           : launch_bwd<T, 32>(q, k, v, y, lse, dy, dq, dk, dv, a, accumulate_kv));
}

namespace {
// The packed arrays' checks: one sequence length, hd = hdv, bf16 pointers (element offsets).
void check_packed(const AttnShape& a) {
  check(a);
  if (a.Tq != a.S || a.pos0 != 0 || a.hd != a.hdv)
    throw error("attention", "packed q/k/v need a prefill (Tq = S, pos0 = 0) and hd = hdv, got Tq = ", a.Tq, ", S = ",
                a.S, ", pos0 = ", a.pos0, ", hd = ", a.hd, ", hdv = ", a.hdv);
}
const __nv_bfloat16* column_block(const void* qkv, int64_t i, int64_t D) {
  return static_cast<const __nv_bfloat16*>(qkv) + i * D;
}
}  // namespace

void attention_forward_qkv(const void* qkv, void* y, float* lse, const AttnShape& a) {
  check_packed(a);
  if (!a.B || !a.Tq || !a.H) return;
  const int64_t D = a.H * a.hd, M = a.B * a.Tq;
  const QkvRows rows{3 * D, 3 * D, 3 * D};
  if (attention_forward_mma(column_block(qkv, 0, D), column_block(qkv, 1, D), column_block(qkv, 2, D), y, lse, a,
                            &rows))
    return;
  // Other head dims: the three arrays apart, then the general kernels.
  device::Buffer q(size_t(M * D) * 2), k(size_t(M * D) * 2), v(size_t(M * D) * 2);
  split_qkv_bf16(qkv, q.get(), k.get(), v.get(), M, D);
  attention_forward(q.get(), k.get(), v.get(), y, lse, a, Storage::BF16);
}

void attention_backward_qkv(const void* qkv, const void* y, const float* lse, const void* dy, void* dqkv,
                            float* dbias, const AttnShape& a) {
  check_packed(a);
  const int64_t D = a.H * a.hd, M = a.B * a.Tq;
  if (!M || !D) return;
  device::Buffer dq = device::zeros_f32(M * D);
  const bool mma = (a.hd == 64 || a.hd == 128) && D % 8 == 0;
  if (mma) {
    const device::Buffer Drow = row_dots<__nv_bfloat16>(y, dy, a);
    AttnGrads g;
    g.dq = dq.as<float>(), g.accumulate_kv = false;
    g.dk_b = static_cast<__nv_bfloat16*>(dqkv) + D, g.dv_b = static_cast<__nv_bfloat16*>(dqkv) + 2 * D;
    g.ld_b = 3 * D;
    g.dbias_k = dbias ? dbias + D : nullptr, g.dbias_v = dbias ? dbias + 2 * D : nullptr;
    const QkvRows rows{3 * D, 3 * D, 3 * D};
    if (attention_backward_mma(column_block(qkv, 0, D), column_block(qkv, 1, D), column_block(qkv, 2, D), lse,
                               Drow.as<float>(), dy, g, a, &rows)) {
      // dq's bf16 rows into the first column block, its column sums into the bias gradient.
      to_bf16_with_column_sums(dq.as<float>(), M, D, dqkv, 3 * D, dbias);
      return;
    }
  }
  // Other shapes: apart, the general backward, merged.
  device::Buffer q(size_t(M * D) * 2), k(size_t(M * D) * 2), v(size_t(M * D) * 2), dk(size_t(M * D) * 4),
      dv(size_t(M * D) * 4);
  split_qkv_bf16(qkv, q.get(), k.get(), v.get(), M, D);
  attention_backward(q.get(), k.get(), v.get(), y, lse, dy, dq.as<float>(), dk.as<float>(), dv.as<float>(), a,
                     Storage::BF16, /*accumulate_kv=*/false);
  merge_qkv_bias(dq.as<float>(), dk.as<float>(), dv.as<float>(), M, D, nullptr, dqkv, dbias);
}

}  // namespace k3::cuda
