// The delta-rule family on CUDA, chunked form (README.md beside this file, "Chunked form"): the
// same math as delta_chunked.cc, split into kernels so that only the state recurrence (and its
// adjoint) is sequential.
//
// 1. `prepare` — one block per (chunk, sequence, value head), all chunks at once. In shared
//    memory: the chunk's q (scaled), k, β and the cumulative log-decays G (summed in double, kept
//    in log₂ units); the decayed grams Ā = tril(K Kᵀ ⊙ e^{G_r−G_s}) and Aqk (with the diagonal) in
//    4 × 4 register tiles, every exponent ≤ 0 so extreme decays stay finite: on a diagonal tile
//    each pair's own G_r − G_s (r ≥ s), off it the two factors e^{G_r−G_ref} e^{G_ref−G_s} with
//    G_ref the tile's last column; T = (I + diag(β) Ā)⁻¹ by blocked inversion (a warp per 16-row
//    diagonal block, then the blocks below by their distance to the diagonal; the tensor-core form:
//    a thread per column of the diagonal blocks, then 32-row halves and the whole by 3xTF32
//    products); then to global scratch
//      W = T diag(β) (e^G ⊙ K), U = T diag(β) V (Additive: U = V), Aqk,
//      Qg = e^G ⊙ (s Q), Kd = e^{G_C − G} ⊙ K, and e^{G_C}.
// 2. `recur` — one block per (sequence, value head, tile of kVb = 16 value columns) walks the chunks in
//    order with its state slice S [K, kVb] in shared memory, storing each chunk's entering S₀ and
//      V_new = U − W S₀,  then S ← diag(e^{G_C}) S₀ + Kdᵀ V_new;
//    its operands arrive by cp.async one phase ahead of their use.
// 3. `output` — one block per (chunk, sequence, value head, tile of 64 columns), all at once, 4 × 4
//    register tiles: O = Qg S₀ + Aqk V_new.
// Rows past a sequence's end are zero (k, q, v, β, g), so a partial last chunk needs no special
// case: its padded rows write nothing into the state and their outputs are not stored.
//
// Backward (README.md, "Chunked" under "Backward"): prepare and recur again, then `reverse` — per
// (sequence, value head, column tile), chunks in reverse, carries the state adjoint dS:
//      dV_new = Kd dS + Aqkᵀ dO,  dS ← diag(e^{G_C}) dS + Qgᵀ dO − Wᵀ dV_new,
// storing dS (the adjoint of each chunk's leaving state) and dV_new (operands by cp.async, one
// phase ahead); `grads` — one block per
// (chunk, sequence, value head), all at once: everything else of the README's chunk backward
// (dKd, dQg, dW, dT, dA = −Tᵀ dT Tᵀ, the decayed grams' backward with every exponent ≤ 0 as in the
// forward — per pair inside a 16-row block, split at the block's edges across blocks — dβ, and dg
// as the reverse cumulative sum of dG inside the chunk).
//
// The scratch holds a window of chunks per (sequence, head); longer inputs run window after window,
// the state passing between them through `ht` (or a temporary), so memory stays bounded (the
// backward keeps every window's entering state and recomputes the window before its reverse).
// q/k/v/o in fp32 or bf16 storage as in the recurrent kernels. fp32 storage: fp32 SIMT arithmetic
// throughout. bf16 storage (K a multiple of 16): prepare, recur, output and reverse take their
// products on the tensor cores as TF32 (the `tc` kernels below, README.md "On the GPU"); grads
// its products over V, the rest of it SIMT. With a scalar gate or none (Gated DeltaNet, DeltaNet)
// prepare's grams are plain bf16 products of q and k on the tensor cores, scaled per entry.
#include <algorithm>
#include <memory>
#include <optional>
#include <type_traits>

#include "core/cuda_util.cuh"
#include "core/device.h"
#include "mixers/linear/delta_cuda.h"

namespace k3::linear::detail {
namespace {

using device::axpy4;
using device::cp_async16;
using device::cp_async_commit;
using device::cp_async_wait0;
using device::cp_async_wait1;
using device::from_f32;
using device::to_f32;

constexpr int kC = 64;           // chunk length
constexpr int kPrepThreads = 256;
constexpr int kVb = 16;          // value columns per recurrence block: 16 blocks per head at V 128 (SMs stay busy)
constexpr int kRecWarps = 8, kRecThreads = kRecWarps * 32;
// In the per-tile kernels thread t owns column t % kVb ("lane") of row group t / kVb ("warp").
constexpr int kGroups = kRecThreads / kVb;
constexpr int kRowsPerWarp = kC / kGroups;  // chunk rows per row group
constexpr double kLog2e = 1.4426950408889634;
constexpr int64_t kScratchBudget = int64_t(1) << 30;  // bytes of scratch per window

struct ChunkDev {
  int N, H, HV, K, V, group;
  int delta_write, decay;  // decay: 0 none, 1 scalar, 2 per-channel
  float scale;
  const int64_t* row0;
  const int64_t* len;
  const void *q, *k, *v;
  const float *beta, *g;
  void* o;
  int o_f32;
  const float* s_in;  // [N, HV, K, V] state entering the window, or null (zeros)
  float* s_out;       // [N, HV, K, V] state after the window
  int c_begin, c_count;  // the window: chunks [c_begin, c_begin + c_count) of every sequence
  int KS;                // K rounded up to 4 (row stride of the K-wide scratch)
  // Scratch, per (sequence, value head): c_count·kC rows.
  float *W, *U, *Qg, *Kd, *Aqk, *gC;
  float* TA;     // [NHV, c_count·kC, kC] T (lower, unit diagonal) and Ā transposed above it, or null
  float* Sc;     // [NHV, c_count, K, V] state entering each chunk, or null (forward only)
  int store_vn;  // recur writes V_new over U (the backward reads it)
  int tc;        // prepare / recur / output / reverse on the tensor cores (TF32): bf16 storage, K % 16 == 0
  // Backward.
  const void* d_o;  // io dtype (or fp32 when do_f32), or null
  int do_f32;
  const float* ds_in;  // [N, HV, K, V] adjoint of the state leaving the window, or null (zeros)
  float* ds_out;       // [N, HV, K, V] adjoint of the state entering the window
  float* dSc;          // [NHV, c_count, K, V] adjoint of the state leaving each chunk
  float* dVn;          // [NHV, c_count·kC, V]
  float *dq, *dk, *dv, *dbeta, *dg;  // zero-filled by the caller; added into
};

__device__ __forceinline__ int64_t state_slot(const ChunkDev& p, int n, int hv, int cw) {
  return ((int64_t(n) * p.HV + hv) * p.c_count + cw) * p.K * p.V;
}

// Scratch row of token `t` (within the window) of (n, hv).
__device__ __forceinline__ int64_t srow(const ChunkDev& p, int n, int hv, int t) {
  return (int64_t(n) * p.HV + hv) * (int64_t(p.c_count) * kC) + t;
}

// Which (sequence, value head, chunk) a per-chunk block owns: blockIdx.x = sequence × HV + value
// head (any count), blockIdx.y = the chunk within the window (window_of keeps it ≤ 65,535). nv =
// the chunk's real rows (≤ 0: past the sequence's end), r0 = its first token row.
struct ChunkIds {
  int n, hv, cw, nv;
  int64_t r0;
};
__device__ __forceinline__ ChunkIds chunk_ids(const ChunkDev& p) {
  const int n = int(blockIdx.x) / p.HV, hv = int(blockIdx.x) % p.HV, cw = int(blockIdx.y);
  const int64_t t0 = int64_t(p.c_begin + cw) * kC, left = p.len[n] - t0;
  return {n, hv, cw, int(left < kC ? left : int64_t(kC)), p.row0[n] + t0};
}

// G [kC][KP] (KP = K + 1 unless given) = the cumulative log-decays of the chunk's rows (0 past nv): the gates are loaded
// by the whole block at once, then each channel is summed in double (differences of large sums
// keep their digits), scaled by `unit` (log₂ e for log₂ units). Ends with __syncthreads.
__device__ __forceinline__ void load_cumsum(float* G, const ChunkDev& p, int64_t r0, int nv, int hv, int threads,
                                            double unit = 1.0, int KP = 0) {
  const int K = p.K;
  if (KP == 0) KP = K + 1;
  if (p.decay == 2 && K % 4 == 0 && reinterpret_cast<uintptr_t>(p.g) % 16 == 0) {  // per-channel gates, four per load
    const int k4 = K / 4;
    for (int i = threadIdx.x; i < kC * k4; i += threads) {
      const int r = i / k4, d = 4 * (i % k4);
      float4 g = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (r < nv) g = *reinterpret_cast<const float4*>(p.g + ((r0 + r) * p.HV + hv) * K + d);
      if (KP % 4 == 0)  // rows 16-byte aligned: one store, no bank conflicts between lanes
        *reinterpret_cast<float4*>(G + r * KP + d) = g;
      else
        G[r * KP + d] = g.x, G[r * KP + d + 1] = g.y, G[r * KP + d + 2] = g.z, G[r * KP + d + 3] = g.w;
    }
  } else
  for (int i = threadIdx.x; i < kC * K; i += threads) {
    const int r = i / K, d = i % K;
    float g = 0.0f;
    if (r < nv && p.decay == 1) g = p.g[(r0 + r) * p.HV + hv];
    if (r < nv && p.decay == 2) g = p.g[((r0 + r) * p.HV + hv) * K + d];
    G[r * KP + d] = g;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < K; d += threads) {
    double acc = 0.0;
    for (int r = 0; r < kC; ++r) {
      acc += G[r * KP + d];
      G[r * KP + d] = float(acc * unit);
    }
  }
  __syncthreads();
}

// 2^x on the special-function unit (relative error ~2⁻²², results below 2⁻¹²⁶ flushed to zero).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The grams of one 4 × 4 tile (rows r0.., columns s0..) over every `dstep`-th channel from `d0`:
// kk[i][j] = Σ k_r k_s 2^{G_r − G_s}, qk likewise with q_r. G is in log₂ units and non-increasing
// along the chunk, so every exponent is ≤ 0: on the diagonal tile each pair's own (r ≥ s), off it
// both factors of 2^{G_r − G_ref} · 2^{G_ref − G_s} with G_ref the tile's last column.
// k rows `ldk` elements apart (fp32 or bf16), G rows `ldg` floats apart.
template <class KT>
__device__ __forceinline__ void gram_tile(const float* sq, int ldq, const KT* sk, int ldk, const float* sG, int ldg,
                                          int K, int r0, int s0, int d0, float (&kk)[4][4], float (&qk)[4][4],
                                          int dstep = 4) {
  for (int d = d0; d < K; d += dstep) {
    float kr[4], qr[4], gr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      kr[i] = to_f32(sk[(r0 + i) * ldk + d]);
      qr[i] = sq[(r0 + i) * ldq + d];
      gr[i] = sG[(r0 + i) * ldg + d];
    }
    if (r0 == s0) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j <= i; ++j) {
          const float e = kr[j] * ex2(gr[i] - gr[j]);
          kk[i][j] = fmaf(kr[i], e, kk[i][j]);
          qk[i][j] = fmaf(qr[i], e, qk[i][j]);
        }
    } else {
      float ks[4], gs[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        ks[j] = to_f32(sk[(s0 + j) * ldk + d]);
        gs[j] = sG[(s0 + j) * ldg + d];
      }
#pragma unroll
      for (int j = 0; j < 3; ++j) ks[j] *= ex2(gs[3] - gs[j]);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float e = ex2(gr[i] - gs[3]), a = kr[i] * e, b = qr[i] * e;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          kk[i][j] = fmaf(a, ks[j], kk[i][j]);
          qk[i][j] = fmaf(b, ks[j], qk[i][j]);
        }
      }
    }
  }
}

// Sums a 4 × 4 tile over the four lanes of a group (lanes 4m..4m+3, `mask` = theirs); lane `quarter`
// ends with row `quarter` in out[0..3]. Halves are exchanged so each value crosses two shuffles.
__device__ __forceinline__ void reduce_rows(const float (&x)[4][4], int quarter, unsigned mask, float (&out)[4]) {
  const bool b0 = quarter & 1, b1 = quarter & 2;
  float y[2][4];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float send = b0 ? x[2 * m][j] : x[2 * m + 1][j];
      y[m][j] = (b0 ? x[2 * m + 1][j] : x[2 * m][j]) + __shfl_xor_sync(mask, send, 1);
    }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float send = b1 ? y[0][j] : y[1][j];
    out[j] = (b1 ? y[1][j] : y[0][j]) + __shfl_xor_sync(mask, send, 2);
  }
}

// acc[h][i][·] += Σ_s T[r][s] X[s][4c..4c+3] for the rows r = 4·rt_h + i of two 4-row tiles: T unit
// lower triangular in sT (row-major, kC wide, other entries ignored), X [kC][ldx] in shared memory.
__device__ __forceinline__ void lower_times(const float* sT, const float* X, int ldx, int rt, int c,
                                            float (&acc)[4][4]) {
  const int r0 = rt * 4;
  for (int s0 = 0; s0 < r0; s0 += 4) {
    float4 x[4], t[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[e] = *reinterpret_cast<const float4*>(X + (s0 + e) * ldx + 4 * c);
      t[e] = *reinterpret_cast<const float4*>(sT + (r0 + e) * kC + s0);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float ti[4] = {t[i].x, t[i].y, t[i].z, t[i].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) axpy4(acc[i], ti[e], x[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) {  // the diagonal block: T[r][s] for s ≤ r only
    const float4 x = *reinterpret_cast<const float4*>(X + (r0 + e) * ldx + 4 * c);
#pragma unroll
    for (int i = e; i < 4; ++i) {
      axpy4(acc[i], i == e ? 1.0f : sT[(r0 + i) * kC + r0 + e], x);
    }
  }
}

// Y = T X for the chunk: thread → (row-tile pair w, 15 − w: every pair sums 68 rows of T; column
// quad c). Row r, columns 4c.. (those below `cols`) go to store(r, col, value).
template <class Store>
__device__ __forceinline__ void lower_product(const float* sT, const float* X, int ldx, int cols, Store store) {
  const int quads = (cols + 3) / 4;
  for (int item = threadIdx.x; item < (kC / 8) * quads; item += kPrepThreads) {
    const int w = item / quads, c = item % quads;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rt = h ? kC / 4 - 1 - w : w;
      float acc[4][4] = {};
      lower_times(sT, X, ldx, rt, c, acc);
#pragma unroll
      for (int i = 0; i < 4; ++i) store(rt * 4 + i, 4 * c, acc[i]);
    }
  }
}

// Offset of the address a lane gives ldmatrix_x4 for the TF32 A fragment of rows r0.. (16 rows
// `ld` floats apart, ld % 4 == 0) at column 0: row r0 + l % 16 … as device::ldmatrix_x4 says.
__device__ __forceinline__ int lane_row(int lane, int r0, int ld) {
  return (r0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * ld + 4 * (lane >> 4);
}

// The same Y = T X on the tensor cores (TF32, the `tc` kernels), T here the whole lower-triangular
// matrix (zeros above the diagonal) in rows `ldt` floats apart, T and X rounded to TF32 (read as
// they are): warp w takes row blocks p and 3 − p (p = w % 2, equal work: 2(p + 1) + 2(4 − p)
// k-steps) and every fourth 8-column tile from w / 2, T's fragments held in registers across the
// tiles. Columns below `cols` go to store(r, col, value of col, value of col + 1) (col even); X's
// columns up to `cols` rounded to 8 are read (those past `cols` only feed columns not stored).
template <class Store>
__device__ __forceinline__ void lower_product_tc(const float* sT, int ldt, const float* X, int ldx, int cols, Store store) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t4 = lane % 4;
  const int ntiles = (cols + 7) / 8;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int rb = half ? 3 - (warp & 1) : (warp & 1), ksteps = 2 * (rb + 1);
    uint32_t a[kC / 8][4];
#pragma unroll
    for (int ks = 0; ks < kC / 8; ++ks)
      if (ks < ksteps) device::ldmatrix_x4(a[ks], sT + lane_row(lane, 16 * rb, ldt) + 8 * ks);
    for (int nt = warp >> 1; nt < ntiles; nt += kPrepThreads / 64) {
      float acc[4] = {};
      const float* x = X + t4 * ldx + 8 * nt + g;
#pragma unroll
      for (int ks = 0; ks < kC / 8; ++ks)
        if (ks < ksteps) device::mma_tf32(acc, a[ks], device::bits(x[8 * ks * ldx]), device::bits(x[(8 * ks + 4) * ldx]));
      store(16 * rb + g, 8 * nt + 2 * t4, acc[0], acc[1]);
      store(16 * rb + g + 8, 8 * nt + 2 * t4, acc[2], acc[3]);
    }
  }
}

// T = (I + A)⁻¹ in place, A strictly lower triangular, stored transposed above the diagonal of sT
// (A[r][s] at sT[s][r]); T goes below it with its unit diagonal, never touching A. Blocked: warp b
// inverts diagonal block b (16 rows) by forward substitution, then the blocks below the diagonal
// follow by their distance to it, T_ij = −T_ii Σ_{k=j}^{i−1} A_ik T_kj. Ends with __syncthreads.
__device__ __forceinline__ void invert_unit_lower(float* sT) {
  constexpr int B = 16, NB = kC / B;
  static_assert(kPrepThreads == B * B && NB <= 4, "one thread per entry of a 16 × 16 block");
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (warp < NB) {
    const int o = warp * B;
    for (int rr = 0; rr < B; ++rr) {
      const int r = o + rr;
      if (lane <= rr) {
        float t = 1.0f;
        if (lane < rr) {
          t = 0.0f;
          for (int s = lane; s < rr; ++s) t -= sT[(o + s) * kC + r] * sT[(o + s) * kC + o + lane];
        }
        sT[r * kC + o + lane] = t;
      }
      __syncwarp();
    }
  }
  __syncthreads();
  const int br = tid / B, bc = tid % B;  // this thread's entry of every block
  for (int dist = 1; dist < NB; ++dist) {
    float m[NB - 1];
    // M_ij = Σ_{k=j}^{i−1} A_ik T_kj, written where T_ij goes: this distance's reads are all nearer
    // the diagonal, so the writes need no barrier before them.
#pragma unroll
    for (int e = 0; e < NB - 1; ++e) {
      if (e >= NB - dist) break;
      const int i = e + dist, r = i * B + br, c = e * B + bc;
      float acc = 0.0f;
      for (int s = c; s < i * B; ++s) acc += sT[s * kC + r] * sT[s * kC + c];  // T[s][c] = 0 for s < c
      m[e] = acc;
    }
#pragma unroll
    for (int e = 0; e < NB - 1; ++e)
      if (e < NB - dist) sT[((e + dist) * B + br) * kC + e * B + bc] = m[e];
    __syncthreads();
#pragma unroll
    for (int e = 0; e < NB - 1; ++e) {
      if (e >= NB - dist) break;
      const int i0 = (e + dist) * B, r = i0 + br, c = e * B + bc;
      float acc = sT[r * kC + c];  // T_ii[r][r] = 1
      for (int s = i0; s < r; ++s) acc += sT[r * kC + s] * sT[s * kC + c];
      m[e] = -acc;
    }
    __syncthreads();
#pragma unroll
    for (int e = 0; e < NB - 1; ++e)
      if (e < NB - dist) sT[((e + dist) * B + br) * kC + e * B + bc] = m[e];
    __syncthreads();
  }
}

// 3xTF32: x = hi + lo with both parts TF32, so that a_hi b_hi + a_hi b_lo + a_lo b_hi on the tensor
// cores keeps about fp32's precision (the dropped a_lo b_lo is below fp32's rounding).
struct Split {
  uint32_t hi, lo;
  __device__ __forceinline__ explicit Split(float x) {
    hi = device::tf32(x);
    lo = device::tf32(x - __uint_as_float(hi));
  }
};

// acc (an m16n8 tile) += Σ_k X(r0 + m, k) Y(k, c0 + n) over k-steps [k_lo, k_hi) of 8, in 3xTF32:
// X(r, k) and Y(k, c) are element reads (zeros and signs included), a lane's as mma's fragments.
template <class XF, class YF>
__device__ __forceinline__ void product_3xtf32(float (&acc)[4], int r0, int c0, int k_lo, int k_hi, XF X, YF Y) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, t4 = lane % 4;
  for (int k = k_lo; k < k_hi; k += 8) {
    const Split a[4] = {Split(X(r0 + g, k + t4)), Split(X(r0 + g + 8, k + t4)), Split(X(r0 + g, k + t4 + 4)),
                        Split(X(r0 + g + 8, k + t4 + 4))};
    const Split b[2] = {Split(Y(k + t4, c0 + g)), Split(Y(k + t4 + 4, c0 + g))};
    const uint32_t ahi[4] = {a[0].hi, a[1].hi, a[2].hi, a[3].hi}, alo[4] = {a[0].lo, a[1].lo, a[2].lo, a[3].lo};
    device::mma_tf32(acc, alo, b[0].hi, b[1].hi);
    device::mma_tf32(acc, ahi, b[0].lo, b[1].lo);
    device::mma_tf32(acc, ahi, b[0].hi, b[1].hi);
  }
}

