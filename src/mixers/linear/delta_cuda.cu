// The delta-rule family on CUDA: the recurrent form, forward (any T, so also the decode step) and
// backward, for every variant of the one table (Write × Decay; the normaliser is the host-side
// wrapper's extra value column). fp32 state; q/k/v/o (and do) stored in fp32 or bf16; β and the
// log-decays g always fp32 (exp(g) over hundreds of tokens amplifies bf16's 2^-9 rounding).
//
// Columns of S never mix (u_j, δ_j and o_j depend on column j alone), so one thread block per
// (sequence, value head, tile of 32 value columns) keeps its slice S [K, 32] in registers: 8 warps
// split the K rows, the 32 lanes the columns. Each thread owns the same elements for the whole
// sequence, so a column sum Sᵀx needs only the 8 warps' partials (shared memory), and a row sum
// S y a warp shuffle plus an atomic add across column tiles. Small register slices let several
// blocks share an SM, which the bandwidth-bound decode step needs. Inputs are staged in shared
// memory kTile tokens at a time. K ≤ 128; any V.
//
// Backward (README.md beside this file, "Backward"): a forward pass stores S at the start of
// every kTile-token chunk; then, chunk by chunk in reverse, the chunk's states S_{t-1} are
// recomputed into a per-thread scratch (each thread re-reads only what it wrote) and the adjoint
// dS is carried back token by token.
#include <algorithm>
#include <vector>

#include "core/cuda_util.cuh"
#include "core/device.h"
#include "mixers/linear/delta_cuda.h"
#include "mixers/linear/delta_internal.h"

namespace k3::linear::detail {
namespace {

using device::axpy4;
using device::from_f32;
using device::to_f32;
using device::warp_sum;

constexpr int kWarps = 8, kThreads = kWarps * 32;
constexpr int kRows = 16, kCols = 1;  // per thread: K ≤ kWarps·kRows; 32·kCols columns per block
constexpr int kKMax = kWarps * kRows, kVMax = 32 * kCols;
constexpr int kTile = 8;  // tokens staged per shared-memory tile (and backward chunk length)
constexpr int kPerThread = kRows * kCols;

struct Dev {
  int N, H, HV, K, V, group;
  int delta_write, decay;  // decay: 0 none, 1 scalar, 2 per-channel
  float scale;
  const int64_t* row0;  // [N] first token row of each sequence
  const int64_t* len;   // [N]
  const void *q, *k, *v;             // io dtype
  const float *beta, *g;             // fp32 always: gates and decays are sensitive (as in fla)
  const float* h0;                   // [N, HV, K, V] or null
  void* o;                           // [B·T, HV, V] io dtype, or fp32 when o_f32
  int o_f32, do_f32;                 // o / d_o kept fp32 (the normaliser's intermediates)
  float* ht;                         // [N, HV, K, V] or null
  float* const* states;              // decode: [N] per-sequence [HV, K, V], in place (h0, ht unused)
  // decode: q, k normalised over K; β = σ(beta); g from the gate's pre-activations (DecodePrologue)
  int l2norm, beta_logit, gate;  // gate: 0 log-decays, 1 softplus form, 2 lower-bound form
  float l2_eps, lower_bound;
  const float *A_log, *dt_bias;
  // backward
  const void* d_o;                   // io dtype or null
  const float* dht;
  float *dq, *dk, *dv, *dbeta, *dg, *dh0;  // fp32, zero-filled
  float* scratch;                    // per block: checkpoints + chunk history
  int64_t scratch_per_block;         // floats
};

// Shared-memory tile of kTile tokens: q pre-scaled, k, the decay multipliers a = exp(g), v, β.
struct Tile {
  float q[kTile][kKMax], k[kTile][kKMax], a[kTile][kKMax];
  float v[kTile][kVMax], b[kTile];
};

template <class T>
__device__ void load_tile(const Dev& p, Tile& s, int64_t r0, int nt, int h, int hv) {
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const float* g = p.g;
  const float* beta = p.beta;
  for (int idx = threadIdx.x; idx < nt * p.K; idx += kThreads) {
    const int tt = idx / p.K, d = idx % p.K;
    const int64_t r = r0 + tt;
    s.q[tt][d] = p.scale * to_f32(q[(r * p.H + h) * p.K + d]);
    s.k[tt][d] = to_f32(k[(r * p.H + h) * p.K + d]);
    float a = 1.0f;
    if (p.decay == 1) a = __expf(g[r * p.HV + hv]);
    if (p.decay == 2) a = __expf(g[(r * p.HV + hv) * p.K + d]);
    s.a[tt][d] = a;
  }
  const int c0 = blockIdx.y * kVMax, nc = min(kVMax, p.V - c0);  // this block's columns
  for (int idx = threadIdx.x; idx < nt * nc; idx += kThreads) {
    const int tt = idx / nc, jl = idx % nc;
    s.v[tt][jl] = to_f32(v[((r0 + tt) * p.HV + hv) * p.V + c0 + jl]);
  }
  for (int tt = threadIdx.x; tt < nt; tt += kThreads) s.b[tt] = p.delta_write ? beta[(r0 + tt) * p.HV + hv] : 1.0f;
}

// One token of the forward recurrence on the thread's elements: decay, δ (column sums through
// `red`), write. Leaves δ in `delta`; the caller reads the output. Two __syncthreads inside.
__device__ __forceinline__ void step_state(const Dev& p, const Tile& s, int tt, float (&S)[kRows][kCols],
                                           float (&delta)[kCols], float (&u)[kCols], float (*red)[kVMax], int warp,
                                           int lane, int rpw) {
  float pu[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) pu[c] = 0.0f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = warp * rpw + r;
    const bool row = r < rpw && i < p.K;
    const float a = row ? s.a[tt][i] : 0.0f, kk = row ? s.k[tt][i] : 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      S[r][c] *= a;
      pu[c] += S[r][c] * kk;
    }
  }
  __syncthreads();  // the previous token's readers of red are done
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int j = lane + 32 * c, jg = blockIdx.y * kVMax + j;
    if (jg < p.V) red[warp][j] = pu[c];
  }
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int j = lane + 32 * c, jg = blockIdx.y * kVMax + j;
    float uj = 0.0f;
    if (jg < p.V)
      for (int w = 0; w < kWarps; ++w) uj += red[w][j];
    u[c] = uj;
    const float vj = jg < p.V ? s.v[tt][j] : 0.0f;
    delta[c] = p.delta_write ? s.b[tt] * (vj - uj) : vj;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = warp * rpw + r;
    const float kk = (r < rpw && i < p.K) ? s.k[tt][i] : 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) S[r][c] += kk * delta[c];
  }
}