// invert_unit_lower for the tensor-core prepare (same storage: A transposed above the diagonal of
// sT, T with its unit diagonal below), `scratch` 2,048 floats of shared memory free after the first
// barrier. The diagonal 16-row blocks by forward substitution, a thread per column held in
// registers (64 threads; x ← e_j, then x_i −= A_is x_s for s < i, which leaves x_i = 0 for i < j,
// those x_s being 0); then the two 32-row halves from their 16-row blocks, then the whole from its
// halves, each as T₂₁ = −T₂₂ (A₂₁ T₁₁): two products on the tensor cores in 3xTF32, a warp per
// 16 × 8 tile. Five barriers, the last at the end.
__device__ __forceinline__ void invert_unit_lower_tc(float* sT, float* scratch) {
  constexpr int B = 16;
  static_assert(kC == 4 * B && kPrepThreads == 256, "four diagonal blocks; level 2's eight tiles, a warp each");
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  auto A = [&](int r, int s) { return r > s ? sT[s * kC + r] : 0.0f; };
  auto T = [&](int r, int s) { return r > s ? sT[r * kC + s] : r == s ? 1.0f : 0.0f; };
  if (tid < 4 * B) {
    const int o = (tid / B) * B, j = tid % B;
    float x[B];
#pragma unroll
    for (int i = 0; i < B; ++i) x[i] = i == j ? 1.0f : 0.0f;
#pragma unroll
    for (int s = 0; s < B - 1; ++s)
#pragma unroll
      for (int i = s + 1; i < B; ++i) x[i] = fmaf(-sT[(o + s) * kC + o + i], x[s], x[i]);
#pragma unroll
    for (int i = 0; i < B; ++i)
      if (i >= j) sT[(o + i) * kC + o + j] = x[i];
  }
  __syncthreads();
  // Level 1 (warps 0–3: half h = w / 2, 8-column tile w % 2; o = 32h): P = A₂₁ T₁₁ into scratch
  // [2][16][24], then T₂₁ = −T₂₂ P.
  constexpr int LP1 = B + 8, LP2 = 2 * B + 8;
  auto put = [&](float* tile, int ld, const float (&acc)[4], float sign) {  // an m16n8 accumulator at `tile`
    float* x = tile + g * ld + 2 * t4;
    x[0] = sign * acc[0], x[1] = sign * acc[1], x[8 * ld] = sign * acc[2], x[8 * ld + 1] = sign * acc[3];
  };
  float* P1 = scratch;
  float* P2 = scratch + 2 * B * LP1;
  if (warp < 4) {
    const int o = 32 * (warp >> 1), c = 8 * (warp & 1);
    float acc[4] = {};
    product_3xtf32(acc, 0, 0, 0, B, [&](int m, int k) { return A(o + B + m, o + k); },
                   [&](int k, int n) { return T(o + k, o + c + n); });
    put(P1 + (warp >> 1) * B * LP1 + c, LP1, acc, 1.0f);
  }
  __syncthreads();
  if (warp < 4) {
    const int o = 32 * (warp >> 1), c = 8 * (warp & 1);
    const float* P = P1 + (warp >> 1) * B * LP1;
    float acc[4] = {};
    product_3xtf32(acc, 0, 0, 0, B, [&](int m, int k) { return T(o + B + m, o + B + k); },
                   [&](int k, int n) { return P[k * LP1 + c + n]; });
    put(sT + (o + B) * kC + o + c, kC, acc, -1.0f);
  }
  __syncthreads();
  // Level 2 (every warp: 16-row tile w / 4, 8-column tile w % 4 of the 32 × 32 blocks): P = A₂₁ T₁₁
  // into scratch [32][40] (T₁₁'s zeros above the diagonal skip the k-steps before the columns), then
  // T₂₁ = −T₂₂ P (T₂₂'s skip those past the rows).
  {
    const int m0 = 16 * (warp >> 2), c = 8 * (warp & 3);
    float acc[4] = {};
    product_3xtf32(acc, 0, 0, c, 2 * B, [&](int m, int k) { return A(2 * B + m0 + m, k); },
                   [&](int k, int n) { return T(k, c + n); });
    put(P2 + m0 * LP2 + c, LP2, acc, 1.0f);
  }
  __syncthreads();
  {
    const int m0 = 16 * (warp >> 2), c = 8 * (warp & 3);
    float acc[4] = {};
    product_3xtf32(acc, 0, 0, 0, m0 + B, [&](int m, int k) { return T(2 * B + m0 + m, 2 * B + k); },
                   [&](int k, int n) { return P2[k * LP2 + c + n]; });
    put(sT + (2 * B + m0) * kC + c, kC, acc, -1.0f);
  }
  __syncthreads();
}

// G [kC] for a scalar gate (or none: zeros): the cumulative log-decays of the chunk's rows (0 past
// nv) in `unit`s, a warp's inclusive scan in double, two rows per lane. Ends with __syncthreads.
__device__ __forceinline__ void scalar_cumsum(float* G, const ChunkDev& p, int64_t r0, int nv, int hv, double unit) {
  static_assert(kC == 64, "two rows per lane");
  if (threadIdx.x < 32) {
    const int l = int(threadIdx.x);
    double a = 0.0, b = 0.0;
    if (p.decay == 1) {
      if (2 * l < nv) a = p.g[(r0 + 2 * l) * p.HV + hv];
      if (2 * l + 1 < nv) b = p.g[(r0 + 2 * l + 1) * p.HV + hv];
    }
    double x = a + b;  // inclusive scan of the pairs' sums
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const double y = __shfl_up_sync(0xFFFFFFFFu, x, o);
      if (l >= o) x += y;
    }
    G[2 * l] = float((x - b) * unit);
    G[2 * l + 1] = float(x * unit);
  }
  __syncthreads();
}

// TC: the off-diagonal 16-row blocks of the grams and the products with T on the tensor cores
// (TF32, K a multiple of 16), k kept in shared memory as the bf16 it is stored in (so that two
// blocks fit an SM), rows padded to K + 4 words (fragment reads without bank conflicts), inputs
// loaded 16 bytes at a time; else everything SIMT. SC (with TC; a scalar gate or none): G is one
// number per row, so every gram block, the diagonal ones too, is the plain product of the bf16 q
// and k (exact products on mma m16n8k16, fp32 sums) times 2^{G_r − G_s} per entry (r ≥ s: ≤ 1).
template <class T, bool TC, bool SC = false>
__global__ void __launch_bounds__(kPrepThreads) prepare_kernel(ChunkDev p) {
  static_assert(TC || !SC, "the scalar-gate grams are the tensor-core form's");
  const ChunkIds id = chunk_ids(p);
  if (id.nv <= 0) return;
  const int n = id.n, hv = id.hv, h = hv / p.group, cw = id.cw, nv = id.nv;
  const int64_t r0 = id.r0;
  using KT = std::conditional_t<TC, __nv_bfloat16, float>;
  // Row strides: q (LQ) and G (KG) in floats, k (KP) in its elements.
  const int K = p.K, KS = p.KS, KP = TC ? K + 8 : K + 1, KG = TC ? K + 4 : K + 1, LQ = TC ? KS + 4 : KS;
  // TC: the G area later holds T again in rows LT floats apart, so it spans kC rows of both widths
  // (SC: T's copy alone, G [kC] beside it).
  constexpr int LT = kC + 4;
  const int GA = SC ? LT : TC ? max(KG, LT) : KG;
  const int tid = threadIdx.x;
  extern __shared__ __align__(16) float smem[];
  float* sq = smem;                                        // [kC][LQ]  q·s, later β 2^G k, then β V
  KT* sk = reinterpret_cast<KT*>(sq + kC * LQ);            // [kC][KP]
  float* sGA = reinterpret_cast<float*>(sk + kC * KP);     // [kC][GA]: G [kC][KG] (not SC), the inversion's
                                                           // scratch (TC), then T's copy
  float* sT = sGA + kC * GA;     // [kC][kC]  T (lower, unit diagonal); A = diag(β) Ā transposed above it
  float* sb = sT + kC * kC;      // [kC]
  // cumulative log-decays (log₂ units): [kC][KG], or SC [kC] after sb; SC: q's bf16 [kC][KP] after it.
  float* sG = SC ? sb + kC : sGA;
  __nv_bfloat16* sqb = reinterpret_cast<__nv_bfloat16*>(sb + 2 * kC);
  auto Gat = [&](int r, int d) { return SC ? sG[r] : sG[r * KG + d]; };
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  if constexpr (TC) {  // 8 bf16 of q and of k per load (K % 16 == 0)
    const int k8 = K / 8;
    for (int i = tid; i < kC * k8; i += kPrepThreads) {
      const int r = i / k8, d = 8 * (i % k8);
      uint4 qv = make_uint4(0, 0, 0, 0), kv = qv;
      if (r < nv) {
        const int64_t off = ((r0 + r) * p.H + h) * K + d;
        qv = *reinterpret_cast<const uint4*>(q + off);
        kv = *reinterpret_cast<const uint4*>(k + off);
      }
      *reinterpret_cast<uint4*>(sk + r * KP + d) = kv;
      if constexpr (SC) *reinterpret_cast<uint4*>(sqb + r * KP + d) = qv;
      const __nv_bfloat16* qb = reinterpret_cast<const __nv_bfloat16*>(&qv);
      float4* dst = reinterpret_cast<float4*>(sq + r * LQ + d);
      dst[0] = make_float4(p.scale * to_f32(qb[0]), p.scale * to_f32(qb[1]), p.scale * to_f32(qb[2]),
                           p.scale * to_f32(qb[3]));
      dst[1] = make_float4(p.scale * to_f32(qb[4]), p.scale * to_f32(qb[5]), p.scale * to_f32(qb[6]),
                           p.scale * to_f32(qb[7]));
    }
  } else {
    for (int i = tid; i < kC * KS; i += kPrepThreads) {
      const int r = i / KS, d = i % KS;
      const bool ok = r < nv && d < K;
      const int64_t off = ((r0 + r) * p.H + h) * K + d;
      sq[r * LQ + d] = ok ? p.scale * to_f32(q[off]) : 0.0f;
      if (d < K) sk[r * KP + d] = ok ? to_f32(k[off]) : 0.0f;
    }
  }
  for (int r = tid; r < kC; r += kPrepThreads)
    sb[r] = r < nv ? (p.delta_write ? p.beta[(r0 + r) * p.HV + hv] : 1.0f) : 0.0f;
  if constexpr (SC)
    scalar_cumsum(sG, p, r0, nv, hv, kLog2e);
  else
    load_cumsum(sG, p, r0, nv, hv, kPrepThreads, kLog2e, KG);

  // Grams over the lower triangle of 4 × 4 tiles: lanes 4m..4m+3 share a tile, each taking every
  // fourth channel, and the shuffle sum leaves row `quarter` of the tile with lane `quarter`.
  const int64_t base = srow(p, n, hv, cw * kC);
  float* Aqk = p.Aqk + base * kC;
  {
    // Entry (r, s) of both grams: Aqk, A = diag(β) Ā stored transposed (upper triangle of sT),
    // and Ā likewise for the backward.
    auto put = [&](int r, int s, float kk, float qk) {
      Aqk[int64_t(r) * kC + s] = TC ? device::round_tf32(qk) : qk;
      if (s < r) {
        sT[s * kC + r] = sb[r] * kk;
        if (p.TA) p.TA[base * kC + s * kC + r] = kk;
      }
    };
    // 4 × 4 tile (ti, tj), SIMT, on `lanes` (4 or 8) aligned lanes each taking every lanes-th
    // channel; the shuffle sums leave row l % 4 of the tile with lane l < 4 of the group.
    auto tile = [&](int ti, int tj, int lanes) {
      const int l = tid & (lanes - 1);
      const unsigned mask = (lanes == 8 ? 0xFFu : 0xFu) << (tid & (32 - lanes));
      float kk[4][4] = {}, qk[4][4] = {}, rk[4], rq[4];
      gram_tile(sq, LQ, sk, KP, sG, KG, K, 4 * ti, 4 * tj, l, kk, qk, lanes);
      if (lanes == 8)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            kk[i][j] += __shfl_xor_sync(mask, kk[i][j], 4);
            qk[i][j] += __shfl_xor_sync(mask, qk[i][j], 4);
          }
      reduce_rows(kk, l & 3, mask, rk);
      reduce_rows(qk, l & 3, mask, rq);
      const int r = 4 * ti + (l & 3);
      if (l < 4)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (4 * tj + j <= r) put(r, 4 * tj + j, rk[j], rq[j]);
    };
    if constexpr (SC) {
      // The ten 16-row block pairs (rb ≥ cb) × two 8-column halves: 20 tasks, one m16n8
      // accumulator each for K Kᵀ and Q Kᵀ, then each entry on or below the diagonal scaled.
      const int warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
      auto word = [&](const __nv_bfloat16* x, int r, int d) {
        return *reinterpret_cast<const uint32_t*>(x + r * KP + d);
      };
      for (int task = warp; task < 20; task += kPrepThreads / 32) {
        const int pair = task >> 1, rb = pair < 1 ? 0 : pair < 3 ? 1 : pair < 6 ? 2 : 3;
        const int cb = pair - rb * (rb + 1) / 2, ra = 16 * rb + g, s = 16 * cb + 8 * (task & 1) + g;
        float kk[4] = {}, qk[4] = {};
        for (int k0 = 0; k0 < K; k0 += 16) {
          const int d = k0 + 2 * t4;
          const uint32_t ak[4] = {word(sk, ra, d), word(sk, ra + 8, d), word(sk, ra, d + 8), word(sk, ra + 8, d + 8)};
          const uint32_t aq[4] = {word(sqb, ra, d), word(sqb, ra + 8, d), word(sqb, ra, d + 8),
                                  word(sqb, ra + 8, d + 8)};
          const uint32_t b0 = word(sk, s, d), b1 = word(sk, s, d + 8);
          device::mma_bf16(kk, ak, b0, b1);
          device::mma_bf16(qk, aq, b0, b1);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = ra + 8 * (e >> 1), c = 16 * cb + 8 * (task & 1) + 2 * t4 + (e & 1);
          if (c > r) continue;
          const float f = ex2(sG[r] - sG[c]);
          put(r, c, kk[e] * f, qk[e] * (f * p.scale));
        }
      }
    } else if constexpr (TC) {
      // Below the diagonal 16-row blocks (row block rb > column block cb), with G_ref = G at row
      // 16·rb: A_rs = Σ_d (k_r 2^{G_r − G_ref}) (k_s 2^{G_ref − G_s}), both exponents ≤ 0. Warp w < 6
      // takes block pair w, both 8-column halves (the A side formed once for the two), one m16n8
      // accumulator per half for Ā and Aqk; warps 6–7 start on the diagonal tiles below.
      const int warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
      if (warp < 6) {
        const int pair = warp, rb = pair < 1 ? 1 : pair < 3 ? 2 : 3, cb = pair - rb * (rb - 1) / 2;
        const int ref = 16 * rb;
        float kk[2][4] = {}, qk[2][4] = {};
        for (int k0 = 0; k0 < K; k0 += 8) {
          uint32_t ak[4], aq[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = ref + g + 8 * (e & 1), d = k0 + t4 + 4 * (e >> 1);
            const float f = ex2(sG[r * KG + d] - sG[ref * KG + d]);
            ak[e] = device::tf32(to_f32(sk[r * KP + d]) * f);
            aq[e] = device::tf32(sq[r * LQ + d] * f);
          }
          const int d0 = k0 + t4, d1 = d0 + 4;
          const float gr0 = sG[ref * KG + d0], gr1 = sG[ref * KG + d1];
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int s = 16 * cb + 8 * half + g;
            const uint32_t b0 = device::tf32(to_f32(sk[s * KP + d0]) * ex2(gr0 - sG[s * KG + d0]));
            const uint32_t b1 = device::tf32(to_f32(sk[s * KP + d1]) * ex2(gr1 - sG[s * KG + d1]));
            device::mma_tf32(kk[half], ak, b0, b1);
            device::mma_tf32(qk[half], aq, b0, b1);
          }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = ref + g + 8 * (e >> 1), c = 16 * cb + 8 * half + 2 * t4 + (e & 1);
            put(r, c, kk[half][e], qk[half][e]);
          }
      }
      // The diagonal blocks' ten 4 × 4 tiles each (every pair's own exponent, extreme decays
      // stay finite), eight lanes per tile taking every eighth channel: 40 tiles on 32 groups of
      // eight lanes, warps 6–7 (free of the pairs above) first, so that they take the second
      // round.
      for (int item = ((tid >> 3) + 8) % 32; item < 40; item += kPrepThreads / 8) {
        const int blk = item / 10, w = item % 10, ti = w < 1 ? 0 : w < 3 ? 1 : w < 6 ? 2 : 3;
        tile(4 * blk + ti, 4 * blk + w - ti * (ti + 1) / 2, 8);
      }
    } else {
      constexpr int kTiles = (kC / 4) * (kC / 4 + 1) / 2;
      for (int item = tid >> 2; item < kTiles; item += kPrepThreads / 4) {
        int ti = int((sqrtf(8.0f * item + 1.0f) - 1.0f) * 0.5f);
        while (ti * (ti + 1) / 2 > item) --ti;
        while ((ti + 1) * (ti + 2) / 2 <= item) ++ti;
        tile(ti, item - ti * (ti + 1) / 2, 4);
      }
    }
  }
  __syncthreads();

  // Qg = 2^G ⊙ q, Kd = 2^{G_C − G} ⊙ k, 2^{G_C} (padded rows have g = 0: G_C is the last real row's),
  // and (Delta) sq ← β 2^G ⊙ k in place of q, the right-hand side of W (pad columns zero).
  // Four channels per thread, stored as float4 (KS % 4 == 0); in TC the shared rows are read as
  // vectors too (K % 16 == 0, rows 16-byte aligned), so a warp's reads meet no bank conflicts.
  for (int i = tid; i < kC * KS / 4; i += kPrepThreads) {
    const int r = i / (KS / 4), d0 = 4 * (i % (KS / 4));
    float qg[4], kd[4], wk[4];
    if constexpr (TC) {
      const float4 G = SC ? make_float4(sG[r], sG[r], sG[r], sG[r]) : *reinterpret_cast<const float4*>(sG + r * KG + d0);
      const float4 GC = SC ? make_float4(sG[kC - 1], sG[kC - 1], sG[kC - 1], sG[kC - 1])
                           : *reinterpret_cast<const float4*>(sG + (kC - 1) * KG + d0);
      const float4 qv = *reinterpret_cast<const float4*>(sq + r * LQ + d0);
      const uint2 kv = *reinterpret_cast<const uint2*>(sk + r * KP + d0);
      const __nv_bfloat16* kb = reinterpret_cast<const __nv_bfloat16*>(&kv);
      const float g4[4] = {G.x, G.y, G.z, G.w}, gc4[4] = {GC.x, GC.y, GC.z, GC.w}, q4[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float eg = ex2(g4[e]), kf = to_f32(kb[e]);
        qg[e] = q4[e] * eg;
        kd[e] = kf * ex2(gc4[e] - g4[e]);
        wk[e] = device::round_tf32(sb[r] * eg * kf);  // a product operand (lower_product_tc)
      }
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = d0 + e;
        qg[e] = kd[e] = wk[e] = 0.0f;
        if (d < K) {
          const float G = sG[r * KG + d], GC = sG[(kC - 1) * KG + d], eg = ex2(G), kf = to_f32(sk[r * KP + d]);
          qg[e] = sq[r * LQ + d] * eg;
          kd[e] = kf * ex2(GC - G);
          wk[e] = sb[r] * eg * kf;
        }
      }
    }
    if (p.delta_write) *reinterpret_cast<float4*>(sq + r * LQ + d0) = make_float4(wk[0], wk[1], wk[2], wk[3]);
    if constexpr (TC)  // product operands of recur, output and reverse: stored as TF32
#pragma unroll
      for (int e = 0; e < 4; ++e) qg[e] = device::round_tf32(qg[e]), kd[e] = device::round_tf32(kd[e]);
    *reinterpret_cast<float4*>(p.Qg + (base + r) * KS + d0) = make_float4(qg[0], qg[1], qg[2], qg[3]);
    *reinterpret_cast<float4*>(p.Kd + (base + r) * KS + d0) = make_float4(kd[0], kd[1], kd[2], kd[3]);
  }
  for (int d = tid; d < KS; d += kPrepThreads)
    p.gC[((int64_t(n) * p.HV + hv) * p.c_count + cw) * KS + d] = d < K ? ex2(Gat(kC - 1, d)) : 0.0f;

  float* U = p.U + base * p.V;
  if (!p.delta_write) {  // Additive: U = V
    for (int i = tid; i < kC * p.V; i += kPrepThreads) {
      const int r = i / p.V, j = i % p.V;
      U[i] = r < nv ? to_f32(v[((r0 + r) * p.HV + hv) * p.V + j]) : 0.0f;
    }
    return;
  }
  // T from A (only sT is touched until its first barrier, after which sq and G are complete; TC:
  // sGA, G's or T's copy's area, is then free for the inversion's scratch).
  if constexpr (TC)
    invert_unit_lower_tc(sT, sGA);
  else
    invert_unit_lower(sT);
  if (p.TA)
    for (int i = tid; i < kC * kC; i += kPrepThreads)
      if (i % kC <= i / kC) p.TA[base * kC + i] = sT[i];
  // TC: T again with its zeros and unit diagonal, rows kC + 4 floats apart (fragment reads without
  // bank conflicts), where G was (spent).
  float* sTc = sGA;
  if constexpr (TC) {
    for (int i = tid; i < kC * kC; i += kPrepThreads) {
      const int r = i / kC, c = i % kC;
      sTc[r * LT + c] = c < r ? device::round_tf32(sT[i]) : c == r ? 1.0f : 0.0f;
    }
    __syncthreads();
  }
  float* W = p.W + base * KS;
  if constexpr (TC)
    lower_product_tc(sTc, LT, sq, LQ, KS, [&](int r, int d, float w0, float w1) {
      *reinterpret_cast<float2*>(W + int64_t(r) * KS + d) = make_float2(device::round_tf32(w0), device::round_tf32(w1));
    });
  else
    lower_product(sT, sq, LQ, KS, [&](int r, int d, const float (&w)[4]) {
      *reinterpret_cast<float4*>(W + int64_t(r) * KS + d) = make_float4(w[0], w[1], w[2], w[3]);
    });
  // U = T diag(β) V, with β V staged in sq KS columns at a time.
  const int V = p.V;
  for (int j0 = 0; j0 < V; j0 += KS) {
    const int tw = min(KS, V - j0);
    __syncthreads();  // the last readers of sq (W, or the previous tile) are done
    auto stage_scalar = [&] {  // TC: rounded to TF32 (lower_product_tc's operand)
      for (int i = tid; i < kC * tw; i += kPrepThreads) {
        const int s = i / tw, jj = i % tw;
        const float x = s < nv ? sb[s] * to_f32(v[((r0 + s) * p.HV + hv) * V + j0 + jj]) : 0.0f;
        sq[s * LQ + jj] = TC ? device::round_tf32(x) : x;
      }
    };
    if constexpr (TC) {
      if (V % 8 == 0) {  // 8 bf16 per load (tw is then a multiple of 8 too)
        const int w8 = tw / 8;
        for (int i = tid; i < kC * w8; i += kPrepThreads) {
          const int s = i / w8, jj = 8 * (i % w8);
          uint4 vv = make_uint4(0, 0, 0, 0);
          if (s < nv) vv = *reinterpret_cast<const uint4*>(v + ((r0 + s) * p.HV + hv) * V + j0 + jj);
          const __nv_bfloat16* vb = reinterpret_cast<const __nv_bfloat16*>(&vv);
          float4* dst = reinterpret_cast<float4*>(sq + s * LQ + jj);
          const float b = sb[s];
          auto x = [&](int e) { return device::round_tf32(b * to_f32(vb[e])); };
          dst[0] = make_float4(x(0), x(1), x(2), x(3));
          dst[1] = make_float4(x(4), x(5), x(6), x(7));
        }
      } else {
        stage_scalar();
      }
    } else {
      stage_scalar();
    }
    __syncthreads();
    if constexpr (TC)
      lower_product_tc(sTc, LT, sq, LQ, tw, [&](int r, int jj, float u0, float u1) {
        float* dst = U + int64_t(r) * V + j0 + jj;
        if (jj < tw) dst[0] = u0;
        if (jj + 1 < tw) dst[1] = u1;
      });
    else
      lower_product(sT, sq, LQ, tw, [&](int r, int jj, const float (&u)[4]) {
        float* dst = U + int64_t(r) * V + j0 + jj;
        for (int e = 0; e < 4 && jj + e < tw; ++e) dst[e] = u[e];
      });
  }
}

// Copies a chunk's [kC, KS] slab of K-wide scratch into shared memory.
__device__ __forceinline__ void load_slab(float* dst, const float* src, int KS) {
  const float4* s4 = reinterpret_cast<const float4*>(src);
  float4* d4 = reinterpret_cast<float4*>(dst);
  for (int i = threadIdx.x; i < kC * KS / 4; i += kRecThreads) d4[i] = s4[i];
}

// Asynchronous copies into shared memory (cp.async): the next chunk's operands load while the
// current one is computed. `async_slab` is load_slab's; `async_tile` copies a [kC, kVb] tile of a
// [rows, V] array (columns c0…, zeros past V).
__device__ __forceinline__ void cp_async4(float* dst, const float* src, bool ok) {
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 4 : 0));
}
__device__ __forceinline__ void async_slab(float* dst, const float* src, int floats) {
  for (int i = 4 * int(threadIdx.x); i < floats; i += 4 * kRecThreads) cp_async16(dst + i, src + i);
}
__device__ __forceinline__ void async_tile(float* dst, const float* src, int V, int c0) {
  for (int i = threadIdx.x; i < kC * kVb; i += kRecThreads) {
    const int r = i / kVb, jj = i % kVb;
    const bool ok = c0 + jj < V;
    cp_async4(dst + i, ok ? src + int64_t(r) * V + c0 + jj : src, ok);
  }
}

// acc[i] += Σ_d X[r_i][d] S[d][lane] for the warp's rows r_i = warp·kRowsPerWarp + i: X [kC][KS]
// in shared memory (broadcast reads), S [KS][kVb].
__device__ __forceinline__ void rows_by_state(const float* X, const float* S, int KS, float (&acc)[kRowsPerWarp],
                                              int warp, int lane) {
  for (int d = 0; d < KS; d += 4) {
    const float s0 = S[(d + 0) * kVb + lane], s1 = S[(d + 1) * kVb + lane];
    const float s2 = S[(d + 2) * kVb + lane], s3 = S[(d + 3) * kVb + lane];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const float4 w = *reinterpret_cast<const float4*>(X + (warp * kRowsPerWarp + i) * KS + d);
      acc[i] += w.x * s0 + w.y * s1 + w.z * s2 + w.w * s3;
    }
  }
}

// State rows per row group in the [K, kVb] updates: d = warp·kStateRows + i.
constexpr int kStateRows = 128 / kGroups;
static_assert(kStateRows * kGroups >= 128 && kStateRows % 4 == 0, "the state updates cover K = 128");

// acc[i] += sign · Σ_r X[r][d_i] Y[r][lane] for the warp's state rows d_i (X [kC][KS], Y [kC][kVb]).
__device__ __forceinline__ void transposed_product(const float* X, const float* Y, int KS, float sign,
                                                   float (&acc)[kStateRows], int warp, int lane) {
  const int d0 = warp * kStateRows;
  if (d0 >= KS) return;
  for (int r = 0; r < kC; ++r) {
    const float y = sign * Y[r * kVb + lane];
#pragma unroll
    for (int q = 0; q < kStateRows / 4; ++q) {
      if (d0 + 4 * q < KS) {
        const float4 x = *reinterpret_cast<const float4*>(X + r * KS + d0 + 4 * q);
        acc[4 * q + 0] += x.x * y;
        acc[4 * q + 1] += x.y * y;
        acc[4 * q + 2] += x.z * y;
        acc[4 * q + 3] += x.w * y;
      }
    }
  }
}

// A block's [K, kVb] tile (columns c0…) of a [K, V] state slice at `off`: into shared memory
// ([KS][kVb], zeros past K or V, or everywhere when src is null), and back out.
__device__ __forceinline__ void load_tile(float* dst, const float* src, int64_t off, const ChunkDev& p, int c0) {
  for (int i = threadIdx.x; i < p.KS * kVb; i += kRecThreads) {
    const int d = i / kVb, jj = i % kVb;
    dst[i] = (d < p.K && c0 + jj < p.V && src) ? src[off + int64_t(d) * p.V + c0 + jj] : 0.0f;
  }
}
__device__ __forceinline__ void store_tile(float* dst, const float* src, int64_t off, const ChunkDev& p, int c0) {
  for (int i = threadIdx.x; i < p.K * kVb; i += kRecThreads) {
    const int d = i / kVb, jj = i % kVb;
    if (c0 + jj < p.V) dst[off + int64_t(d) * p.V + c0 + jj] = src[i];
  }
}
// The window's tokens of sequence n: [t_begin, t_end).
struct Span {
  int64_t L, t_begin, t_end;
};
__device__ __forceinline__ Span span_of(const ChunkDev& p, int n) {
  const int64_t L = p.len[n], b = int64_t(p.c_begin) * kC, e = int64_t(p.c_begin + p.c_count) * kC;
  return {L, b, L < e ? L : e};
}

// Which (sequence, value head, column tile) a recur / reverse block owns, and its state slice.
struct TileIds {
  int n, hv, c0, lane, warp;
  int64_t soff;
};
__device__ __forceinline__ TileIds tile_ids(const ChunkDev& p) {
  const int n = blockIdx.x / p.HV, hv = blockIdx.x % p.HV;
  return {n, hv, int(blockIdx.y) * kVb, int(threadIdx.x) % kVb, int(threadIdx.x) / kVb,
          (int64_t(n) * p.HV + hv) * p.K * p.V};
}

__global__ void __launch_bounds__(kRecThreads) recur_kernel(ChunkDev p) {
  const TileIds t = tile_ids(p);
  const int n = t.n, hv = t.hv, c0 = t.c0, K = p.K, KS = p.KS, lane = t.lane, warp = t.warp;
  const int j = c0 + lane;
  const bool col = j < p.V;
  extern __shared__ __align__(16) float smem[];
  float* sS = smem;              // [KS][kVb]
  float* sW = sS + KS * kVb;     // [kC][KS]
  float* sKd = sW + kC * KS;     // [kC][KS]
  float* sgC = sKd + kC * KS;    // [KS]
  float* sU = sgC + KS;          // [2][kC][kVb] U, then V_new, by chunk parity
  const int64_t soff = t.soff;
  load_tile(sS, p.s_in, soff, p, c0);
  const auto [L, t_begin, t_end] = span_of(p, n);
  const int count = int((t_end - t_begin + kC - 1) / kC);
  // The operands load one phase ahead: W and U while the previous chunk's state is updated, Kd
  // and e^{G_C} while V_new is computed.
  auto issue_wu = [&](int cw) {
    const int64_t base = srow(p, n, hv, cw * kC);
    if (p.delta_write) async_slab(sW, p.W + base * KS, kC * KS);
    async_tile(sU + (cw & 1) * kC * kVb, p.U + base * p.V, p.V, c0);
  };
  if (count > 0) issue_wu(0);
  cp_async_commit();
  for (int cw = 0; cw < count; ++cw) {
    const int64_t base = srow(p, n, hv, cw * kC);
    float* sVn = sU + (cw & 1) * kC * kVb;
    __syncthreads();  // the previous chunk's state update (the reader of Kd) is done
    async_slab(sKd, p.Kd + base * KS, kC * KS);
    async_slab(sgC, p.gC + ((int64_t(n) * p.HV + hv) * p.c_count + cw) * KS, KS);
    cp_async_commit();
    if (p.Sc) store_tile(p.Sc, sS, state_slot(p, n, hv, cw), p, c0);
    cp_async_wait1();  // W and U
    __syncthreads();
    if (p.delta_write) {  // V_new = U − W S (each thread rewrites only its own entries of U)
      float acc[kRowsPerWarp] = {};
      rows_by_state(sW, sS, KS, acc, warp, lane);
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int r = warp * kRowsPerWarp + i;
        const float vn = sVn[r * kVb + lane] - acc[i];
        sVn[r * kVb + lane] = vn;
        if (p.store_vn && col) p.U[(base + r) * p.V + j] = vn;
      }
    }
    __syncthreads();  // W is free, V_new complete
    if (cw + 1 < count) issue_wu(cw + 1);
    cp_async_commit();
    cp_async_wait1();  // Kd and e^{G_C}
    __syncthreads();
    // S ← diag(e^{G_C}) S + Kdᵀ V_new on the warp's state rows.
    float acc[kStateRows];
#pragma unroll
    for (int i = 0; i < kStateRows; ++i) {
      const int d = warp * kStateRows + i;
      acc[i] = d < K ? sgC[d] * sS[d * kVb + lane] : 0.0f;
    }
    transposed_product(sKd, sVn, KS, 1.0f, acc, warp, lane);
#pragma unroll
    for (int i = 0; i < kStateRows; ++i) {  // only this thread reads its rows of S until the next sync
      const int d = warp * kStateRows + i;
      if (d < K) sS[d * kVb + lane] = acc[i];
    }
  }
  cp_async_wait0();
  __syncthreads();
  store_tile(p.s_out, sS, soff, p, c0);
}

// O = Qg S₀ + Aqk V_new for one chunk and one tile of kOb = 64 value columns (all chunks at once),
// from the states and V_new that recur stored. Thread → rows 4·(tid / 16).., columns 4·(tid % 16)..
// of the tile, summed in registers.
constexpr int kOb = 64;
template <class T>
__global__ void __launch_bounds__(kRecThreads) output_kernel(ChunkDev p) {
  static_assert(kRecThreads == (kC / 4) * (kOb / 4), "one 4 x 4 output tile per thread");
  const ChunkIds id = chunk_ids(p);
  if (id.nv <= 0) return;
  const int n = id.n, hv = id.hv, cw = id.cw, nv = id.nv, c0 = blockIdx.z * kOb;
  const int K = p.K, KS = p.KS, V = p.V, tid = threadIdx.x;
  extern __shared__ __align__(16) float smem[];
  float* sS = smem;               // [KS][kOb]
  float* sQg = sS + KS * kOb;     // [kC][KS]
  float* sAqk = sQg + kC * KS;    // [kC][kC]
  float* sVn = sAqk + kC * kC;    // [kC][kOb]
  const int64_t base = srow(p, n, hv, cw * kC), soff = state_slot(p, n, hv, cw);
  for (int i = tid; i < KS * kOb; i += kRecThreads) {
    const int d = i / kOb, jj = i % kOb;
    sS[i] = d < K && c0 + jj < V ? p.Sc[soff + int64_t(d) * V + c0 + jj] : 0.0f;
  }
  load_slab(sQg, p.Qg + base * KS, KS);
  for (int i = tid; i < kC * kC / 4; i += kRecThreads)
    reinterpret_cast<float4*>(sAqk)[i] = reinterpret_cast<const float4*>(p.Aqk + base * kC)[i];
  for (int i = tid; i < kC * kOb; i += kRecThreads) {
    const int r = i / kOb, jj = i % kOb;
    sVn[i] = c0 + jj < V ? p.U[(base + r) * V + c0 + jj] : 0.0f;
  }
  __syncthreads();
  const int r0 = 4 * (tid / (kOb / 4)), j0 = 4 * (tid % (kOb / 4));
  float acc[4][4] = {};
  auto fma_rows = [&](const float (&a)[4][4], const float4 (&x)[4]) {  // acc += a · x over 4 inner indices
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) axpy4(acc[i], a[i][e], x[e]);
  };
  auto load4 = [](const float* src, float (&a)[4]) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
  };
  for (int d = 0; d < KS; d += 4) {  // Qg S₀
    float a[4][4];
    float4 x[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) load4(sQg + (r0 + i) * KS + d, a[i]);
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = *reinterpret_cast<const float4*>(sS + (d + e) * kOb + j0);
    fma_rows(a, x);
  }
  for (int s = 0; s <= r0; s += 4) {  // Aqk V_new, Aqk lower triangular with its diagonal
    float a[4][4];
    float4 x[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      load4(sAqk + (r0 + i) * kC + s, a[i]);
      if (s == r0)  // the diagonal block: entries above it are not written by prepare
#pragma unroll
        for (int e = 0; e < 4; ++e) a[i][e] = e <= i ? a[i][e] : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = *reinterpret_cast<const float4*>(sVn + (s + e) * kOb + j0);
    fma_rows(a, x);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = r0 + i;
    if (r >= nv) break;
    const int64_t orow = ((id.r0 + r) * p.HV + hv) * V;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = c0 + j0 + e;
      if (j >= V) break;
      if (p.o_f32)
        static_cast<float*>(p.o)[orow + j] = acc[i][e];
      else
        static_cast<T*>(p.o)[orow + j] = from_f32<T>(acc[i][e]);
    }
  }
}