__device__ __forceinline__ void load_state(const Dev& p, const float* src, float (&S)[kRows][kCols], int warp,
                                           int lane, int rpw) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = warp * rpw + r;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int j = lane + 32 * c, jg = blockIdx.y * kVMax + j;
      S[r][c] = (src && r < rpw && i < p.K && jg < p.V) ? src[i * p.V + jg] : 0.0f;
    }
  }
}

__device__ __forceinline__ void store_state(const Dev& p, float* dst, const float (&S)[kRows][kCols], int warp,
                                            int lane, int rpw) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int i = warp * rpw + r;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int j = lane + 32 * c, jg = blockIdx.y * kVMax + j;
      if (r < rpw && i < p.K && jg < p.V) dst[i * p.V + jg] = S[r][c];
    }
  }
}

// Per-thread scratch (coalesced: element e of thread t at e·kThreads + t).
__device__ __forceinline__ void save_private(float* dst, const float (&S)[kRows][kCols]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) dst[(r * kCols + c) * kThreads + threadIdx.x] = S[r][c];
}
__device__ __forceinline__ void load_private(const float* src, float (&S)[kRows][kCols]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) S[r][c] = src[(r * kCols + c) * kThreads + threadIdx.x];
}

// At least 4 blocks per SM (≤ 64 registers): the decode step needs that many loads in flight.
template <class T>
__global__ void __launch_bounds__(kThreads, 4) forward_kernel(Dev p) {
  const int n = blockIdx.x / p.HV, hv = blockIdx.x % p.HV, h = hv / p.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, rpw = (p.K + kWarps - 1) / kWarps;
  const int64_t row0 = p.row0[n], len = p.len[n];
  const int64_t soff = (int64_t(n) * p.HV + hv) * p.K * p.V;
  __shared__ Tile s;
  __shared__ float red[kWarps][kVMax], red2[kWarps][kVMax];
  float S[kRows][kCols], delta[kCols], u[kCols];
  load_state(p, p.h0 ? p.h0 + soff : nullptr, S, warp, lane, rpw);
  T* o = static_cast<T*>(p.o);
  for (int64_t t0 = 0; t0 < len; t0 += kTile) {
    const int nt = int(len - t0 < kTile ? len - t0 : kTile);
    __syncthreads();  // everyone is done with the previous tile
    load_tile<T>(p, s, row0 + t0, nt, h, hv);
    __syncthreads();
    for (int tt = 0; tt < nt; ++tt) {
      step_state(p, s, tt, S, delta, u, red, warp, lane, rpw);
      float po[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) po[c] = 0.0f;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = warp * rpw + r;
        const float qq = (r < rpw && i < p.K) ? s.q[tt][i] : 0.0f;
#pragma unroll
        for (int c = 0; c < kCols; ++c) po[c] += S[r][c] * qq;
      }
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int j = lane + 32 * c, jg = blockIdx.y * kVMax + j;
        if (jg < p.V) red2[warp][j] = po[c];
      }
      __syncthreads();
      const int64_t r = row0 + t0 + tt;
      const int c0 = blockIdx.y * kVMax, nc = min(kVMax, p.V - c0);
      for (int j = threadIdx.x; j < nc; j += kThreads) {
        float acc = 0.0f;
        for (int w = 0; w < kWarps; ++w) acc += red2[w][j];
        if (p.o_f32)
          static_cast<float*>(p.o)[(r * p.HV + hv) * p.V + c0 + j] = acc;
        else
          o[(r * p.HV + hv) * p.V + c0 + j] = from_f32<T>(acc);
      }
      // red2 is rewritten only after the next token's two barriers in step_state.
    }
  }
  if (p.ht) store_state(p, p.ht + soff, S, warp, lane, rpw);
}

template <class T>
__global__ void __launch_bounds__(kThreads) backward_kernel(Dev p) {
  const int n = blockIdx.x / p.HV, hv = blockIdx.x % p.HV, h = hv / p.group;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, rpw = (p.K + kWarps - 1) / kWarps;
  const int64_t row0 = p.row0[n], len = p.len[n];
  const int64_t soff = (int64_t(n) * p.HV + hv) * p.K * p.V;
  const int64_t nchunks = (len + kTile - 1) / kTile;
  float* ckpt = p.scratch + (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * p.scratch_per_block;  // [nchunks][kPerThread][kThreads]
  float* hist = ckpt + nchunks * kPerThread * kThreads;                    // [kTile][kPerThread][kThreads]
  __shared__ Tile s;
  __shared__ float red[kWarps][kVMax];
  __shared__ float sdo[kTile][kVMax], sdel[kTile][kVMax], su[kTile][kVMax];
  __shared__ float sred[32];
  float S[kRows][kCols], delta[kCols], u[kCols];

  // Pass 1: checkpoints S at each chunk start.
  load_state(p, p.h0 ? p.h0 + soff : nullptr, S, warp, lane, rpw);
  for (int64_t c = 0; c < nchunks; ++c) {
    save_private(ckpt + c * kPerThread * kThreads, S);
    const int nt = int(len - c * kTile < kTile ? len - c * kTile : kTile);
    __syncthreads();
    load_tile<T>(p, s, row0 + c * kTile, nt, h, hv);
    __syncthreads();
    for (int tt = 0; tt < nt; ++tt) step_state(p, s, tt, S, delta, u, red, warp, lane, rpw);
  }

  // Pass 2: the adjoint, chunk by chunk in reverse.
  float dS[kRows][kCols];
  load_state(p, p.dht ? p.dht + soff : nullptr, dS, warp, lane, rpw);
  const T* d_o = static_cast<const T*>(p.d_o);
  for (int64_t c = nchunks - 1; c >= 0; --c) {
    const int64_t r0 = row0 + c * kTile;
    const int nt = int(len - c * kTile < kTile ? len - c * kTile : kTile);
    __syncthreads();
    load_tile<T>(p, s, r0, nt, h, hv);
    const int c0 = blockIdx.y * kVMax, nc = min(kVMax, p.V - c0);
    for (int idx = threadIdx.x; idx < nt * nc; idx += kThreads) {
      const int tt = idx / nc, j = idx % nc;
      const int64_t e = ((r0 + tt) * p.HV + hv) * p.V + c0 + j;
      sdo[tt][j] = !d_o ? 0.0f : p.do_f32 ? static_cast<const float*>(p.d_o)[e] : to_f32(d_o[e]);
    }
    __syncthreads();
    // Recompute the chunk: S_{t-1} into hist, δ and u into shared memory.
    load_private(ckpt + c * kPerThread * kThreads, S);
    for (int tt = 0; tt < nt; ++tt) {
      save_private(hist + int64_t(tt) * kPerThread * kThreads, S);
      step_state(p, s, tt, S, delta, u, red, warp, lane, rpw);
      if (warp == 0) {
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) {
          const int j = lane + 32 * cc, jg = blockIdx.y * kVMax + j;
          if (jg < p.V) {
            sdel[tt][j] = delta[cc];
            su[tt][j] = u[cc];
          }
        }
      }
    }
    __syncthreads();
    for (int tt = nt - 1; tt >= 0; --tt) {
      const int64_t r = r0 + tt;
      float Sd[kRows][kCols];
      load_private(hist + int64_t(tt) * kPerThread * kThreads, Sd);
      float dl[kCols], dov[kCols];
#pragma unroll
      for (int cc = 0; cc < kCols; ++cc) {
        const int j = lane + 32 * cc, jg = blockIdx.y * kVMax + j;
        dl[cc] = jg < p.V ? sdel[tt][j] : 0.0f;
        dov[cc] = jg < p.V ? sdo[tt][j] : 0.0f;
      }
      // Sd = a ∘ S_{t-1}; S_t = Sd + k δᵀ; dS += (s q) doᵀ; row sums for dq; column sums for dδ.
      float dqr[kRows], dkr[kRows], pdd[kCols];
#pragma unroll
      for (int cc = 0; cc < kCols; ++cc) pdd[cc] = 0.0f;
#pragma unroll
      for (int rr = 0; rr < kRows; ++rr) {
        const int i = warp * rpw + rr;
        const bool row = rr < rpw && i < p.K;
        const float a = row ? s.a[tt][i] : 0.0f, kk = row ? s.k[tt][i] : 0.0f, qq = row ? s.q[tt][i] : 0.0f;
        float accq = 0.0f, acck = 0.0f;
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) {
          Sd[rr][cc] *= a;
          const float St = Sd[rr][cc] + kk * dl[cc];
          dS[rr][cc] += qq * dov[cc];
          accq += St * dov[cc];
          acck += dS[rr][cc] * dl[cc];
          pdd[cc] += dS[rr][cc] * kk;
        }
        dqr[rr] = accq;
        dkr[rr] = acck;
      }
#pragma unroll
      for (int cc = 0; cc < kCols; ++cc) {
        const int j = lane + 32 * cc, jg = blockIdx.y * kVMax + j;
        if (jg < p.V) red[warp][j] = pdd[cc];
      }
      __syncthreads();
      float du[kCols], pb = 0.0f;
      const float beta = s.b[tt];
#pragma unroll
      for (int cc = 0; cc < kCols; ++cc) {
        const int j = lane + 32 * cc, jg = blockIdx.y * kVMax + j;
        float dd = 0.0f;
        if (jg < p.V)
          for (int w = 0; w < kWarps; ++w) dd += red[w][j];
        const float vj = jg < p.V ? s.v[tt][j] : 0.0f;
        if (p.delta_write) {
          const float uj = jg < p.V ? su[tt][j] : 0.0f;
          pb += dd * (vj - uj);
          du[cc] = -beta * dd;
          if (warp == 0 && jg < p.V) p.dv[(r * p.HV + hv) * p.V + jg] = beta * dd;
        } else {
          du[cc] = 0.0f;
          if (warp == 0 && jg < p.V) p.dv[(r * p.HV + hv) * p.V + jg] = dd;
        }
      }
      if (p.delta_write && warp == 0) {
        pb = warp_sum(pb);
        if (lane == 0) atomicAdd(&p.dbeta[r * p.HV + hv], pb);  // column tiles add up
      }
      // dS' = dS + k duᵀ; dk += Sd du; dg = Σ_j dS'·Sd; dS_{t-1} = a ∘ dS'.
      float dgr[kRows], dgs = 0.0f;
#pragma unroll
      for (int rr = 0; rr < kRows; ++rr) {
        const int i = warp * rpw + rr;
        const bool row = rr < rpw && i < p.K;
        const float a = row ? s.a[tt][i] : 0.0f, kk = row ? s.k[tt][i] : 0.0f;
        float acck = 0.0f, accg = 0.0f;
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) {
          dS[rr][cc] += kk * du[cc];
          acck += Sd[rr][cc] * du[cc];
          accg += dS[rr][cc] * Sd[rr][cc];
          dS[rr][cc] *= a;
        }
        dkr[rr] += acck;
        dgr[rr] = accg;
        dgs += accg;
      }
      // Row sums across the warp's lanes; lane (rr % 32) writes row rr.
#pragma unroll
      for (int rr = 0; rr < kRows; ++rr) {
        const int i = warp * rpw + rr;
        const float sq = warp_sum(dqr[rr]), sk = warp_sum(dkr[rr]);
        float sg = 0.0f;
        if (p.decay == 2) sg = warp_sum(dgr[rr]);
        if (rr < rpw && i < p.K && lane == (rr & 31)) {
          atomicAdd(&p.dq[(r * p.H + h) * p.K + i], p.scale * sq);
          atomicAdd(&p.dk[(r * p.H + h) * p.K + i], sk);
          if (p.decay == 2) atomicAdd(&p.dg[(r * p.HV + hv) * p.K + i], sg);
        }
      }
      if (p.decay == 1) {
        const float tot = device::block_sum(dgs, sred);
        if (threadIdx.x == 0) atomicAdd(&p.dg[r * p.HV + hv], tot);
      }
      __syncthreads();  // red is rewritten by the next token
    }
  }
  store_state(p, p.dh0 + soff, dS, warp, lane, rpw);
}