// The TF32 tensor-core forms of recur and output (bf16 storage, K a multiple of 16: `tc`), the
// same products on mma.sync m16n8k8 with fp32 accumulation. Shared-memory rows are padded so that
// fragment reads meet no bank conflicts: row strides ≡ 4 (mod 32 words) where a fragment's 8
// groups read 8 rows (A-style: W, Qg, Aqk), ≡ 8 where its 4 quad lanes read 4 rows (B-style: S,
// V_new, Kd read transposed).
constexpr int kPadA = 4, kPadB = 8;

// Rows of q4 16-byte pieces (q4 ≤ 32) split over a block's warps: a warp takes 32 / P rows at a
// time (P = q4 rounded up to a power of two), lane → (row lane / P of those, piece c = lane % P);
// lanes with c ≥ q4 idle. No division, and a thread's addresses only step by whole rows.
struct RowLanes {
  int c, first, step;
  bool on;
  __device__ __forceinline__ RowLanes(int q4, int threads) {
    const int sh = 32 - __clz(q4 - 1), lane = int(threadIdx.x) % 32;  // P = 2^sh
    c = lane & ((1 << sh) - 1);
    first = (int(threadIdx.x) / 32) * (32 >> sh) + (lane >> sh);
    step = (threads / 32) * (32 >> sh);
    on = c < q4;
  }
};

// Copies a chunk's [kC, cols] slab into shared memory rows `ld` floats apart (cp.async), both
// addresses stepped by whole rows (a shared address and a pointer add each) rather than recomputed.
__device__ __forceinline__ void async_rows(float* dst, int ld, const float* src, int cols, int threads) {
  const RowLanes w(cols / 4, threads);
  if (!w.on) return;
  unsigned d = device::smem_u32(dst + w.first * ld + 4 * w.c);
  const float* s = src + w.first * cols + 4 * w.c;
  const unsigned dstep = unsigned(w.step * ld) * sizeof(float);
  const int sstep = w.step * cols;
#pragma unroll 4
  for (int r = w.first; r < kC; r += w.step, d += dstep, s += sstep) device::cp_async16(d, s);
}
// A [rows, cols] tile (columns c0…, zeros past V) of a [·, V] array into rows `ld` floats apart:
// 16-byte copies when V is a multiple of 4, else one float at a time.
__device__ __forceinline__ void async_cols(float* dst, int ld, const float* src, int V, int c0, int cols, int rows,
                                           int threads) {
  if (V % 4 == 0) {
    const RowLanes w(cols / 4, threads);
    if (!w.on) return;
    const int jj = 4 * w.c;
    const bool ok = c0 + jj < V;
    for (int r = w.first; r < rows; r += w.step)
      device::cp_async16_zfill(dst + r * ld + jj, ok ? src + int64_t(r) * V + c0 + jj : src, ok);
  } else {
    for (int i = int(threadIdx.x); i < rows * cols; i += threads) {
      const int r = i / cols, jj = i % cols;
      const bool ok = c0 + jj < V;
      cp_async4(dst + r * ld + jj, ok ? src + int64_t(r) * V + c0 + jj : src, ok);
    }
  }
}

// A warp's rows db.. db+15 (db = 16·warp) of a block's [K, VB] state tile — recur's S, reverse's
// dS — in registers at full precision as m16n8 accumulators (a lane: rows db + g (+8), columns
// 8h + 2·t4 (+1)); the products read a TF32-rounded copy in shared memory (rows `ld` apart). With
// K % 16 == 0 a warp owns 16 whole rows or none (`rows`).
template <int NT>
struct WarpState {
  float st[NT][4];
  int db, g, t4, c0, V;
  bool rows;
  __device__ WarpState(int warp, int lane, int c0_, int V_, int KS)
      : db(16 * warp), g(lane / 4), t4(lane % 4), c0(c0_), V(V_), rows(16 * warp < KS) {}
  template <class F>
  __device__ __forceinline__ void each(F f) {  // f(entry, row, column within the tile)
#pragma unroll
    for (int h = 0; h < NT; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(st[h][e], db + g + 8 * (e >> 1), 8 * h + 2 * t4 + (e & 1));
  }
  __device__ __forceinline__ void add(const float (&acc)[NT][4]) {  // accumulators of the same tiles
#pragma unroll
    for (int h = 0; h < NT; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[h][e] += acc[h][e];
  }
  __device__ __forceinline__ void share(float* shared, int ld) {  // ld even: column pairs as float2
    if (!rows) return;
#pragma unroll
    for (int h = 0; h < NT; ++h)
#pragma unroll
      for (int half = 0; half < 2; ++half)
        *reinterpret_cast<float2*>(shared + (db + g + 8 * half) * ld + 8 * h + 2 * t4) =
            make_float2(device::round_tf32(st[h][2 * half]), device::round_tf32(st[h][2 * half + 1]));
  }
  // From the [K, V] state at src + off (zeros where src is null or past V), and its shared copy.
  __device__ __forceinline__ void load(const float* src, int64_t off, float* shared, int ld) {
    each([&](float& x, int d, int jj) { x = rows && c0 + jj < V && src ? src[off + int64_t(d) * V + c0 + jj] : 0.0f; });
    share(shared, ld);
  }
  __device__ __forceinline__ void store(float* dst, int64_t off) {  // column pairs as one 8-byte store where aligned
    if (!rows) return;
    float* base = dst + off + c0 + 2 * t4;
    const bool pairs = V % 2 == 0 && reinterpret_cast<uintptr_t>(base) % 8 == 0;
    if (pairs && c0 + 8 * NT <= V) {  // the whole tile inside the state: no per-column checks
#pragma unroll
      for (int h = 0; h < NT; ++h)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          *reinterpret_cast<float2*>(base + int64_t(db + g + 8 * half) * V + 8 * h) =
              make_float2(st[h][2 * half], st[h][2 * half + 1]);
      return;
    }
#pragma unroll
    for (int h = 0; h < NT; ++h)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int j = c0 + 8 * h + 2 * t4;
        float* q = base + int64_t(db + g + 8 * half) * V + 8 * h;
        const float x0 = st[h][2 * half], x1 = st[h][2 * half + 1];
        if (pairs && j + 1 < V) {
          *reinterpret_cast<float2*>(q) = make_float2(x0, x1);
        } else {
          if (j < V) q[0] = x0;
          if (j + 1 < V) q[1] = x1;
        }
      }
  }
};

// acc[u][h] += A B over the k-steps k0 ≡ 8u (mod 32) of [0, KS) (KS ≤ 128, a multiple of 8): A's
// 16 rows by ldmatrix from `a` (the lane's lane_row address), B's 8-column tiles h from `b` (the
// lane's row t4, column g of tile 0; rows `ldb` floats apart). Each group of four k-steps loads
// its fragments before its MMAs, and the four accumulators keep the MMAs from waiting on each other.
template <int NH>
__device__ __forceinline__ void rows_by_columns(float (&acc)[4][NH][4], const float* a, const float* b, int ldb,
                                                int KS) {
#pragma unroll
  for (int k0 = 0; k0 < 128; k0 += 32) {
    if (k0 >= KS) break;
    uint32_t fa[4][4], fb[4][NH][2];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int k = k0 + 8 * u;
      if (k >= KS) break;
      device::ldmatrix_x4(fa[u], a + k);
#pragma unroll
      for (int h = 0; h < NH; ++h)
        fb[u][h][0] = device::bits(b[k * ldb + 8 * h]), fb[u][h][1] = device::bits(b[(k + 4) * ldb + 8 * h]);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (k0 + 8 * u < KS)
#pragma unroll
        for (int h = 0; h < NH; ++h) device::mma_tf32(acc[u][h], fa[u], fb[u][h][0], fb[u][h][1]);
  }
}

// even / odd (the k-steps alternate) += sign · Xᵀ Y over a chunk's kC rows, for a warp's 16 state
// rows: A[d][k] = X[k][d] read from `x` (the lane's row t4, column db + g; rows `ldx` apart), B's
// 8-column tiles h from `y` (row t4, column g; rows `ldy` apart), loaded four k-steps at a time
// before their MMAs. The sign goes on B (exact on a TF32 value).
template <int NT>
__device__ __forceinline__ void transposed_by_columns(float (&even)[NT][4], float (&odd)[NT][4], const float* x,
                                                      int ldx, const float* y, int ldy, float sign) {
#pragma unroll
  for (int k0 = 0; k0 < kC; k0 += 32) {
    uint32_t fa[4][4], fb[4][NT][2];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int k = k0 + 8 * u;
      fa[u][0] = device::bits(x[k * ldx]), fa[u][1] = device::bits(x[k * ldx + 8]);
      fa[u][2] = device::bits(x[(k + 4) * ldx]), fa[u][3] = device::bits(x[(k + 4) * ldx + 8]);
#pragma unroll
      for (int h = 0; h < NT; ++h) {
        fb[u][h][0] = device::bits(sign * y[k * ldy + 8 * h]);
        fb[u][h][1] = device::bits(sign * y[(k + 4) * ldy + 8 * h]);
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int h = 0; h < NT; ++h) device::mma_tf32(u % 2 ? odd[h] : even[h], fa[u], fb[u][h][0], fb[u][h][1]);
  }
}

// The four accumulators' sum at entry e of tile h.
template <int NH>
__device__ __forceinline__ float sum4(const float (&acc)[4][NH][4], int h, int e) {
  return (acc[0][h][e] + acc[1][h][e]) + (acc[2][h][e] + acc[3][h][e]);
}

// recur on the tensor cores, one block per (sequence, value head, VB value columns): VB = 16 when
// that gives the SMs enough blocks, else 32. Each chunk's operands (W, Kd, U's columns, e^{G_C})
// load by cp.async into one of two stages while the chunk before is computed. V_new = U − W S:
// warp w → rows 16·(w / 2).., half the 8-column tiles; S ← diag(e^{G_C}) S + Kdᵀ V_new: warp w →
// state rows 16w.., every column tile. Both products load a group of fragments before their MMAs
// and spread the k-steps over several accumulators (rows_by_columns, transposed_by_columns). The
// warp keeps its rows of S in registers at full precision; shared memory holds them rounded to
// TF32 (what the products read), V_new likewise; W and Kd arrive rounded from prepare. K ≤ 128
// (KS a multiple of 16).
template <int VB>
__global__ void __launch_bounds__(kRecThreads) recur_tc_kernel(ChunkDev p) {
  constexpr int NT = VB / 8, NH = NT / 2;
  const int n = int(blockIdx.x) / p.HV, hv = int(blockIdx.x) % p.HV, c0 = int(blockIdx.y) * VB;
  const int K = p.K, KS = p.KS, V = p.V, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int LW = KS + kPadA, LK = KS + kPadB, LV = VB + kPadB;
  const int stage = kC * (LW + LK + LV) + KS;
  extern __shared__ __align__(16) float smem[];
  float* sS = smem;  // [KS][LV]; then two stages of W [kC][LW], Kd [kC][LK], U / V_new [kC][LV], e^{G_C} [KS]
  auto sW = [&](int b) { return sS + KS * LV + b * stage; };
  auto sKd = [&](int b) { return sW(b) + kC * LW; };
  auto sU = [&](int b) { return sKd(b) + kC * LK; };
  auto sgC = [&](int b) { return sU(b) + kC * LV; };
  const int64_t soff = (int64_t(n) * p.HV + hv) * K * V;
  const int rb = warp >> 1, nt0 = (warp & 1) * NH, db = 16 * warp;
  WarpState<NT> S(warp, lane, c0, V, KS);
  S.load(p.s_in, soff, sS, LV);
  const auto [L, t_begin, t_end] = span_of(p, n);
  const int count = int((t_end - t_begin + kC - 1) / kC);
  auto issue = [&](int cw) {
    const int b = cw & 1;
    const int64_t base = srow(p, n, hv, cw * kC);
    if (p.delta_write) async_rows(sW(b), LW, p.W + base * KS, KS, kRecThreads);
    async_cols(sU(b), LV, p.U + base * V, V, c0, VB, kC, kRecThreads);
    cp_async_commit();  // what V_new needs, then what the state update needs
    async_rows(sKd(b), LK, p.Kd + base * KS, KS, kRecThreads);
    async_slab(sgC(b), p.gC + ((int64_t(n) * p.HV + hv) * p.c_count + cw) * KS, KS);
    cp_async_commit();
  };
  if (count > 0) issue(0);
  for (int cw = 0; cw < count; ++cw) {
    const int b = cw & 1;
    const int64_t base = srow(p, n, hv, cw * kC);
    cp_async_wait1();  // this chunk's W and U (issued one chunk ago; its Kd may still be in flight)
    __syncthreads();   // ... visible to all; the previous chunk (the last reader of the other stage) is done
    if (cw + 1 < count) issue(cw + 1);
    if (p.Sc) S.store(p.Sc, state_slot(p, n, hv, cw));
    float* sVn = sU(b);
    if (p.delta_write) {  // V_new = U − W S (each lane rewrites only its own entries of U)
      float acc[4][NH][4] = {};
      rows_by_columns(acc, sW(b) + lane_row(lane, 16 * rb, LW), sS + t4 * LV + 8 * nt0 + g, LV, KS);
#pragma unroll
      for (int h = 0; h < NH; ++h)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = 16 * rb + g + 8 * half, jj = 8 * (nt0 + h) + 2 * t4;
          float vn[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            vn[e] = sVn[r * LV + jj + e] - sum4(acc, h, 2 * half + e);
            if (p.store_vn && c0 + jj + e < V) p.U[(base + r) * V + c0 + jj + e] = vn[e];
          }
          *reinterpret_cast<float2*>(sVn + r * LV + jj) =
              make_float2(device::round_tf32(vn[0]), device::round_tf32(vn[1]));
        }
    } else {  // V_new = U, rounded where it is a product's operand
      for (int i = tid; i < kC * VB; i += kRecThreads) {
        float& x = sVn[(i / VB) * LV + i % VB];
        x = device::round_tf32(x);
      }
    }
    if (cw + 1 < count)  // this chunk's Kd and e^{G_C} (the next chunk's two groups may be pending)
      device::cp_async_wait2();
    else
      cp_async_wait0();
    __syncthreads();  // V_new complete; every read of S done; Kd visible to all
    if (S.rows) {     // S ← diag(e^{G_C}) S + Kdᵀ V_new on state rows db..db+15, odd k-steps into acc
      const float* gC = sgC(b);
      S.each([&](float& x, int d, int) { x *= gC[d]; });
      float acc[NT][4] = {};
      transposed_by_columns(S.st, acc, sKd(b) + t4 * LK + db + g, LK, sVn + t4 * LV + g, LV, 1.0f);
      S.add(acc);
      S.share(sS, LV);  // only this lane reads these entries of sS until the next barrier
    }
  }
  cp_async_wait0();
  S.store(p.s_out, soff);
}

// output on the tensor cores, one block per (chunk, sequence, value head) walking the 64-column
// tiles (Qg and Aqk load once): warp w → rows 16·(w / 2).., columns 32·(w % 2).. of the 64 × 64
// tile (four m16n8 accumulators), Qg S₀ over K then Aqk V_new over the chunk's columns ≤ the
// warp's last row (Aqk's entries above the diagonal are zeroed as it loads). Qg and Aqk arrive
// rounded to TF32 from prepare.
template <class T>
__global__ void __launch_bounds__(kRecThreads) output_tc_kernel(ChunkDev p) {
  const ChunkIds id = chunk_ids(p);
  if (id.nv <= 0) return;
  const int n = id.n, hv = id.hv, cw = id.cw, nv = id.nv;
  const int KS = p.KS, V = p.V, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int LQ = KS + kPadA, LS = kOb + kPadB, LA = kC + kPadA;
  extern __shared__ __align__(16) float smem[];
  float* sS = smem;             // [KS][LS]
  float* sQg = sS + KS * LS;    // [kC][LQ]
  float* sAqk = sQg + kC * LQ;  // [kC][LA]
  float* sVn = sAqk + kC * LA;  // [kC][LS]
  const int64_t base = srow(p, n, hv, cw * kC), soff = state_slot(p, n, hv, cw);
  async_rows(sQg, LQ, p.Qg + base * KS, KS, kRecThreads);
  async_rows(sAqk, LA, p.Aqk + base * kC, kC, kRecThreads);
  const int rb = warp >> 1, cb = 32 * (warp & 1), r_lo = 16 * rb + g;
  const float* qa = sQg + lane_row(lane, 16 * rb, LQ);
  const float* aa = sAqk + lane_row(lane, 16 * rb, LA);
  const float* sb = sS + t4 * LS + cb + g;
  const float* vb = sVn + t4 * LS + cb + g;
  for (int c0 = 0; c0 < V; c0 += kOb) {  // Qg and Aqk stay; S₀'s and V_new's columns tile by tile
    if (c0 > 0) __syncthreads();         // the previous tile's readers are done
    async_cols(sS, LS, p.Sc + soff, V, c0, kOb, KS, kRecThreads);  // K = KS rows of [K, V]
    async_cols(sVn, LS, p.U + base * V, V, c0, kOb, kC, kRecThreads);
    cp_async_commit();
    cp_async_wait0();
    __syncthreads();
    float acc[4][4] = {};
    for (int k0 = 0; k0 < KS; k0 += 8) {
      uint32_t a[4];
      device::ldmatrix_x4(a, qa + k0);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
        device::mma_tf32(acc[nt], a, device::tf32(sb[k0 * LS + 8 * nt]), device::tf32(sb[(k0 + 4) * LS + 8 * nt]));
    }
    for (int k0 = 0; k0 < 16 * rb + 16; k0 += 8) {
      const int c = k0 + t4;  // Aqk is lower triangular with its diagonal (what lies above is not read as a number)
      uint32_t a[4];
      device::ldmatrix_x4(a, aa + k0);
      a[0] = c <= r_lo ? a[0] : 0u, a[1] = c <= r_lo + 8 ? a[1] : 0u;
      a[2] = c + 4 <= r_lo ? a[2] : 0u, a[3] = c + 4 <= r_lo + 8 ? a[3] : 0u;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
        device::mma_tf32(acc[nt], a, device::tf32(vb[k0 * LS + 8 * nt]), device::tf32(vb[(k0 + 4) * LS + 8 * nt]));
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = r_lo + 8 * (e >> 1), j = c0 + cb + 8 * nt + 2 * t4 + (e & 1);
        if (r >= nv || j >= V) continue;
        const int64_t o = ((id.r0 + r) * p.HV + hv) * V + j;
        if (p.o_f32)
          static_cast<float*>(p.o)[o] = acc[nt][e];
        else
          static_cast<T*>(p.o)[o] = from_f32<T>(acc[nt][e]);
      }
  }
}