// The decode step (every sequence one token), the bandwidth-bound case: each element of S is read
// once and written once. One block per (sequence, value head, tile of 64 value columns); a row of
// the tile is 256 bytes, read by 16 lanes as float4s, so each load instruction of a warp fetches 2
// whole 256-byte stretches (for V a multiple of 64, as every model's heads are). Rows go
// round-robin to the block's 16 row groups (2 per warp): 8 rows × 4 columns of S per thread for
// K ≤ 128, 32 registers, 4 blocks of 256 threads per SM. The state loads are issued before q, k
// and the decays are staged (one barrier). The column sums (u = Sᵀk after the decay, o = Sᵀq after
// the write) are a shuffle across the warp's two row groups and an exchange across warps in shared
// memory, a barrier each. Whole 256-byte stretches read faster than 128-byte pieces of each
// 512-byte row (docs/performance.md has the step's fraction of the copy rate); 128 columns (one
// 512-thread block per head) and 4 or 16 rows per thread are slower. The kernel waits on the
// previous grid (griddepcontrol.wait, a no-op unless launched as a programmatic dependent) before
// it reads anything, so a replayed decode loop overlaps each step's launch with the last one's
// tail.
constexpr int kDecodeRows = 8, kDecodeCols = 64, kDecodeLanes = kDecodeCols / 4;  // lanes per row
constexpr int kDecodeGroups = kKMax / kDecodeRows, kDecodeWarps = kDecodeGroups * kDecodeLanes / 32;
constexpr int kDecodeBlocksPerSM = 4;  // launch bounds: ≤ 64 registers per thread
static_assert(kDecodeGroups * kDecodeRows == kKMax && kDecodeWarps * 32 == kDecodeGroups * kDecodeLanes,
              "the row groups times the rows per thread cover kKMax, and the warps the row groups");