// The state adjoint through the chunks in reverse (one block per sequence, value head, tile). The
// operands load asynchronously one phase ahead: Qg and W while dV_new is computed, the previous
// chunk's Kd, Aqk and e^{G_C} while dS is updated, its dO into registers.
__global__ void __launch_bounds__(kRecThreads) reverse_kernel(ChunkDev p) {
  const TileIds t = tile_ids(p);
  const int n = t.n, hv = t.hv, c0 = t.c0, K = p.K, KS = p.KS, tid = threadIdx.x, lane = t.lane, warp = t.warp;
  const int j = c0 + lane;
  const bool col = j < p.V;
  extern __shared__ __align__(16) float smem[];
  float* sdS = smem;              // [KS][kVb]
  float* sKd = sdS + KS * kVb;    // [kC][KS]
  float* sQg = sKd + kC * KS;     // [kC][KS]
  float* sW = sQg + kC * KS;      // [kC][KS]
  float* sAqk = sW + kC * KS;     // [kC][kC]
  float* sdO = sAqk + kC * kC;    // [kC][kVb]
  float* sdVn = sdO + kC * kVb;   // [kC][kVb]
  float* sgC = sdVn + kC * kVb;   // [2][KS], chunk parity
  const int64_t soff = t.soff;
  load_tile(sdS, p.ds_in, soff, p, c0);
  const Span sp = span_of(p, n);
  const int64_t L = sp.L, t_begin = sp.t_begin, t_end = sp.t_end;
  const int count = int((t_end - t_begin + kC - 1) / kC);
  constexpr int kDoPer = kC * kVb / kRecThreads;
  float dnext[kDoPer];
  auto fetch_do = [&](int cw) {  // this thread's entries of the chunk's dO tile, into registers
    const int64_t t0 = t_begin + int64_t(cw) * kC;
#pragma unroll
    for (int m = 0; m < kDoPer; ++m) {
      const int i = tid + m * kRecThreads, r = i / kVb, jj = i % kVb;
      float g = 0.0f;
      if (p.d_o && t0 + r < L && c0 + jj < p.V) {
        const int64_t oi = ((p.row0[n] + t0 + r) * p.HV + hv) * p.V + c0 + jj;
        g = p.do_f32 ? static_cast<const float*>(p.d_o)[oi]
                     : __bfloat162float(static_cast<const __nv_bfloat16*>(p.d_o)[oi]);  // else bf16 io
      }
      dnext[m] = g;
    }
  };
  auto issue_b = [&](int cw) {  // Kd, Aqk, e^{G_C}
    const int64_t base = srow(p, n, hv, cw * kC);
    async_slab(sKd, p.Kd + base * KS, kC * KS);
    async_slab(sAqk, p.Aqk + base * kC, kC * kC);
    async_slab(sgC + (cw & 1) * KS, p.gC + ((int64_t(n) * p.HV + hv) * p.c_count + cw) * KS, KS);
  };
  if (count > 0) {
    issue_b(count - 1);
    fetch_do(count - 1);
  }
  cp_async_commit();
  for (int cw = count - 1; cw >= 0; --cw) {
    const int64_t base = srow(p, n, hv, cw * kC);
    __syncthreads();  // the previous chunk's update of dS and readers of Qg, W, dO, dV_new are done
    {
      async_slab(sQg, p.Qg + base * KS, kC * KS);
      if (p.delta_write) async_slab(sW, p.W + base * KS, kC * KS);
      cp_async_commit();
    }
    store_tile(p.dSc, sdS, state_slot(p, n, hv, cw), p, c0);
#pragma unroll
    for (int m = 0; m < kDoPer; ++m) sdO[tid + m * kRecThreads] = dnext[m];
    cp_async_wait1();  // Kd, Aqk, e^{G_C} (Qg and W may still be loading)
    __syncthreads();
    {  // dV_new = Kd dS + Aqkᵀ dO (Aqk[r'][r] for r' ≥ r)
      float acc[kRowsPerWarp] = {};
      rows_by_state(sKd, sdS, KS, acc, warp, lane);
      for (int rr = warp * kRowsPerWarp; rr < kC; ++rr) {
        const float g = sdO[rr * kVb + lane];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) {
          const int r = warp * kRowsPerWarp + i;
          if (rr >= r) acc[i] += sAqk[rr * kC + r] * g;
        }
      }
#pragma unroll
      for (int i = 0; i < kRowsPerWarp; ++i) {
        const int r = warp * kRowsPerWarp + i;
        sdVn[r * kVb + lane] = acc[i];
        if (col) p.dVn[(base + r) * p.V + j] = acc[i];
      }
    }
    __syncthreads();  // Kd and Aqk are free, dV_new is complete
    if (cw > 0) {
      issue_b(cw - 1);
      fetch_do(cw - 1);
    }
    cp_async_commit();
    cp_async_wait1();  // Qg and W
    __syncthreads();
    float acc[kStateRows];
#pragma unroll
    for (int i = 0; i < kStateRows; ++i) {
      const int d = warp * kStateRows + i;
      acc[i] = d < K ? sgC[(cw & 1) * KS + d] * sdS[d * kVb + lane] : 0.0f;
    }
    transposed_product(sQg, sdO, KS, 1.0f, acc, warp, lane);                   // + Qgᵀ dO
    if (p.delta_write) transposed_product(sW, sdVn, KS, -1.0f, acc, warp, lane);  // − Wᵀ dV_new
#pragma unroll
    for (int i = 0; i < kStateRows; ++i) {
      const int d = warp * kStateRows + i;
      if (d < K) sdS[d * kVb + lane] = acc[i];  // only this thread reads its rows of dS until the next sync
    }
  }
  cp_async_wait0();
  __syncthreads();
  store_tile(p.ds_out, sdS, soff, p, c0);
}

// reverse on the tensor cores (see recur_tc_kernel for VB and the padding), with reverse_kernel's
// schedule: Qg and W load while dV_new is computed, the previous chunk's Kd, Aqk, e^{G_C} (by
// parity) and dO (through registers) while dS is updated. dV_new = Kd dS + Aqkᵀ dO: warp w → rows
// 16·(w / 2).., half the column tiles; dS ← diag(e^{G_C}) dS + Qgᵀ dO − Wᵀ dV_new: warp w → state
// rows 16w.., every column tile. As in recur_tc_kernel the warp holds its rows of dS in registers
// (shared memory: TF32-rounded), dO and dV_new are stored rounded where products read them, and
// Kd, Aqk, Qg, W arrive rounded from prepare.
template <int VB>
__global__ void __launch_bounds__(kRecThreads) reverse_tc_kernel(ChunkDev p) {
  constexpr int NT = VB / 8, NH = NT / 2, kDoPer = kC * VB / kRecThreads;
  const int n = int(blockIdx.x) / p.HV, hv = int(blockIdx.x) % p.HV, c0 = int(blockIdx.y) * VB;
  const int K = p.K, KS = p.KS, V = p.V, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int LA = KS + kPadA, LT = KS + kPadB, LQ = kC + kPadB, LV = VB + kPadB;
  extern __shared__ __align__(16) float smem[];
  float* sdS = smem;              // [KS][LV]
  float* sKd = sdS + KS * LV;     // [kC][LA]
  float* sAqk = sKd + kC * LA;    // [kC][LQ]  (read transposed)
  float* sQg = sAqk + kC * LQ;    // [kC][LT]  (read transposed)
  float* sW = sQg + kC * LT;      // [kC][LT]  (read transposed)
  float* sdO = sW + kC * LT;      // [kC][LV]
  float* sdVn = sdO + kC * LV;    // [kC][LV]
  float* sgC = sdVn + kC * LV;    // [2][KS], chunk parity
  const int64_t soff = (int64_t(n) * p.HV + hv) * K * V;
  const int rb = warp >> 1, nt0 = (warp & 1) * NH, db = 16 * warp;
  WarpState<NT> dS(warp, lane, c0, V, KS);
  dS.load(p.ds_in, soff, sdS, LV);
  const Span sp = span_of(p, n);
  const int64_t L = sp.L, t_begin = sp.t_begin, t_end = sp.t_end;
  const int count = int((t_end - t_begin + kC - 1) / kC);
  // This thread's entries of the next chunk's dO tile wait in registers as the bits loaded (fp32,
  // or bf16 in the low half), converted only when staged: a conversion right after its load would
  // wait out each load's round trip in turn.
  uint32_t dnext[kDoPer];
  const int64_t row_n = p.row0[n];
  const bool do32 = p.do_f32;
  auto fetch_do = [&](int cw) {
    const int64_t t0 = t_begin + int64_t(cw) * kC;
#pragma unroll
    for (int m = 0; m < kDoPer; ++m) {
      const int i = tid + m * kRecThreads, r = i / VB, jj = i % VB;
      uint32_t v = 0;
      if (p.d_o && t0 + r < L && c0 + jj < V) {
        const int64_t oi = ((row_n + t0 + r) * p.HV + hv) * V + c0 + jj;
        v = do32 ? static_cast<const uint32_t*>(p.d_o)[oi] : static_cast<const uint16_t*>(p.d_o)[oi];  // else bf16 io
      }
      dnext[m] = v;
    }
  };
  auto issue_b = [&](int cw) {  // Kd, Aqk, e^{G_C}
    const int64_t base = srow(p, n, hv, cw * kC);
    async_rows(sKd, LA, p.Kd + base * KS, KS, kRecThreads);
    async_rows(sAqk, LQ, p.Aqk + base * kC, kC, kRecThreads);
    async_slab(sgC + (cw & 1) * KS, p.gC + ((int64_t(n) * p.HV + hv) * p.c_count + cw) * KS, KS);
  };
  if (count > 0) {
    issue_b(count - 1);
    fetch_do(count - 1);
  }
  cp_async_commit();
  for (int cw = count - 1; cw >= 0; --cw) {
    const int64_t base = srow(p, n, hv, cw * kC);
    __syncthreads();  // the previous chunk's update of dS and readers of Qg, W, dO, dV_new are done
    async_rows(sQg, LT, p.Qg + base * KS, KS, kRecThreads);
    if (p.delta_write) async_rows(sW, LT, p.W + base * KS, KS, kRecThreads);
    cp_async_commit();
    dS.store(p.dSc, state_slot(p, n, hv, cw));
#pragma unroll
    for (int m = 0; m < kDoPer; ++m) {
      const int i = tid + m * kRecThreads;
      sdO[(i / VB) * LV + i % VB] = device::round_tf32(__uint_as_float(do32 ? dnext[m] : dnext[m] << 16));
    }
    cp_async_wait1();  // Kd, Aqk, e^{G_C} (Qg and W may still be loading)
    __syncthreads();
    {  // dV_new = Kd dS + Aqkᵀ dO (Aqk[s][r] for s ≥ r), k-steps spread over four accumulators
      float acc[4][NH][4] = {};
      const int r_lo = 16 * rb + g;
      rows_by_columns(acc, sKd + lane_row(lane, 16 * rb, LA), sdS + t4 * LV + 8 * nt0 + g, LV, KS);
      const float* aq = sAqk + t4 * LQ + r_lo;  // Aqkᵀ[r][s] = Aqk[s][r]
      const float* dO = sdO + t4 * LV + 8 * nt0 + g;
#pragma unroll
      for (int k0 = 0; k0 < kC; k0 += 32) {
        uint32_t a[4][4], bb[4][NH][2];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int k = k0 + 8 * u, s = k + t4;
          if (k < 16 * rb) continue;
          a[u][0] = device::bits(s >= r_lo ? aq[k * LQ] : 0.0f);
          a[u][1] = device::bits(s >= r_lo + 8 ? aq[k * LQ + 8] : 0.0f);
          a[u][2] = device::bits(s + 4 >= r_lo ? aq[(k + 4) * LQ] : 0.0f);
          a[u][3] = device::bits(s + 4 >= r_lo + 8 ? aq[(k + 4) * LQ + 8] : 0.0f);
#pragma unroll
          for (int h = 0; h < NH; ++h)
            bb[u][h][0] = device::bits(dO[k * LV + 8 * h]), bb[u][h][1] = device::bits(dO[(k + 4) * LV + 8 * h]);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (k0 + 8 * u >= 16 * rb)
#pragma unroll
            for (int h = 0; h < NH; ++h) device::mma_tf32(acc[u][h], a[u], bb[u][h][0], bb[u][h][1]);
      }
#pragma unroll
      for (int h = 0; h < NH; ++h)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = r_lo + 8 * half, jj = 8 * (nt0 + h) + 2 * t4;
          float dv[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            dv[e] = sum4(acc, h, 2 * half + e);
            if (c0 + jj + e < V) p.dVn[(base + r) * V + c0 + jj + e] = dv[e];
          }
          *reinterpret_cast<float2*>(sdVn + r * LV + jj) =
              make_float2(device::round_tf32(dv[0]), device::round_tf32(dv[1]));
        }
    }
    __syncthreads();  // Kd and Aqk are free, dV_new is complete
    if (cw > 0) {
      issue_b(cw - 1);
      fetch_do(cw - 1);
    }
    cp_async_commit();
    cp_async_wait1();  // Qg and W
    __syncthreads();
    if (dS.rows) {  // dS ← diag(e^{G_C}) dS + Qgᵀ dO − Wᵀ dV_new on state rows db..db+15
      const float* gC = sgC + (cw & 1) * KS;
      dS.each([&](float& x, int d, int) { x *= gC[d]; });
      float acc[NT][4] = {};  // the odd k-steps
      transposed_by_columns(dS.st, acc, sQg + t4 * LT + db + g, LT, sdO + t4 * LV + g, LV, 1.0f);
      if (p.delta_write) transposed_by_columns(dS.st, acc, sW + t4 * LT + db + g, LT, sdVn + t4 * LV + g, LV, -1.0f);
      dS.add(acc);
      dS.share(sdS, LV);  // only this lane reads these entries of sdS until the next barrier
    }
  }
  cp_async_wait0();
  dS.store(p.ds_out, soff);
}


constexpr int kGradThreads = 512;  // 16 warps: the kernel is latency-bound, one block per SM (shared memory)
constexpr int kJt = 32, kJs = kJt + 4;  // value columns per staged tile, and the tiles' row stride
// The staging area also holds [kC][≤ 136] arrays (dW, dV_new, dKb), and Tᵀ dT at its start with Ā
// after the first [kC][132] (dW's rows for the dT product).
constexpr int kAbarAt = kC * 132;
constexpr int kStage = std::max((2 * 128 + 4 * kC) * kJs, kAbarAt + kC * (kC + 1));  // floats
static_assert(kStage >= kC * 136, "the stage's other tenants");
// The [kC, K] products over V: thread (d = tid % 128, rows rg·kGradRows + i).
constexpr int kGradRows = kC * 128 / kGradThreads;  // 16
// The [kC, kC] products over V: thread (s = tid % kC, rows rq·kPairRows + i).
constexpr int kPairRows = kC * kC / kGradThreads;  // 8

__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

// Stages columns [j0, j0 + kJt) of `rows` rows of a [rows, V] fp32 scratch array into dst
// [rows][kJs] (zeros past V): 16-byte cp.async when V is a multiple of 4 (the scratch's rows are
// then 16-byte aligned), else one float at a time. The caller commits and waits.
__device__ __forceinline__ void stage_cols(float* dst, const float* src, int rows, int V, int j0) {
  if (V % 4 == 0) {
    static_assert(kJt % 4 == 0 && kJs % 4 == 0, "whole 16-byte pieces per staged row");
    constexpr int kPieces = kJt / 4;
    for (int i = threadIdx.x; i < rows * kPieces; i += kGradThreads) {
      const int r = i / kPieces, c = 4 * (i % kPieces);
      const bool ok = j0 + c < V;
      device::cp_async16_zfill(dst + r * kJs + c, ok ? src + int64_t(r) * V + j0 + c : src, ok);
    }
    return;
  }
  for (int i = threadIdx.x; i < rows * kJt; i += kGradThreads) {
    const int r = i / kJt, jj = i % kJt;
    dst[r * kJs + jj] = j0 + jj < V ? src[int64_t(r) * V + j0 + jj] : 0.0f;
  }
}

// Stages columns [j0, j0 + kJt) of a chunk's rows (nv real ones, zeros after) of two [rows, HV, V]
// inputs (dO and v: fp32 when f32, else the io type T; null: zeros) into dst [kC][kJs] each. Four
// columns per load where V % 4 == 0 and both pointers allow, each thread's loads of both issued
// before either is converted so that their round trips overlap; else one value at a time.
template <class T>
__device__ __forceinline__ void stage_io_pair(float* dst0, const void* src0, bool f32_0, float* dst1, const void* src1,
                                              bool f32_1, const ChunkDev& p, int64_t r0, int nv, int hv, int j0) {
  const int V = p.V;
  f32_0 = f32_0 || std::is_same_v<T, float>;
  f32_1 = f32_1 || std::is_same_v<T, float>;
  auto at = [&](int r, int jj) { return ((r0 + r) * p.HV + hv) * V + j0 + jj; };
  auto fast = [&](const void* src, bool f32) {
    return src && reinterpret_cast<uintptr_t>(src) % (f32 ? 16 : 8) == 0;
  };
  if (V % 4 != 0 || !fast(src0, f32_0) || !fast(src1, f32_1)) {
    for (int i = threadIdx.x; i < kC * kJt; i += kGradThreads) {
      const int r = i / kJt, jj = i % kJt;
      const bool ok = r < nv && j0 + jj < V;
      auto one = [&](const void* src, bool f32) {
        if (!src || !ok) return 0.0f;
        return f32 ? static_cast<const float*>(src)[at(r, jj)] : to_f32(static_cast<const T*>(src)[at(r, jj)]);
      };
      dst0[r * kJs + jj] = one(src0, f32_0);
      dst1[r * kJs + jj] = one(src1, f32_1);
    }
    return;
  }
  // Four values' bits: fp32 in x..w, or bf16 pairs in x and y.
  auto load = [&](const void* src, bool f32, int64_t i) {
    if (f32) return *reinterpret_cast<const uint4*>(static_cast<const float*>(src) + i);
    const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(src) + i);
    return make_uint4(u.x, u.y, 0u, 0u);
  };
  auto value = [](uint4 u, bool f32) {
    if (f32) return make_float4(__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z), __uint_as_float(u.w));
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xFFFF0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xFFFF0000u));
  };
  constexpr int kPieces = kJt / 4;
  for (int i = threadIdx.x; i < kC * kPieces; i += kGradThreads) {
    const int r = i / kPieces, jj = 4 * (i % kPieces);
    uint4 a = make_uint4(0u, 0u, 0u, 0u), b = a;
    if (r < nv && j0 + jj < V) {
      a = load(src0, f32_0, at(r, jj));
      b = load(src1, f32_1, at(r, jj));
    }
    *reinterpret_cast<float4*>(dst0 + r * kJs + jj) = value(a, f32_0);
    *reinterpret_cast<float4*>(dst1 + r * kJs + jj) = value(b, f32_1);
  }
}