// Four columns j…j+3 of one row of S (zeros past V). `Vec`: V % 4 == 0 and S 16-byte aligned, so
// the four are one aligned float4 (every row starts at a multiple of 4 floats) and lie wholly
// inside or outside. A template argument: the scalar form's predicated loads, unrolled over the
// rows beside the vector form, doubled the step's instructions.
template <bool Vec>
__device__ __forceinline__ float4 load_cols(const float* row, int j, int V) {
  if (Vec) return j < V ? __ldcs(reinterpret_cast<const float4*>(row + j)) : make_float4(0, 0, 0, 0);
  return make_float4(j < V ? row[j] : 0.0f, j + 1 < V ? row[j + 1] : 0.0f, j + 2 < V ? row[j + 2] : 0.0f,
                     j + 3 < V ? row[j + 3] : 0.0f);
}
template <bool Vec>
__device__ __forceinline__ void store_cols(float* row, int j, int V, float4 x) {
  if (Vec) {
    if (j < V) __stcs(reinterpret_cast<float4*>(row + j), x);
    return;
  }
  if (j < V) row[j] = x.x;
  if (j + 1 < V) row[j + 1] = x.y;
  if (j + 2 < V) row[j + 2] = x.z;
  if (j + 3 < V) row[j + 3] = x.w;
}
// Sum over the warp's row groups (lanes kDecodeLanes apart), then over the block's warps: every
// thread gets the totals of its 4 columns. `red` holds one float4 per (warp, column lane).
__device__ __forceinline__ float4 column_sums(float4 x, float4 (*red)[kDecodeLanes], int warp, int lane) {
#pragma unroll
  for (int m = kDecodeLanes; m < 32; m *= 2) {
    x.x += __shfl_xor_sync(0xffffffffu, x.x, m);
    x.y += __shfl_xor_sync(0xffffffffu, x.y, m);
    x.z += __shfl_xor_sync(0xffffffffu, x.z, m);
    x.w += __shfl_xor_sync(0xffffffffu, x.w, m);
  }
  const int c = lane % kDecodeLanes;
  if (lane < kDecodeLanes) red[warp][c] = x;
  __syncthreads();
  float4 t = red[0][c];
#pragma unroll 3  // unrolled whole, the eight loads in flight beside S's 32 registers spill
  for (int w = 1; w < kDecodeWarps; ++w) {
    const float4 y = red[w][c];
    t.x += y.x, t.y += y.y, t.z += y.z, t.w += y.w;
  }
  return t;
}

// σ(x) and the KDA gate forms of ops/gates.h on one pre-activation x (dt_bias at index `c`).
__device__ __forceinline__ float sigmoid_of(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + __expf(-x));
  const float e = __expf(x);
  return e / (1.0f + e);
}
// The gate's log-decay from its pre-activation x, given A_log and dt_bias for this channel.
__device__ __forceinline__ float gate_of(const Dev& p, float x, float A_log, float dt_bias) {
  const float a = __expf(A_log), u = x + dt_bias;
  if (p.gate == 1) return -a * (fmaxf(u, 0.0f) + log1pf(__expf(-fabsf(u))));  // −a · softplus(u)
  return p.lower_bound * sigmoid_of(a * u);
}

// Stages q (scaled), k and the decay multipliers a = exp(g) of token r, head h / value head hv in
// shared memory, zeros past K (so the rows past K, zero in S, need no guard but at the store).
// Fused: from the layer's raw activations (Dev::l2norm, gate), q and k normalised.
template <class T, bool Fused>
__device__ __forceinline__ void stage_decode(const Dev& p, int64_t r, int h, int hv, int j0, float* sq, float* sk,
                                             float* sa, float* sv, int warp, int lane) {
  static_assert(kDecodeWarps * 32 > kKMax + kDecodeCols, "a thread per row of S, per value column and for β");
  const int K = p.K;
  // v's columns of this tile, by the threads past the rows, with q and k: loaded after the first
  // column sum they put one more memory round trip on every block's path (1–2 % at N 64).
  if (const int c = int(threadIdx.x) - kKMax; c >= 0 && c < kDecodeCols)
    sv[c] = j0 + c < p.V ? to_f32(static_cast<const T*>(p.v)[(r * p.HV + hv) * p.V + j0 + c]) : 0.0f;
  float nq = 0.0f, nk = 0.0f;  // ‖q‖², ‖k‖²
  if (const int i = threadIdx.x; i >= K && i < kKMax) sq[i] = sk[i] = sa[i] = 0.0f;
  if (const int i = threadIdx.x; i < K) {
    const float qi = to_f32(static_cast<const T*>(p.q)[(r * p.H + h) * K + i]);
    const float ki = to_f32(static_cast<const T*>(p.k)[(r * p.H + h) * K + i]);
    const int64_t gi = p.decay == 1 ? r * p.HV + hv : (r * p.HV + hv) * K + i;
    const float x = p.decay ? p.g[gi] : 0.0f;
    const bool gate = Fused && p.decay && p.gate;
    const float A_log = gate ? p.A_log[hv] : 0.0f, dt_bias = gate ? p.dt_bias[p.decay == 1 ? hv : hv * K + i] : 0.0f;
    sq[i] = qi * p.scale;
    sk[i] = ki;
    sa[i] = p.decay ? __expf(gate ? gate_of(p, x, A_log, dt_bias) : x) : 1.0f;
    if (Fused) nq += qi * qi, nk += ki * ki;
  }
  if (threadIdx.x == kKMax + kDecodeCols) {  // β (fused: its logit through σ) into sa[kKMax]
    const float b = p.delta_write ? p.beta[r * p.HV + hv] : 1.0f;
    sa[kKMax] = Fused && p.delta_write && p.beta_logit ? sigmoid_of(b) : b;
  }
  if (Fused && p.l2norm) {  // q/‖q‖, k/‖k‖ in place: each thread rescales the elements it staged
    __shared__ float2 norms[kDecodeWarps];
    nq = warp_sum(nq), nk = warp_sum(nk);
    if (lane == 0) norms[warp] = make_float2(nq, nk);
    __syncthreads();
    nq = nk = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) nq += norms[w].x, nk += norms[w].y;
    const float rq = rsqrtf(nq + p.l2_eps), rk = rsqrtf(nk + p.l2_eps);
    if (const int i = threadIdx.x; i < K) sq[i] *= rq, sk[i] *= rk;
  }
  __syncthreads();
}