// acc[j] += Σ_{k ∈ [kb, ke)} A[r0 + ·][k] B[k][n0 + 8j + ·] on the tensor cores (TF32, rounded
// here; mma_tf32's fragment layout), the operands read through a(r, k) and b(k, n): one warp, NT
// 8-column tiles sharing each A fragment. ke − kb is a multiple of 8.
template <int NT, class FA, class FB>
__device__ __forceinline__ void warp_tiles_tc(float (&acc)[NT][4], int r0, int n0, int kb, int ke, FA a, FB b) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, t4 = lane % 4;
  for (int k0 = kb; k0 < ke; k0 += 8) {
    const uint32_t af[4] = {device::tf32(a(r0 + g, k0 + t4)), device::tf32(a(r0 + g + 8, k0 + t4)),
                            device::tf32(a(r0 + g, k0 + t4 + 4)), device::tf32(a(r0 + g + 8, k0 + t4 + 4))};
#pragma unroll
    for (int j = 0; j < NT; ++j)
      device::mma_tf32(acc[j], af, device::tf32(b(k0 + t4, n0 + 8 * j + g)), device::tf32(b(k0 + t4 + 4, n0 + 8 * j + g)));
  }
}

// The decayed grams' backward inside row r's 16-row block [rb, re] for channel d (G_r = Gr):
// rowQ += Σ_{rb ≤ s < r} dAqk[r][s] k_s e^{G_r − G_s}, rowK likewise with dĀ (Delta only), col +=
// Σ_{r < rr ≤ re} e^{G_rr − G_r} (dAqk[rr][r] q_rr + dĀ[rr][r] k_rr); each pair its own exponent.
__device__ __forceinline__ void in_block_sums(float& rowQ, float& rowK, float& col, int r, int rb, int re, int d,
                                              float Gr, const float* sq, const float* sk, const float* sG,
                                              const float* sdAq, const float* sdA, int KP, int CP, bool delta) {
  for (int s = rb; s < r; ++s) {
    const float e = sk[s * KP + d] * __expf(Gr - sG[s * KP + d]);
    rowQ += sdAq[r * CP + s] * e;
    if (delta) rowK += sdA[r * CP + s] * e;
  }
  for (int rr = r + 1; rr <= re; ++rr) {
    const float e = __expf(sG[rr * KP + d] - Gr);
    float x = sdAq[rr * CP + r] * sq[rr * KP + d];
    if (delta) x += sdA[rr * CP + r] * sk[rr * KP + d];
    col += e * x;
  }
}

// Visits a warp's m16n8 accumulator tiles: f(tile j, element e, row, column) (mma_tf32's C layout).
template <int NT, class F>
__device__ __forceinline__ void each_tile_elem(int r0, int n0, F f) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) f(j, e, r0 + g + 8 * (e >> 1), n0 + 8 * j + 2 * t4 + (e & 1));
}

// Everything of one chunk's backward that the carried adjoint does not need, all chunks at once.
// The products over V (dQg = dO S₀ᵀ, dKd = V_new dSᵀ, dW = −dV_new S₀ᵀ, dAqk, dT's V part) run
// over value tiles staged in shared memory; dQg and dKd wait in global scratch for the final pass.
// TC (bf16 storage, K % 16 == 0): those products on the tensor cores (TF32; warp tiles of m16n8
// accumulators, the staged rows' stride of kJs ≡ 4 (mod 32) floats makes every fragment read
// conflict-free).
template <class T, bool TC>
__global__ void __launch_bounds__(kGradThreads) grads_kernel(ChunkDev p) {
  const ChunkIds id = chunk_ids(p);
  if (id.nv <= 0) return;
  const int n = id.n, hv = id.hv, h = hv / p.group, cw = id.cw, nv = id.nv;
  const int64_t r0 = id.r0;
  const int K = p.K, KP = K + 1, KS = p.KS, V = p.V, tid = threadIdx.x;
  constexpr int CP = kC + 1;
  extern __shared__ __align__(16) float smem[];
  float* stage = smem;               // [kStage] staged tiles, later dW, dV_new, dW
  float* sTmp = stage;               // [kC][CP] Tᵀ dT (while the stage is free)
  float* sAb = stage + kAbarAt;      // [kC][CP] Ā (strictly lower, without β), from dT to dβ
  float* sq = stage + kStage;        // [kC][KP] q·s
  float* sk = sq + kC * KP;          // [kC][KP]
  float* sG = sk + kC * KP;          // [kC][KP]
  float* sT = sG + kC * KP;          // [kC][CP]
  float* sdAq = sT + kC * CP;        // [kC][CP] dAqk
  float* sdA = sdAq + kC * CP;       // [kC][CP] dT, then dĀ
  float* sb = sdA + kC * CP;         // [kC] β
  float* sdb = sb + kC;              // [kC] dβ
  float* sdGl = sdb + kC;            // [128] dG_C
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const int64_t base = srow(p, n, hv, cw * kC);
  const float* S0 = p.Sc + state_slot(p, n, hv, cw);   // [K][V]
  const float* dS = p.dSc + state_slot(p, n, hv, cw);  // [K][V]
  const float* Vn = p.U + base * V;                    // [kC][V] (V_new; V itself when Additive)
  const float* dVn = p.dVn + base * V;                 // [kC][V]
  float* dW = p.W + base * KS;                         // [kC][KS] scratch (W is spent)
  float* dG = p.Kd + base * KS;                        // [kC][KS] scratch (Kd is spent): dKd, then dG
  float* dQg = p.Qg + base * KS;                       // [kC][KS] scratch (Qg is spent)

  if constexpr (TC) {  // 8 bf16 of q and of k per load (K % 16 == 0, rows 16-byte aligned)
    static_assert(std::is_same_v<T, __nv_bfloat16>, "the tensor-core grads read bf16 storage");
    const int k8 = K / 8;
    for (int i = tid; i < kC * k8; i += kGradThreads) {
      const int r = i / k8, d = 8 * (i % k8);
      uint4 qv = make_uint4(0u, 0u, 0u, 0u), kv = qv;
      if (r < nv) {
        const int64_t off = ((r0 + r) * p.H + h) * K + d;
        qv = *reinterpret_cast<const uint4*>(q + off);
        kv = *reinterpret_cast<const uint4*>(k + off);
      }
      const T* qb = reinterpret_cast<const T*>(&qv);
      const T* kb = reinterpret_cast<const T*>(&kv);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        sq[r * KP + d + e] = p.scale * to_f32(qb[e]);
        sk[r * KP + d + e] = to_f32(kb[e]);
      }
    }
  } else {
    for (int i = tid; i < kC * K; i += kGradThreads) {
      const int r = i / K, d = i % K;
      const bool ok = r < nv;
      const int64_t off = ((r0 + r) * p.H + h) * K + d;
      sq[r * KP + d] = ok ? p.scale * to_f32(q[off]) : 0.0f;
      sk[r * KP + d] = ok ? to_f32(k[off]) : 0.0f;
    }
  }
  for (int r = tid; r < kC; r += kGradThreads) {
    sb[r] = r < nv ? (p.delta_write ? p.beta[(r0 + r) * p.HV + hv] : 1.0f) : 0.0f;
    sdb[r] = 0.0f;
  }
  load_cumsum(sG, p, r0, nv, hv, kGradThreads);

  // Products over V, one pass over the value tiles: into [kC, K] dQg, dKd, dW and dG_C's
  // Σ_j dS ⊙ S₀; into [kC, kC] dAqk = tril(dO V_newᵀ) and dT's V part dV_new (β V)ᵀ (β later).
  const int dl = tid % 128, rg = tid / 128;
  const int warp_ = tid / 32, g_ = (tid % 32) / 4, t4_ = tid % 4;  // TC: fragment coordinates
  float dqg[TC ? 1 : kGradRows] = {}, dkd[TC ? 1 : kGradRows] = {}, dw[TC ? 1 : kGradRows] = {};
  float cq[TC ? 4 : 1][4] = {}, ck[TC ? 4 : 1][4] = {}, cwt[TC ? 4 : 1][4] = {};  // dQg, dKd, −dW tiles
  float gl = 0.0f;
  const int sl = tid % kC, rq = tid / kC;
  float daq[TC ? 1 : kPairRows] = {}, dtv[TC ? 1 : kPairRows] = {};
  float cp2[TC ? 4 : 1][4] = {};  // TC: this warp's tiles of dAqk or dT's V part
  {
    float* tS0 = stage;               // [128][kJs]
    float* tdS = tS0 + 128 * kJs;     // [128][kJs]
    float* tdO = tdS + 128 * kJs;     // [kC][kJs]
    float* tVn = tdO + kC * kJs;      // [kC][kJs]
    float* tdVn = tVn + kC * kJs;     // [kC][kJs]
    float* tv = tdVn + kC * kJs;      // [kC][kJs]
    for (int j0 = 0; j0 < V; j0 += kJt) {
      __syncthreads();  // the previous tile's readers are done
      stage_cols(tS0, S0, K, V, j0);
      stage_cols(tdS, dS, K, V, j0);
      stage_cols(tVn, Vn, kC, V, j0);
      stage_cols(tdVn, dVn, kC, V, j0);
      cp_async_commit();
      stage_io_pair<T>(tdO, p.d_o, p.do_f32, tv, p.v, false, p, r0, nv, hv, j0);
      cp_async_wait0();
      __syncthreads();
      if constexpr (TC) {
        if (rg == 0 && dl < K)
          for (int jj = 0; jj < kJt; jj += 4)
            gl += dot4(*reinterpret_cast<const float4*>(tS0 + dl * kJs + jj),
                       *reinterpret_cast<const float4*>(tdS + dl * kJs + jj));
        // Warp w: rows 16·(w % 4).., columns d of four 8-wide tiles from 32·(w / 4); the A rows
        // (dO, V_new, dV_new) by j, the B columns (S₀, dS) are their rows d by j.
#pragma unroll
        for (int k0 = 0; k0 < kJt; k0 += 8) {
          auto afrag = [&](const float* t, uint32_t (&a)[4]) {
            const float* x = t + (16 * (warp_ % 4) + g_) * kJs + k0 + t4_;
            a[0] = device::tf32(x[0]), a[1] = device::tf32(x[8 * kJs]), a[2] = device::tf32(x[4]);
            a[3] = device::tf32(x[8 * kJs + 4]);
          };
          uint32_t aO[4], aV[4], aD[4];
          afrag(tdO, aO), afrag(tVn, aV), afrag(tdVn, aD);
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const int n0 = 32 * (warp_ / 4) + 8 * nt;
            if (n0 >= K) break;
            const float* bs = tS0 + (n0 + g_) * kJs + k0 + t4_;
            const float* bd = tdS + (n0 + g_) * kJs + k0 + t4_;
            const uint32_t s0 = device::tf32(bs[0]), s1 = device::tf32(bs[4]);
            device::mma_tf32(cq[nt], aO, s0, s1);
            device::mma_tf32(cwt[nt], aD, s0, s1);
            device::mma_tf32(ck[nt], aV, device::tf32(bd[0]), device::tf32(bd[4]));
          }
        }
      } else if (dl < K) {
        for (int jj = 0; jj < kJt; jj += 4) {
          const float4 s0 = *reinterpret_cast<const float4*>(tS0 + dl * kJs + jj);
          const float4 ds = *reinterpret_cast<const float4*>(tdS + dl * kJs + jj);
          if (rg == 0) gl += dot4(s0, ds);
#pragma unroll
          for (int i = 0; i < kGradRows; ++i) {
            const int r = rg * kGradRows + i;
            dqg[i] += dot4(*reinterpret_cast<const float4*>(tdO + r * kJs + jj), s0);
            dkd[i] += dot4(*reinterpret_cast<const float4*>(tVn + r * kJs + jj), ds);
            dw[i] -= dot4(*reinterpret_cast<const float4*>(tdVn + r * kJs + jj), s0);
          }
        }
      }
      if constexpr (TC) {
        // Warp w: product w / 8 (dO V_newᵀ, then dV_new vᵀ), rows 16·((w % 8) / 2).., columns s
        // of four 8-wide tiles from 32·(w % 2).
        const float* A = warp_ < 8 ? tdO : tdVn;
        const float* Bm = warp_ < 8 ? tVn : tv;
#pragma unroll
        for (int k0 = 0; k0 < kJt; k0 += 8) {
          const float* x = A + (16 * ((warp_ % 8) / 2) + g_) * kJs + k0 + t4_;
          const uint32_t a[4] = {device::tf32(x[0]), device::tf32(x[8 * kJs]), device::tf32(x[4]),
                                 device::tf32(x[8 * kJs + 4])};
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            const float* b = Bm + (32 * (warp_ % 2) + 8 * nt + g_) * kJs + k0 + t4_;
            device::mma_tf32(cp2[nt], a, device::tf32(b[0]), device::tf32(b[4]));
          }
        }
      } else {
        for (int jj = 0; jj < kJt; jj += 4) {
          const float4 vn = *reinterpret_cast<const float4*>(tVn + sl * kJs + jj);
          const float4 vs = *reinterpret_cast<const float4*>(tv + sl * kJs + jj);
#pragma unroll
          for (int i = 0; i < kPairRows; ++i) {
            const int r = rq * kPairRows + i;
            daq[i] += dot4(*reinterpret_cast<const float4*>(tdO + r * kJs + jj), vn);
            dtv[i] += dot4(*reinterpret_cast<const float4*>(tdVn + r * kJs + jj), vs);
          }
        }
      }
    }
  }
  if (rg == 0) sdGl[dl] = dl < K ? gl * __expf(sG[(kC - 1) * KP + dl]) : 0.0f;
  if constexpr (TC) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int d = 32 * (warp_ / 4) + 8 * nt + 2 * t4_;
      if (d >= K) break;
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int r = 16 * (warp_ % 4) + g_ + 8 * h2;
        *reinterpret_cast<float2*>(dW + r * KS + d) = make_float2(-cwt[nt][2 * h2], -cwt[nt][2 * h2 + 1]);
        *reinterpret_cast<float2*>(dQg + r * KS + d) = make_float2(cq[nt][2 * h2], cq[nt][2 * h2 + 1]);
        *reinterpret_cast<float2*>(dG + r * KS + d) = make_float2(ck[nt][2 * h2], ck[nt][2 * h2 + 1]);
      }
    }
  } else if (dl < KS)
#pragma unroll
    for (int i = 0; i < kGradRows; ++i) {
      const int r = rg * kGradRows + i;
      dW[r * KS + dl] = dl < K ? dw[i] : 0.0f;
      // dQg and dKd wait in global scratch for the final pass (this thread reads them back): kept
      // in registers across the passes between, they were indexed at run time and lived in local memory.
      dQg[r * KS + dl] = dqg[i];
      dG[r * KS + dl] = dkd[i];
    }

  if constexpr (TC) {
    float* out = warp_ < 8 ? sdAq : sdA;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * ((warp_ % 8) / 2) + g_ + 8 * (e >> 1), c = 32 * (warp_ % 2) + 8 * nt + 2 * t4_ + (e & 1);
        out[r * CP + c] = warp_ >= 8 || c <= r ? cp2[nt][e] : 0.0f;
      }
  } else {
#pragma unroll
    for (int i = 0; i < kPairRows; ++i) {
      const int r = rq * kPairRows + i;
      sdAq[r * CP + sl] = sl <= r ? daq[i] : 0.0f;
      sdA[r * CP + sl] = dtv[i];
    }
  }
  __syncthreads();

  if (p.delta_write) {
    // T and Ā as prepare left them (only their lower triangles are read below).
    for (int idx = tid; idx < kC * kC; idx += kGradThreads) {
      const int i = idx / kC, jc = idx % kC;
      const float val = p.TA[base * kC + idx];
      if (jc <= i) {
        sT[i * CP + jc] = val;
      } else {
        sAb[jc * CP + i] = val;
        if (TC) sT[i * CP + jc] = 0.0f;  // the tensor-core products read whole tiles of T
      }
    }
    __syncthreads();
    // dT = (dV_new Vᵀ + dW (e^G ⊙ K)ᵀ) · β_s, dW staged in shared memory (read from global scratch
    // in the inner loop it cost an L2 round trip per term). SIMT: a thread owns column s of rows
    // rq, rq + 8, …, so e^{G_s} ⊙ k_s is formed once per channel. TC: the transposed product
    // dTᵀ = (e^G ⊙ K) dWᵀ, warp w → rows s of tile w % 4, columns r of two tiles from 16·(w / 4),
    // e^G ⊙ k formed in the A fragments; dW's rows padded to K + 4 words (conflict-free B reads).
    if constexpr (TC) {
      const int warp = tid / 32, LW = K + 4, s0 = 16 * (warp % 4), rn = 16 * (warp / 4);
      float* sdW = stage;  // [kC][K + 4]
      for (int i = tid; i < kC * K / 4; i += kGradThreads) {
        const int r = i / (K / 4), d = 4 * (i % (K / 4));
        *reinterpret_cast<float4*>(sdW + r * LW + d) = *reinterpret_cast<const float4*>(dW + r * KS + d);
      }
      __syncthreads();
      float acc[2][4];
      each_tile_elem<2>(s0, rn, [&](int j, int e, int s, int r) { acc[j][e] = sdA[r * CP + s]; });
      warp_tiles_tc<2>(
          acc, s0, rn, 0, K, [&](int s, int d) { return __expf(sG[s * KP + d]) * sk[s * KP + d]; },
          [&](int d, int r) { return sdW[r * LW + d]; });
      each_tile_elem<2>(s0, rn, [&](int j, int e, int s, int r) { sdA[r * CP + s] = acc[j][e] * sb[s]; });
    } else {
      constexpr int kStep = kGradThreads / kC, kRows = kC / kStep;
      static_assert(kStep * kC == kGradThreads && kRows * kStep == kC, "dT: whole columns per thread");
      float* sdW = stage;  // [kC][KS]
      for (int i = tid; i < kC * KS; i += kGradThreads) sdW[i] = dW[i];
      __syncthreads();
      const int s = tid % kC, rq = tid / kC;
      float a[kRows];
#pragma unroll
      for (int m = 0; m < kRows; ++m) a[m] = sdA[(rq + kStep * m) * CP + s];
      for (int d = 0; d < K; ++d) {
        const float kg = __expf(sG[s * KP + d]) * sk[s * KP + d];
#pragma unroll
        for (int m = 0; m < kRows; ++m) a[m] += sdW[(rq + kStep * m) * KS + d] * kg;
      }
#pragma unroll
      for (int m = 0; m < kRows; ++m) sdA[(rq + kStep * m) * CP + s] = a[m] * sb[s];
    }
    __syncthreads();
    // dA = −Tᵀ dT Tᵀ, strictly lower: Tmp = Tᵀ dT, then −Tmp Tᵀ. TC: warp w → rows of tile w % 4,
    // two column tiles from 16·(w / 4); Tᵀ upper triangular (rows r.. of the sum), Tᵀ's columns
    // s.. in the second product (T zero above the diagonal).
    if constexpr (TC) {
      const int warp = tid / 32, r0 = 16 * (warp % 4), n0 = 16 * (warp / 4);
      float acc[2][4] = {};
      warp_tiles_tc<2>(
          acc, r0, n0, r0, kC, [&](int r, int rr) { return sT[rr * CP + r]; },
          [&](int rr, int s) { return sdA[rr * CP + s]; });
      each_tile_elem<2>(r0, n0, [&](int j, int e, int r, int s) { sTmp[r * CP + s] = acc[j][e]; });
      __syncthreads();
      float acc2[2][4] = {};
      if (n0 <= r0)
        warp_tiles_tc<2>(
            acc2, r0, n0, 0, n0 + 16, [&](int r, int ss) { return sTmp[r * CP + ss]; },
            [&](int ss, int s) { return sT[s * CP + ss]; });
      each_tile_elem<2>(r0, n0, [&](int j, int e, int r, int s) { sdA[r * CP + s] = s < r ? -acc2[j][e] : 0.0f; });
    } else {
      for (int idx = tid; idx < kC * kC; idx += kGradThreads) {
        const int r = idx / kC, s = idx % kC;
        float a = 0.0f;
        for (int rr = r; rr < kC; ++rr) a += sT[rr * CP + r] * sdA[rr * CP + s];
        sTmp[r * CP + s] = a;
      }
      __syncthreads();
      for (int idx = tid; idx < kC * kC; idx += kGradThreads) {
        const int r = idx / kC, s = idx % kC;
        float a = 0.0f;
        if (s < r)
          for (int ss = 0; ss <= s; ++ss) a -= sTmp[r * CP + ss] * sT[s * CP + ss];
        sdA[r * CP + s] = a;
      }
    }
    __syncthreads();
    // dβ_r += Σ_s dA ⊙ Ā; dĀ = β_r dA.
    for (int r = tid; r < kC; r += kGradThreads) {
      float a = 0.0f;
      for (int s = 0; s < r; ++s) {
        a += sdA[r * CP + s] * sAb[r * CP + s];
        sdA[r * CP + s] *= sb[r];
      }
      sdb[r] += a;
    }
    __syncthreads();
  }

  // dv: Delta: dVb = Tᵀ dV_new, dv = β dVb, dβ += Σ_j dVb v; Additive: dv = dV_new. dV_new is
  // staged 128 columns at a time. TC (Delta): warp w → rows of tile w % 4, four column tiles from
  // 32·(w / 4); the stage's rows padded to 136 words (conflict-free B reads), zeros past V.
  for (int j0 = 0; j0 < V; j0 += 128) {
    const int tw = min(128, V - j0);
    __syncthreads();  // the stage's previous readers are done
    if constexpr (TC) {
      if (p.delta_write) {
        constexpr int LS = 136;
        for (int i = tid; i < kC * 128; i += kGradThreads) {
          const int r = i / 128, jj = i % 128;
          stage[r * LS + jj] = jj < tw ? dVn[int64_t(r) * V + j0 + jj] : 0.0f;
        }
        __syncthreads();
        const int warp = tid / 32, rt = 16 * (warp % 4), n0 = 32 * (warp / 4);
        if (n0 < tw) {  // whole warps
          float acc[4][4] = {};
          warp_tiles_tc<4>(
              acc, rt, n0, rt, kC, [&](int r, int rr) { return sT[rr * CP + r]; },
              [&](int rr, int jj) { return stage[rr * LS + jj]; });
          float part[2] = {};  // rows rt + g and rt + g + 8
          each_tile_elem<4>(rt, n0, [&](int jt, int e, int r, int jj) {
            if (r >= nv || jj >= tw) return;
            const int64_t o = ((r0 + r) * p.HV + hv) * V + j0 + jj;
            part[e >> 1] += acc[jt][e] * to_f32(v[o]);
            if (p.dv) p.dv[o] += sb[r] * acc[jt][e];
          });
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {  // the four lanes of a row's quad, then one atomic
            float x = part[hh];
            x += __shfl_xor_sync(0xffffffffu, x, 1);
            x += __shfl_xor_sync(0xffffffffu, x, 2);
            const int r = rt + (tid % 32) / 4 + 8 * hh;
            if (tid % 4 == 0 && r < nv) atomicAdd(&sdb[r], x);
          }
        }
        continue;
      }
    }
    for (int i = tid; i < kC * tw; i += kGradThreads) {
      const int r = i / tw, jj = i % tw;
      stage[r * 128 + jj] = dVn[int64_t(r) * V + j0 + jj];
    }
    __syncthreads();
    for (int i = tid; i < kC * tw; i += kGradThreads) {
      const int r = i / tw, jj = i % tw;
      if (r >= nv) continue;
      float dv;
      if (p.delta_write) {
        float dvb = 0.0f;
        for (int rr = r; rr < kC; ++rr) dvb += sT[rr * CP + r] * stage[rr * 128 + jj];
        dv = sb[r] * dvb;
        const float part = dvb * to_f32(v[((r0 + r) * p.HV + hv) * V + j0 + jj]);
        if (tw % 32 == 0) {  // the warp shares r: one atomic per warp
          const float sum = device::warp_sum(part);
          if (tid % 32 == 0) atomicAdd(&sdb[r], sum);
        } else {
          atomicAdd(&sdb[r], part);
        }
      } else {
        dv = stage[r * 128 + jj];
      }
      if (p.dv) p.dv[((r0 + r) * p.HV + hv) * V + j0 + jj] += dv;
    }
  }
  // dW into the stage for dKb = Tᵀ dW below (SIMT); TC: dKb itself, [kC][K + 8], by the tensor
  // cores as dv's dVb above (dW staged with rows of K + 8 words, then overwritten by dKb).
  __syncthreads();
  if (p.delta_write) {
    if constexpr (TC) {
      const int LS = K + 8;
      for (int i = tid; i < kC * K / 4; i += kGradThreads) {
        const int r = i / (K / 4), d = 4 * (i % (K / 4));
        *reinterpret_cast<float4*>(stage + r * LS + d) = *reinterpret_cast<const float4*>(dW + r * KS + d);
      }
      __syncthreads();
      const int warp = tid / 32, rt = 16 * (warp % 4), n0 = 32 * (warp / 4);
      float acc[4][4] = {};
      if (n0 < K)
        warp_tiles_tc<4>(
            acc, rt, n0, rt, kC, [&](int r, int rr) { return sT[rr * CP + r]; },
            [&](int rr, int d) { return stage[rr * LS + d]; });
      __syncthreads();  // every read of dW is done
      if (n0 < K)
        each_tile_elem<4>(rt, n0, [&](int jt, int e, int r, int d) {
          if (d < K) stage[r * LS + d] = acc[jt][e];
        });
    } else {
      for (int i = tid; i < kC * KS; i += kGradThreads) stage[i] = dW[i];
    }
  }
  __syncthreads();

  // The decayed grams' backward sums over the other 16-row blocks with the exponent split at the
  // block's edges, both factors ≤ 0:
  //   s < rb:       e^{G_r − G_s} = e^{G_r − G_rb} · e^{G_rb − G_s}
  //   rr > rb + 15: e^{G_rr − G_r} = e^{G_rr − G_re} · e^{G_re − G_r}, re = rb + 15;
  // inside the block each pair has its own. With
  //   dQs = e^G dQg + rowQ,  K⁺ = e^G β dKb + rowK,  K⁻ = e^{G_C − G} dKd + col
  // (rowQ, rowK: Σ_s dAqk or dĀ [r][s] k_s e^{G_r − G_s}; col: Σ_rr e^{G_rr − G_r} (dAqk[rr][r] q_rr
  // + dĀ[rr][r] k_rr)) a row's gradients are dq = s dQs, dk = K⁺ + K⁻, dG = q dQs + k (K⁺ − K⁻).
  // TC: the sums over the other blocks are products on the tensor cores, warp w → row block w % 4
  // and 32 channels from 32·(w / 4), the right-hand sides k_s e^{G_rb − G_s}, q_rr e^{G_rr − G_re},
  // k_rr e^{G_rr − G_re} formed in the fragments; then dQs, K⁺ and K⁻ without their in-block sums go
  // to dQg's scratch, the stage (over dKb) and dKd's scratch, and dG_C's Σ_r e^{G_C − G} k dKd and
  // dβ's Σ_d e^G k dKb are summed there.
  static_assert(kGradRows == 16, "a thread's rows are one 16-row block");
  if constexpr (TC) {
    const int warp = tid / 32, lane = tid % 32, rb = 16 * (warp % 4), re = rb + 15, n0 = 32 * (warp / 4);
    const int LS = K + 8;
    if (n0 < K) {
      float oQ[4][4] = {}, oK[4][4] = {}, oC[4][4] = {};
      const int g = lane / 4, t4 = lane % 4;
      // A fragments of dAqk and dĀ at (rows rb.., columns k0..), at(r, c) their offset.
      auto afrags = [&](uint32_t (&aq)[4], uint32_t (&ak)[4], int k0, auto at) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int o = at(rb + g + 8 * (e & 1), k0 + t4 + 4 * (e >> 1));
          aq[e] = device::tf32(sdAq[o]);
          ak[e] = device::tf32(p.delta_write ? sdA[o] : 0.0f);
        }
      };
      for (int k0 = 0; k0 < rb; k0 += 8) {  // s < rb
        uint32_t aq[4], ak[4];
        afrags(aq, ak, k0, [&](int r, int sc) { return r * CP + sc; });
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int d = n0 + 8 * j + g;
          uint32_t y[2];
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const int sr = k0 + t4 + 4 * h2;
            y[h2] = device::tf32(sk[sr * KP + d] * __expf(sG[rb * KP + d] - sG[sr * KP + d]));
          }
          device::mma_tf32(oQ[j], aq, y[0], y[1]);
          if (p.delta_write) device::mma_tf32(oK[j], ak, y[0], y[1]);
        }
      }
      for (int k0 = re + 1; k0 < kC; k0 += 8) {  // rr > re: the transposes
        uint32_t aq[4], ak[4];
        afrags(aq, ak, k0, [&](int r, int rr) { return rr * CP + r; });
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int d = n0 + 8 * j + g;
          uint32_t zq[2], zk[2];
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const int rr = k0 + t4 + 4 * h2;
            const float ex = __expf(sG[rr * KP + d] - sG[re * KP + d]);
            zq[h2] = device::tf32(sq[rr * KP + d] * ex);
            zk[h2] = device::tf32(sk[rr * KP + d] * ex);
          }
          device::mma_tf32(oC[j], aq, zq[0], zq[1]);
          if (p.delta_write) device::mma_tf32(oC[j], ak, zk[0], zk[1]);
        }
      }
      float gsum[4][2] = {}, bsum[2] = {};  // dG_C per column, dβ per row (g, g + 8)
      each_tile_elem<4>(rb, n0, [&](int j, int e, int r, int d) {
        if (d >= K) return;
        const float Gr = sG[r * KP + d], eG = __expf(Gr), eGd = __expf(sG[(kC - 1) * KP + d] - Gr);
        const float eb = __expf(Gr - sG[rb * KP + d]), ee = __expf(sG[re * KP + d] - Gr);
        const float kr = sk[r * KP + d];
        dQg[r * KS + d] = eG * dQg[r * KS + d] + eb * oQ[j][e];
        const float dkd_r = dG[r * KS + d];
        gsum[j][e & 1] += eGd * kr * dkd_r;
        dG[r * KS + d] = eGd * dkd_r + ee * oC[j][e];
        float kp = 0.0f;
        if (p.delta_write) {
          const float dkb = stage[r * LS + d];
          bsum[e >> 1] += dkb * eG * kr;
          kp = eG * sb[r] * dkb + eb * oK[j][e];
        }
        stage[r * LS + d] = kp;
      });
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {  // over the rows: the eight lanes of a column
          float x = gsum[j][c];
          x += __shfl_xor_sync(0xffffffffu, x, 4);
          x += __shfl_xor_sync(0xffffffffu, x, 8);
          x += __shfl_xor_sync(0xffffffffu, x, 16);
          const int d = n0 + 8 * j + 2 * t4 + c;
          if (g == 0 && d < K) atomicAdd(&sdGl[d], x);
        }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {  // over the channels: the four lanes of a row
        float x = bsum[hh];
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        if (t4 == 0 && p.delta_write) atomicAdd(&sdb[rb + g + 8 * hh], x);
      }
    }
    __syncthreads();
    // Per element (r, d): the in-block sums, then dq, dk and dG (this thread: channel dl, rows of
    // block rg).
    if (dl < K) {
      const int d = dl, rb = rg * kGradRows, re = rb + kGradRows - 1;
      for (int r = rb; r <= re; ++r) {
        const float Gr = sG[r * KP + d], qr = sq[r * KP + d], kr = sk[r * KP + d];
        float rowQ = sdAq[r * CP + r] * kr, rowK = 0.0f, col = sdAq[r * CP + r] * qr;
        in_block_sums(rowQ, rowK, col, r, rb, re, d, Gr, sq, sk, sG, sdAq, sdA, KP, CP, p.delta_write);
        const float dQs = dQg[r * KS + d] + rowQ, kp = stage[r * LS + d] + rowK, km = dG[r * KS + d] + col;
        if (r < nv && p.dq && p.dk) {
          atomicAdd(&p.dq[((r0 + r) * p.H + h) * K + d], p.scale * dQs);
          atomicAdd(&p.dk[((r0 + r) * p.H + h) * K + d], kp + km);
        }
        dG[r * KS + d] = qr * dQs + kr * (kp - km);
      }
    }
  } else if (dl < K) {
    // Per element (r, d), on the threads that hold its dQg and dKd: dq, dk and dG. This thread's
    // rows are the 16-row block rb.. (kGradRows = 16); one exponential per s or rr for four rows
    // at a time over the other blocks.
    const int d = dl, rb = rg * kGradRows, re = rb + kGradRows - 1;
    const float GCd = sG[(kC - 1) * KP + d], Gb = sG[rb * KP + d], Ge = sG[re * KP + d];
    float glk = 0.0f;
#pragma unroll 1
    for (int q4 = 0; q4 < kGradRows / 4; ++q4) {
      const int ra = rb + 4 * q4;  // rows ra..ra+3
      float aQ[4] = {}, aK[4] = {}, aC[4] = {};
      for (int s = 0; s < rb; ++s) {
        const float y = sk[s * KP + d] * __expf(Gb - sG[s * KP + d]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          aQ[i] += sdAq[(ra + i) * CP + s] * y;
          if (p.delta_write) aK[i] += sdA[(ra + i) * CP + s] * y;
        }
      }
      for (int rr = re + 1; rr < kC; ++rr) {
        const float e = __expf(sG[rr * KP + d] - Ge), zq = sq[rr * KP + d] * e, zk = sk[rr * KP + d] * e;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          aC[i] += sdAq[rr * CP + ra + i] * zq;
          if (p.delta_write) aC[i] += sdA[rr * CP + ra + i] * zk;  // Additive: sdA holds something else
        }
      }
#pragma unroll
      for (int i4 = 0; i4 < 4; ++i4) {
        const int r = ra + i4;
        const float Gr = sG[r * KP + d], eG = __expf(Gr), eGd = __expf(GCd - Gr);
        const float qr = sq[r * KP + d], kr = sk[r * KP + d];
        // Qg = e^G ⊙ q·s; Kd = e^{G_C − G} ⊙ k.
        const float dqg_r = dQg[r * KS + d], dkd_r = dG[r * KS + d];
        float dQs = eG * dqg_r, dK = eGd * dkd_r;
        const float kd = eGd * kr * dkd_r;
        float dg = eG * qr * dqg_r - kd;
        glk += kd;
        if (p.delta_write) {  // Kb = β e^G ⊙ k: dKb = Tᵀ dW
          float dkb = 0.0f;
          for (int rr = r; rr < kC; ++rr) dkb += sT[rr * CP + r] * stage[rr * KS + d];
          const float dkg = sb[r] * dkb;
          dK += eG * dkg;
          dg += eG * kr * dkg;
          const float part = dkb * eG * kr;
          if (K % 32 == 0) {  // the warp shares r and is whole: one atomic per warp
            const float sum = device::warp_sum(part);
            if (tid % 32 == 0) atomicAdd(&sdb[r], sum);
          } else {
            atomicAdd(&sdb[r], part);
          }
        }
        // The decayed grams: Aqk (x = q, y = k, with the diagonal) and Ā (x = y = k, strictly lower).
        const float eb = __expf(Gr - Gb), ee = __expf(Ge - Gr);
        float rowQ = sdAq[r * CP + r] * kr + aQ[i4] * eb, rowK = aK[i4] * eb;  // s = r: e = 1
        float col = sdAq[r * CP + r] * qr + aC[i4] * ee;
        in_block_sums(rowQ, rowK, col, r, rb, re, d, Gr, sq, sk, sG, sdAq, sdA, KP, CP, p.delta_write);
        dQs += rowQ;
        dK += rowK + col;
        dg += qr * rowQ + kr * rowK - kr * col;
        if (r < nv && p.dq && p.dk) {
          atomicAdd(&p.dq[((r0 + r) * p.H + h) * K + d], p.scale * dQs);
          atomicAdd(&p.dk[((r0 + r) * p.H + h) * K + d], dK);
        }
        dG[r * KS + d] = dg;
      }
    }
    atomicAdd(&sdGl[d], glk);
  }
  __syncthreads();
  // dg = reverse cumulative sum of dG inside the chunk (G is the cumsum of g), dG_C at the end.
  if (p.decay == 2 && p.dg)
    for (int d = tid; d < K; d += kGradThreads) {
      // 8 rows at a time, their loads in flight together (one row after another, each load
      // waited for its round trip).
      constexpr int kBatch = 8;
      float carry = sdGl[d];
      for (int top = kC - 1; top >= 0; top -= kBatch) {
        float x[kBatch], old[kBatch];
#pragma unroll
        for (int e = 0; e < kBatch; ++e) {
          const int r = top - e;
          x[e] = dG[r * KS + d];
          old[e] = r < nv ? p.dg[((r0 + r) * p.HV + hv) * K + d] : 0.0f;
        }
#pragma unroll
        for (int e = 0; e < kBatch; ++e) {
          const int r = top - e;
          carry += x[e];
          if (r < nv) p.dg[((r0 + r) * p.HV + hv) * K + d] = old[e] + carry;
        }
      }
    }
  if (p.decay == 1 && p.dg) {
    // A scalar gate: dg of a row is the sum over the channels. Four lanes per channel, 16 rows
    // each with their loads in flight at once, the segments' totals passed between the four lanes
    // by shuffles, then the warp's eight channels summed by shuffles: one atomic per row and warp
    // (rather than one per channel).
    static_assert(kGradThreads == 4 * 128 && kC == 4 * 16, "four lanes of 16 rows per channel, 128 channels");
    const int d = tid / 4, seg = tid % 4, rs = 16 * seg;
    const bool on = d < K;
    float x[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) x[e] = on ? dG[(rs + e) * KS + d] : 0.0f;
    float total = 0.0f;
#pragma unroll
    for (int e = 0; e < 16; ++e) total += x[e];
    // The totals of this channel's later segments (lanes seg + 1.. of the same four).
    const float t1 = __shfl_down_sync(0xFFFFFFFFu, total, 1), t2 = __shfl_down_sync(0xFFFFFFFFu, total, 2),
                t3 = __shfl_down_sync(0xFFFFFFFFu, total, 3);
    float carry = (on ? sdGl[d] : 0.0f) + (seg < 3 ? t1 : 0.0f) + (seg < 2 ? t2 : 0.0f) + (seg < 1 ? t3 : 0.0f);
#pragma unroll
    for (int e = 15; e >= 0; --e) {
      const int r = rs + e;
      carry += x[e];
      float sum = on ? carry : 0.0f;  // lanes of the same segment: bits 2–4 of the lane
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 4);
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 8);
      sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 16);
      if (tid % 32 < 4 && r < nv) atomicAdd(&p.dg[(r0 + r) * p.HV + hv], sum);
    }
  }
  if (p.delta_write && p.dbeta)
    for (int r = tid; r < nv; r += kGradThreads) p.dbeta[(r0 + r) * p.HV + hv] += sdb[r];
}