// Fused (the layer's activations in the kernel): staged before the state is loaded, whose 32
// registers would otherwise be live through the gate's arithmetic and spill; plain: the state's
// loads are issued first, so that they are in flight while q, k and the decays are staged.
template <class T, bool Fused, bool Vec>
__global__ void __launch_bounds__(kDecodeWarps * 32, kDecodeBlocksPerSM) decode_kernel(Dev p) {
  constexpr int G = kDecodeGroups;
  const int K = p.K, V = p.V;
  __shared__ float sq[kKMax], sk[kKMax], sa[kKMax + 1];
  __shared__ __align__(16) float sv[kDecodeCols];
  __shared__ float4 red_u[kDecodeWarps][kDecodeLanes], red_o[kDecodeWarps][kDecodeLanes];
  // A head's column tiles are consecutive blocks, so the blocks running at one time read whole
  // stretches of the state (each tile alone touches half of every 512-byte row).
  const int tiles = (p.V + kDecodeCols - 1) / kDecodeCols, nh = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int n = nh / p.HV, hv = nh % p.HV, h = hv / p.group;
  constexpr int kRowsPerWarp = 32 / kDecodeLanes;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, rg = warp * kRowsPerWarp + lane / kDecodeLanes;
  const int j = tile * kDecodeCols + 4 * (lane % kDecodeLanes);  // the first of this thread's 4 columns
  // A programmatic dependent launch may start before the previous grid ends: nothing it wrote is
  // read before this. The next step's launch may begin at once (it waits here in turn).
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int64_t r = p.row0 ? p.row0[n] : n;  // this sequence's token row
  // Where the state is read and written: one [N, HV, K, V] array each, or each sequence's own.
  const float* src = p.h0;
  float* dst = p.ht;
  int64_t soff = (int64_t(n) * p.HV + hv) * K * V + int64_t(rg) * V;  // + row offsets G·V·rr
  if (p.states) {
    dst = p.states[n];
    src = dst;
    soff = int64_t(hv) * K * V + int64_t(rg) * V;
  }
  if (Fused) stage_decode<T, true>(p, r, h, hv, tile * kDecodeCols, sq, sk, sa, sv, warp, lane);
  float4 S[kDecodeRows];
#pragma unroll
  for (int rr = 0; rr < kDecodeRows; ++rr) {
    const int i = rg + G * rr;
    S[rr] = src && i < K ? load_cols<Vec>(src + soff + G * V * rr, j, V) : make_float4(0, 0, 0, 0);
  }
  if (!Fused) stage_decode<T, false>(p, r, h, hv, tile * kDecodeCols, sq, sk, sa, sv, warp, lane);
  // Volatile reads keep q, k and a in shared memory: hoisted into registers ahead of their use
  // they would take as many registers as S and halve the blocks in flight.
  const volatile float* vq = sq;
  const volatile float* vk = sk;
  const volatile float* va = sa;
  float4 u = make_float4(0, 0, 0, 0);
#pragma unroll
  for (int rr = 0; rr < kDecodeRows; ++rr) {
    const int i = rg + G * rr;
    const float a = va[i], kk = vk[i];
    S[rr].x *= a, S[rr].y *= a, S[rr].z *= a, S[rr].w *= a;
    axpy4(u, kk, S[rr]);
  }
  u = column_sums(u, red_u, warp, lane);
  float4 d;  // the write's value: β (v − u) for the delta rule, v for the additive one
  {
    const float beta = sa[kKMax];
    const float4 vj4 = reinterpret_cast<const float4*>(sv)[lane % kDecodeLanes];
    const float vj[4] = {vj4.x, vj4.y, vj4.z, vj4.w};
    d = p.delta_write ? make_float4(beta * (vj[0] - u.x), beta * (vj[1] - u.y), beta * (vj[2] - u.z), beta * (vj[3] - u.w))
                      : make_float4(vj[0], vj[1], vj[2], vj[3]);
  }
  float4 o = make_float4(0, 0, 0, 0);
#pragma unroll
  for (int rr = 0; rr < kDecodeRows; ++rr) {
    const int i = rg + G * rr;
    if (i < K) {
      const float kk = vk[i], qq = vq[i];
      axpy4(S[rr], kk, d);
      axpy4(o, qq, S[rr]);
      if (dst) store_cols<Vec>(dst + soff + G * V * rr, j, V, S[rr]);
    }
  }
  o = column_sums(o, red_o, warp, lane);
  if (threadIdx.x < kDecodeLanes) {
    const int64_t oi = (r * p.HV + hv) * V;
    const float oj[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (j + e >= V) break;
      if (p.o_f32)
        static_cast<float*>(p.o)[oi + j + e] = oj[e];
      else
        static_cast<T*>(p.o)[oi + j + e] = from_f32<T>(oj[e]);
    }
  }
}

Dev to_dev(const cuda::DeviceArgs& a) {
  cuda::check_supported(a.K, a.V);
  Dev d{};
  d.N = int(a.N), d.H = int(a.H), d.HV = int(a.HV), d.K = int(a.K), d.V = int(a.V);
  d.group = int(a.HV / a.H);
  d.delta_write = a.write == Write::Delta;
  d.decay = a.decay == Decay::None ? 0 : a.decay == Decay::Scalar ? 1 : 2;
  d.scale = a.scale > 0.0f ? a.scale : 1.0f / sqrtf(float(a.K));
  d.row0 = a.row0, d.len = a.len;
  d.o_f32 = a.io != DType::BF16 || a.o_dtype != DType::BF16;
  d.q = a.q, d.k = a.k, d.v = a.v, d.beta = a.beta, d.g = a.g, d.h0 = a.h0, d.o = a.o, d.ht = a.ht;
  d.states = a.states;
  const cuda::DecodePrologue& pr = a.prologue;
  d.l2norm = pr.l2norm, d.beta_logit = pr.beta_logit, d.gate = int(pr.gate);
  d.l2_eps = pr.l2_eps, d.lower_bound = pr.lower_bound, d.A_log = pr.A_log, d.dt_bias = pr.dt_bias;
  return d;
}

// Host side: copies a host problem to the device (fp32 or rounded to bf16), runs, copies back.
struct Staged {
  device::Buffer q, k, v, beta, g, h0, row0, len, o, ht, d_o, dht, dq, dk, dv, dbeta, dg, dh0;
  cuda::DeviceArgs args;
};

device::Buffer put(const float* src, int64_t n, bool bf16) {
  return device::upload_values(src, n, bf16 ? device::Storage::BF16 : device::Storage::F32);
}
void get(float* dst, const device::Buffer& b, int64_t n, bool bf16) {
  device::download_values(dst, b, n, bf16 ? device::Storage::BF16 : device::Storage::F32);
}

Staged stage(const Problem& p, bool bf16) {
  cuda::check_supported(p.K, p.V);
  Staged st;
  const int64_t rows = p.B * p.T;
  st.q = put(p.q, rows * p.H * p.K, bf16);
  st.k = put(p.k, rows * p.H * p.K, bf16);
  st.v = put(p.v, rows * p.HV * p.V, bf16);
  st.beta = put(p.beta, p.beta ? rows * p.HV : 0, false);
  const int64_t gn = p.decay == Decay::None ? 0 : p.decay == Decay::Scalar ? rows * p.HV : rows * p.HV * p.K;
  st.g = put(p.g, gn, false);
  st.h0 = put(p.h0, p.N * p.HV * p.K * p.V, false);
  std::vector<int64_t> r0, ln;
  for (const Segment& s : p.seqs) {
    r0.push_back(s.row0);
    ln.push_back(s.len);
  }
  st.row0 = device::upload_new(r0.data(), r0.size() * sizeof(int64_t));
  st.len = device::upload_new(ln.data(), ln.size() * sizeof(int64_t));
  cuda::DeviceArgs a;
  a.N = p.N, a.H = p.H, a.HV = p.HV, a.K = p.K, a.V = p.V, a.write = p.write, a.decay = p.decay, a.scale = p.scale;
  a.io = bf16 ? DType::BF16 : DType::F32;
  a.row0 = st.row0.as<int64_t>(), a.len = st.len.as<int64_t>();
  a.q = st.q.get(), a.k = st.k.get(), a.v = st.v.get(), a.beta = st.beta.as<float>(), a.g = st.g.as<float>();
  a.h0 = st.h0.as<float>();
  for (const Segment& sg : p.seqs) a.max_len = std::max(a.max_len, sg.len);
  st.args = a;
  return st;
}

}  // namespace

void cuda_forward(const Problem& p, const Outputs& out, DType io, DType o_dtype, Impl impl) {
  const bool bf16 = io == DType::BF16;
  Staged st = stage(p, bf16);
  st.args.o_dtype = o_dtype;
  st.args.form = impl == Impl::Chunked ? cuda::Form::Chunked : cuda::Form::Recurrent;
  const bool o16 = bf16 && o_dtype == DType::BF16;
  const int64_t rows = p.B * p.T, esz = o16 ? 2 : 4;
  st.o = device::Buffer(size_t(rows * p.HV * p.V * esz));
  st.ht = device::Buffer(size_t(p.N * p.HV * p.K * p.V) * 4);
  st.args.o = st.o.get();
  st.args.ht = st.ht.as<float>();
  cuda::forward(st.args);
  get(out.o, st.o, rows * p.HV * p.V, o16);
  if (out.ht) get(out.ht, st.ht, p.N * p.HV * p.K * p.V, false);
}

void cuda_backward(const Problem& p, const Grads& gr, DType io, DType do_dtype, Impl impl) {
  const bool bf16 = io == DType::BF16;
  Staged st = stage(p, bf16);
  st.args.form = impl == Impl::Chunked ? cuda::Form::Chunked : cuda::Form::Recurrent;
  const int64_t rows = p.B * p.T;
  st.d_o = put(gr.d_o, gr.d_o ? rows * p.HV * p.V : 0, bf16 && do_dtype == DType::BF16);
  st.dht = put(gr.dht, gr.dht ? p.N * p.HV * p.K * p.V : 0, false);
  auto zeros = device::zeros_f32;
  st.dq = zeros(rows * p.H * p.K);
  st.dk = zeros(rows * p.H * p.K);
  st.dv = zeros(rows * p.HV * p.V);
  st.dbeta = zeros(rows * p.HV);
  st.dg = zeros(p.decay == Decay::PerChannel ? rows * p.HV * p.K : rows * p.HV);
  st.dh0 = zeros(p.N * p.HV * p.K * p.V);
  cuda::DeviceGrads g;
  g.do_dtype = do_dtype;
  for (const Segment& sg : p.seqs) g.longest = std::max(g.longest, sg.len);
  g.d_o = st.d_o.get();
  g.dht = st.dht.as<float>();
  g.dq = st.dq.as<float>(), g.dk = st.dk.as<float>(), g.dv = st.dv.as<float>();
  g.dbeta = st.dbeta.as<float>(), g.dg = st.dg.as<float>(), g.dh0 = st.dh0.as<float>();
  cuda::backward(st.args, g);
  // Host gradient buffers arrive zero-filled; the kernels wrote complete gradients.
  get(gr.dq, st.dq, rows * p.H * p.K, false);
  get(gr.dk, st.dk, rows * p.H * p.K, false);
  get(gr.dv, st.dv, rows * p.HV * p.V, false);
  if (gr.dbeta) get(gr.dbeta, st.dbeta, rows * p.HV, false);
  if (gr.dg) get(gr.dg, st.dg, p.decay == Decay::PerChannel ? rows * p.HV * p.K : rows * p.HV, false);
  if (gr.dh0) get(gr.dh0, st.dh0, p.N * p.HV * p.K * p.V, false);
}

}  // namespace k3::linear::detail