size_t prepare_smem(int K, bool tc = false, bool sc = false) {
  if (sc) return sizeof(float) * (kC * (K + 4) + kC * (kC + 4) + kC * kC + 2 * kC) + 2 * 2 * kC * (K + 8);
  return tc ? sizeof(float) * (kC * (K + 4) + kC * std::max(K + 4, kC + 4) + kC * kC + kC) + 2 * kC * (K + 8)
            : sizeof(float) * (kC * ((K + 3) / 4 * 4) + 2 * kC * (K + 1) + kC * kC + kC);
}
size_t recur_smem(int KS) { return sizeof(float) * (KS * kVb + 2 * kC * KS + KS + 2 * kC * kVb); }
size_t reverse_tc_smem(int KS, int VB) {
  return sizeof(float) * (KS * (VB + kPadB) + kC * (KS + kPadA) + kC * (kC + kPadB) + 2 * kC * (KS + kPadB) +
                          2 * kC * (VB + kPadB) + 2 * KS);
}
size_t recur_tc_smem(int KS, int VB) {
  return sizeof(float) * (KS * (VB + kPadB) + 2 * (kC * (2 * KS + kPadA + kPadB + VB + kPadB) + KS));
}
size_t output_smem(int KS, bool tc = false) {
  return tc ? sizeof(float) * ((KS + kC) * (kOb + kPadB) + kC * (KS + kPadA) + kC * (kC + kPadA))
            : sizeof(float) * (KS * kOb + kC * KS + kC * kC + kC * kOb);
}
size_t reverse_smem(int KS) { return sizeof(float) * (KS * kVb + 3 * kC * KS + kC * kC + 2 * kC * kVb + 2 * KS); }
size_t grads_smem(int K) { return sizeof(float) * (kStage + 3 * kC * (K + 1) + 3 * kC * (kC + 1) + 2 * kC + 128); }

template <class T>
void configure() {
  static const bool done = [] {
    K3_CUDA_CHECK(cudaFuncSetAttribute(prepare_kernel<T, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(prepare_smem(128))));
    K3_CUDA_CHECK(cudaFuncSetAttribute(prepare_kernel<T, false>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    K3_CUDA_CHECK(cudaFuncSetAttribute(recur_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(recur_smem(128))));
    K3_CUDA_CHECK(cudaFuncSetAttribute(output_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(output_smem(128))));
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      K3_CUDA_CHECK(cudaFuncSetAttribute(prepare_kernel<T, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(prepare_smem(128, true))));
      K3_CUDA_CHECK(cudaFuncSetAttribute(prepare_kernel<T, true>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
      K3_CUDA_CHECK(cudaFuncSetAttribute(prepare_kernel<T, true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(prepare_smem(128, true, true))));
      K3_CUDA_CHECK(
          cudaFuncSetAttribute(prepare_kernel<T, true, true>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
      K3_CUDA_CHECK(cudaFuncSetAttribute(recur_tc_kernel<16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(recur_tc_smem(128, 16))));
      K3_CUDA_CHECK(cudaFuncSetAttribute(recur_tc_kernel<32>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(recur_tc_smem(128, 32))));
      K3_CUDA_CHECK(cudaFuncSetAttribute(reverse_tc_kernel<16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(reverse_tc_smem(128, 16))));
      K3_CUDA_CHECK(cudaFuncSetAttribute(reverse_tc_kernel<32>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(reverse_tc_smem(128, 32))));
      K3_CUDA_CHECK(cudaFuncSetAttribute(output_tc_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(output_smem(128, true))));
    }
    K3_CUDA_CHECK(cudaFuncSetAttribute(reverse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(reverse_smem(128))));
    K3_CUDA_CHECK(cudaFuncSetAttribute(grads_kernel<T, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(grads_smem(128))));
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      K3_CUDA_CHECK(cudaFuncSetAttribute(grads_kernel<T, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(grads_smem(128))));
    return true;
  }();
  (void)done;
}

enum class Step : uint8_t { Prepare, Recur, Output, Reverse, Grads };

template <class T>
void launch(Step step, const ChunkDev& d, int64_t NHV) {
  configure<T>();
  const unsigned vtiles = unsigned((d.V + kVb - 1) / kVb);
  const dim3 chunks(unsigned(NHV), unsigned(d.c_count)), tiles(unsigned(NHV), vtiles);
  cudaStream_t st = device::stream();
  const dim3 outs(unsigned(NHV), unsigned(d.c_count), unsigned((d.V + kOb - 1) / kOb));
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (d.tc) {
      const bool narrow = int64_t(tiles.x) * tiles.y <= device::sm_count();
      const dim3 wide(tiles.x, unsigned((d.V + 31) / 32));
      switch (step) {
        case Step::Prepare:  // a scalar gate or none: every gram block as a plain bf16 product
          if (d.decay < 2)
            prepare_kernel<T, true, true><<<chunks, kPrepThreads, prepare_smem(d.K, true, true), st>>>(d);
          else
            prepare_kernel<T, true><<<chunks, kPrepThreads, prepare_smem(d.K, true), st>>>(d);
          break;
        case Step::Recur:  // 16-column tiles while they fit the SMs at one block each, else 32
          if (narrow)
            recur_tc_kernel<16><<<tiles, kRecThreads, recur_tc_smem(d.KS, 16), st>>>(d);
          else
            recur_tc_kernel<32><<<wide, kRecThreads, recur_tc_smem(d.KS, 32), st>>>(d);
          break;
        case Step::Reverse:
          if (narrow)
            reverse_tc_kernel<16><<<tiles, kRecThreads, reverse_tc_smem(d.KS, 16), st>>>(d);
          else
            reverse_tc_kernel<32><<<wide, kRecThreads, reverse_tc_smem(d.KS, 32), st>>>(d);
          break;
        case Step::Output:  // a block per chunk walks the 64-column tiles (Qg and Aqk load once)
          output_tc_kernel<T><<<chunks, kRecThreads, output_smem(d.KS, true), st>>>(d);
          break;
        case Step::Grads: grads_kernel<T, true><<<chunks, kGradThreads, grads_smem(d.K), st>>>(d); break;
      }
      K3_CUDA_LAUNCHED();
      return;
    }
  }
  switch (step) {
    case Step::Prepare: prepare_kernel<T, false><<<chunks, kPrepThreads, prepare_smem(d.K), st>>>(d); break;
    case Step::Recur: recur_kernel<<<tiles, kRecThreads, recur_smem(d.KS), st>>>(d); break;
    case Step::Output: output_kernel<T><<<outs, kRecThreads, output_smem(d.KS), st>>>(d); break;
    case Step::Reverse:
      reverse_kernel<<<tiles, kRecThreads, reverse_smem(d.KS), st>>>(d);
      break;
    case Step::Grads: grads_kernel<T, false><<<chunks, kGradThreads, grads_smem(d.K), st>>>(d); break;
  }
  K3_CUDA_LAUNCHED();
}

void run(Step step, const ChunkDev& d, int64_t NHV, DType io) {
  if (io == DType::BF16)
    launch<__nv_bfloat16>(step, d, NHV);
  else
    launch<float>(step, d, NHV);
}

// The scratch of one window: the slabs and chunk states, and for the backward the states'
// adjoints and dV_new.
struct Scratch {
  device::Buffer W, Qg, Kd, U, Aqk, gC, Sc, dSc, dVn, TA;
  Scratch(ChunkDev& d, int64_t NHV, int64_t window, bool backward) {
    const int64_t rows = NHV * window * kC;
    auto f32 = [](int64_t n) { return device::Buffer(size_t(n) * sizeof(float)); };
    W = f32(rows * d.KS), Qg = f32(rows * d.KS), Kd = f32(rows * d.KS), U = f32(rows * d.V);
    Aqk = f32(rows * kC), gC = f32(NHV * window * d.KS);
    d.W = W.as<float>(), d.Qg = Qg.as<float>(), d.Kd = Kd.as<float>(), d.U = U.as<float>();
    d.Aqk = Aqk.as<float>(), d.gC = gC.as<float>();
    Sc = f32(NHV * window * d.K * d.V);
    d.Sc = Sc.as<float>();
    if (backward) {
      dSc = f32(NHV * window * d.K * d.V), dVn = f32(rows * d.V), TA = f32(rows * kC);
      d.dSc = dSc.as<float>(), d.dVn = dVn.as<float>(), d.TA = TA.as<float>();
    }
  }
};

ChunkDev chunk_dev(const cuda::DeviceArgs& a) {
  cuda::check_supported(a.K, a.V);
  if (a.max_len < 1) throw error("delta", "the chunked CUDA kernels need the longest sequence length (max_len)");
  ChunkDev d{};
  d.N = int(a.N), d.H = int(a.H), d.HV = int(a.HV), d.K = int(a.K), d.V = int(a.V), d.group = int(a.HV / a.H);
  d.delta_write = a.write == Write::Delta;
  d.decay = a.decay == Decay::None ? 0 : a.decay == Decay::Scalar ? 1 : 2;
  d.scale = a.scale > 0.0f ? a.scale : 1.0f / sqrtf(float(a.K));
  d.row0 = a.row0, d.len = a.len;
  d.q = a.q, d.k = a.k, d.v = a.v, d.beta = a.beta, d.g = a.g;
  d.o_f32 = a.io != DType::BF16 || a.o_dtype != DType::BF16;
  d.KS = int((a.K + 3) / 4 * 4);
  // The tensor-core kernels load q, k and v 16 bytes at a time.
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  d.tc = a.io == DType::BF16 && a.K % 16 == 0 && a.K <= 128 && !a.simt && aligned(a.q) && aligned(a.k) && aligned(a.v);
  return d;
}

// Chunks per window: as many as the scratch budget holds (a.window overrides).
int64_t window_of(const cuda::DeviceArgs& a, const ChunkDev& d, int64_t chunks, bool backward) {
  const int64_t NHV = a.N * a.HV;
  int64_t per_chunk = kC * (3 * d.KS + a.V + kC) + d.KS + a.K * a.V;
  if (backward) per_chunk += a.K * a.V + kC * (a.V + kC);
  per_chunk *= int64_t(sizeof(float)) * NHV;
  // The chunk index of a window is gridDim.y of the per-chunk kernels (≤ 65,535).
  return std::clamp<int64_t>(a.window > 0 ? a.window : kScratchBudget / per_chunk, 1, std::min<int64_t>(chunks, 65535));
}

}  // namespace
}  // namespace k3::linear::detail

namespace k3::linear::cuda {

// A whole sequence's scratch in one window, filled by the forward with what the backward reads
// (T and Ā, each chunk's entering state, V_new), and the arguments it was filled for.
struct ChunkSaved {
  detail::Scratch scratch;
  detail::ChunkDev d;  // the scratch's pointers (set by its constructor)
  DeviceArgs args;     // what the forward ran on (keep cleared)
  int64_t chunks;
  size_t bytes;
  ChunkSaved(detail::ChunkDev& dev, int64_t NHV, int64_t chunks_, size_t bytes_, const DeviceArgs& a)
      : scratch(dev, NHV, chunks_, true), d(dev), args(a), chunks(chunks_), bytes(bytes_) {
    args.keep = nullptr;
  }
  bool matches(const DeviceArgs& a) const {
    const DeviceArgs& b = args;
    return a.N == b.N && a.H == b.H && a.HV == b.HV && a.K == b.K && a.V == b.V && a.write == b.write &&
           a.decay == b.decay && a.scale == b.scale && a.io == b.io && a.row0 == b.row0 && a.len == b.len &&
           a.max_len == b.max_len && a.simt == b.simt && a.q == b.q && a.k == b.k && a.v == b.v &&
           a.beta == b.beta && a.g == b.g && a.h0 == b.h0;
  }
};

ForwardScratch::ForwardScratch() = default;
ForwardScratch::~ForwardScratch() = default;
ForwardScratch::ForwardScratch(ForwardScratch&&) noexcept = default;
ForwardScratch& ForwardScratch::operator=(ForwardScratch&&) noexcept = default;
size_t ForwardScratch::bytes() const { return saved ? saved->bytes : 0; }

void chunked_forward(const DeviceArgs& a) {
  using namespace detail;
  ChunkDev d = chunk_dev(a);
  const int64_t NHV = a.N * a.HV;
  if (NHV == 0) return;
  d.o = a.o;
  d.store_vn = 1;
  const int64_t chunks = (a.max_len + kC - 1) / kC;
  // The backward's scratch for every chunk in one window (window_of's per-chunk sizes).
  const size_t keep_bytes = sizeof(float) * size_t(NHV * chunks * kC * (3 * d.KS + 2 * a.V + 2 * kC) +
                                                   NHV * chunks * (d.KS + 2 * a.K * a.V));
  if (a.keep) a.keep->saved.reset();
  // Kept for the backward: one window of the backward's scratch over every chunk; else windows
  // of the forward's own.
  std::unique_ptr<ChunkSaved> saved;
  std::optional<Scratch> scratch;
  int64_t window = chunks;
  if (a.keep && keep_bytes <= a.keep->budget && chunks <= 65535 && (a.window == 0 || a.window >= chunks)) {
    saved = std::make_unique<ChunkSaved>(d, NHV, chunks, keep_bytes, a);
  } else {
    window = window_of(a, d, chunks, false);
    scratch.emplace(d, NHV, window, false);
  }
  // The state between windows: ht when the caller wants it (it may alias h0: each block reads its
  // slice before writing it), else a temporary.
  device::Buffer tmp;
  float* state = a.ht;
  if (!state) {
    tmp = device::Buffer(size_t(NHV * a.K * a.V * 4));
    state = tmp.as<float>();
  }
  for (int64_t cb = 0; cb < chunks; cb += window) {
    d.c_begin = int(cb);
    d.c_count = int(std::min(window, chunks - cb));
    d.s_in = cb == 0 ? a.h0 : state;
    d.s_out = state;
    run(Step::Prepare, d, NHV, a.io);
    run(Step::Recur, d, NHV, a.io);
    run(Step::Output, d, NHV, a.io);
  }
  if (saved) a.keep->saved = std::move(saved);
  // The scratch returns to the allocator's cache; later work on the same stream cannot overlap.
}

void chunked_backward(const DeviceArgs& a, const DeviceGrads& g) {
  using namespace detail;
  ChunkDev d = chunk_dev(a);
  const int64_t NHV = a.N * a.HV;
  if (NHV == 0) return;
  const int64_t chunks = (a.max_len + kC - 1) / kC;
  std::unique_ptr<ChunkSaved> saved;
  if (a.keep) saved = std::move(a.keep->saved);  // emptied either way
  if (saved && (!saved->matches(a) || saved->chunks != chunks)) saved.reset();
  if (saved) ++a.keep->reused;
  const int64_t window = saved ? chunks : window_of(a, d, chunks, true);
  const int64_t windows = (chunks + window - 1) / window;
  const size_t state_bytes = size_t(NHV * a.K * a.V) * sizeof(float);
  std::optional<Scratch> scratch;
  if (saved)
    d = saved->d;  // the forward's scratch: window 0 of 1 needs no recompute
  else
    scratch.emplace(d, NHV, window, true);
  // The state entering each window after the first (one forward sweep, no outputs).
  device::Buffer starts(state_bytes * size_t(std::max<int64_t>(windows - 1, 0)));
  auto start_of = [&](int64_t w) { return w == 0 ? a.h0 : starts.as<float>() + (w - 1) * NHV * a.K * a.V; };
  ChunkDev f = d;
  f.Sc = nullptr, f.dSc = nullptr, f.dVn = nullptr, f.TA = nullptr;
  for (int64_t w = 0; w + 1 < windows; ++w) {
    f.c_begin = int(w * window), f.c_count = int(window);
    f.s_in = start_of(w), f.s_out = starts.as<float>() + w * NHV * a.K * a.V;
    run(Step::Prepare, f, NHV, a.io);
    run(Step::Recur, f, NHV, a.io);
  }
  device::Buffer state(state_bytes), carry_a(state_bytes), carry_b(state_bytes), dh0_tmp;
  float* dh0 = g.dh0;
  if (!dh0) {
    dh0_tmp = device::Buffer(state_bytes);
    dh0 = dh0_tmp.as<float>();
  }
  d.store_vn = 1;
  d.o = nullptr;
  d.d_o = g.d_o;
  d.do_f32 = a.io != DType::BF16 || g.do_dtype != DType::BF16;
  d.dq = g.dq, d.dk = g.dk, d.dv = g.dv, d.dbeta = g.dbeta, d.dg = g.dg;
  const float* ds_in = g.dht;
  for (int64_t w = windows - 1; w >= 0; --w) {
    d.c_begin = int(w * window);
    d.c_count = int(std::min(window, chunks - w * window));
    d.s_in = start_of(w), d.s_out = state.as<float>();
    if (!saved) {
      run(Step::Prepare, d, NHV, a.io);
      run(Step::Recur, d, NHV, a.io);
    }
    d.ds_in = ds_in;
    d.ds_out = w == 0 ? dh0 : ((windows - 1 - w) % 2 ? carry_b.as<float>() : carry_a.as<float>());
    run(Step::Reverse, d, NHV, a.io);
    run(Step::Grads, d, NHV, a.io);
    ds_in = d.ds_out;
  }
}

}  // namespace k3::linear::cuda