namespace k3::linear::cuda {

void check_supported(int64_t K, int64_t V) {
  using namespace detail;
  if (K < 1 || V < 1 || K > kKMax)
    throw error("delta", "the CUDA kernels take 1 ≤ K ≤ ", kKMax, " and V ≥ 1, got K = ", K, ", V = ", V);
}

void forward(const DeviceArgs& a) {
  using namespace detail;
  if (a.states && (a.max_len != 1 || a.form != cuda::Form::Auto))
    throw error("delta", "per-sequence states in place are for the decode step (max_len 1), got max_len ", a.max_len);
  if (a.prologue.active() && (a.max_len != 1 || a.form != cuda::Form::Auto))
    throw error("delta", "the fused activations are for the decode step (max_len 1), got max_len ", a.max_len);
  if (a.prologue.gate != cuda::GateInput::LogDecay && (a.decay == Decay::None || !a.prologue.A_log || !a.prologue.dt_bias))
    throw error("delta", "gate pre-activations need a decay and the gate's A_log and dt_bias");
  if (a.form == cuda::Form::Chunked || (a.form == cuda::Form::Auto && a.max_len > 64))
    return cuda::chunked_forward(a);
  const Dev d = to_dev(a);
  if (a.max_len == 1) {  // every sequence one token: the decode step
    const int64_t nblocks = a.N * a.HV * ((a.V + kDecodeCols - 1) / kDecodeCols);
    if (!nblocks) return;
    if (nblocks > INT32_MAX) throw error("delta", "the decode step takes at most 2^31 - 1 blocks, got ", nblocks);
    const unsigned blocks = unsigned(nblocks);
    const bool fused = a.prologue.active();
    // Whole float4s of S where V % 4 == 0 and the states are 16-byte aligned (per-sequence states
    // are by contract: DeviceArgs::states).
    const bool vec = a.V % 4 == 0 && (reinterpret_cast<uintptr_t>(a.h0) | reinterpret_cast<uintptr_t>(a.ht)) % 16 == 0;
    using Kernel = void (*)(Dev);
    static constexpr Kernel kernels[2][2][2] = {
        {{decode_kernel<float, false, false>, decode_kernel<float, false, true>},
         {decode_kernel<float, true, false>, decode_kernel<float, true, true>}},
        {{decode_kernel<__nv_bfloat16, false, false>, decode_kernel<__nv_bfloat16, false, true>},
         {decode_kernel<__nv_bfloat16, true, false>, decode_kernel<__nv_bfloat16, true, true>}}};
    const Kernel kernel = kernels[a.io == DType::BF16][fused][vec];
    device::launch_dependent(kernel, blocks, kDecodeWarps * 32, d);
    return;
  }
  const dim3 blocks(unsigned(a.N * a.HV), unsigned((a.V + kVMax - 1) / kVMax));
  if (!blocks.x) return;
  if (a.io == DType::BF16)
    forward_kernel<__nv_bfloat16><<<blocks, kThreads, 0, device::stream()>>>(d);
  else
    forward_kernel<float><<<blocks, kThreads, 0, device::stream()>>>(d);
  K3_CUDA_LAUNCHED();
}

void backward(const DeviceArgs& a, const DeviceGrads& g) {
  using namespace detail;
  const int64_t longest = std::max(a.max_len, g.longest);
  if (a.form == cuda::Form::Chunked || (a.form == cuda::Form::Auto && longest > 64)) {
    DeviceArgs b = a;
    b.max_len = longest;
    return cuda::chunked_backward(b, g);
  }
  Dev d = to_dev(a);
  const dim3 blocks(unsigned(a.N * a.HV), unsigned((a.V + kVMax - 1) / kVMax));
  if (!blocks.x) return;
  const int64_t chunks = (g.longest + kTile - 1) / kTile;
  d.scratch_per_block = (chunks + kTile) * kPerThread * kThreads;
  device::Buffer scratch(size_t(d.scratch_per_block) * blocks.x * blocks.y * sizeof(float));
  d.scratch = scratch.as<float>();
  d.do_f32 = a.io != DType::BF16 || g.do_dtype != DType::BF16;
  d.d_o = g.d_o, d.dht = g.dht, d.dq = g.dq, d.dk = g.dk, d.dv = g.dv, d.dbeta = g.dbeta, d.dg = g.dg, d.dh0 = g.dh0;
  if (a.io == DType::BF16)
    backward_kernel<__nv_bfloat16><<<blocks, kThreads, 0, device::stream()>>>(d);
  else
    backward_kernel<float><<<blocks, kThreads, 0, device::stream()>>>(d);
  K3_CUDA_LAUNCHED();
  // The scratch goes back to the allocator's cache when this returns; work queued on the same
  // stream later cannot overlap this kernel, so its reuse is safe.
}

}  // namespace k3::linear::cuda
