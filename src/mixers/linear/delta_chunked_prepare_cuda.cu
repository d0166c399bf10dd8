// The chunked delta rule's first stage, `prepare` (delta_chunked_cuda.cu's opening comment, 1):
// per chunk, all chunks at once, the decayed grams, T = (I + diag(β) Ā)⁻¹ by blocked inversion,
// and the scratch W, U, Qg, Kd, Aqk and e^{G_C} that the later stages read.
#include "mixers/linear/delta_chunked_cuda.cuh"

namespace k3::linear::detail {
namespace {

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

size_t prepare_smem(int K, bool tc = false, bool sc = false) {
  if (sc) return sizeof(float) * (kC * (K + 4) + kC * (kC + 4) + kC * kC + 2 * kC) + 2 * 2 * kC * (K + 8);
  return tc ? sizeof(float) * (kC * (K + 4) + kC * std::max(K + 4, kC + 4) + kC * kC + kC) + 2 * kC * (K + 8)
            : sizeof(float) * (kC * ((K + 3) / 4 * 4) + 2 * kC * (K + 1) + kC * kC + kC);
}

template <class T>
void launch_prepare_as(const ChunkDev& d, int64_t NHV) {
  static const bool configured = [] {
    K3_CUDA_CHECK(cudaFuncSetAttribute(prepare_kernel<T, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(prepare_smem(128))));
    K3_CUDA_CHECK(cudaFuncSetAttribute(prepare_kernel<T, false>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      K3_CUDA_CHECK(cudaFuncSetAttribute(prepare_kernel<T, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(prepare_smem(128, true))));
      K3_CUDA_CHECK(cudaFuncSetAttribute(prepare_kernel<T, true>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
      K3_CUDA_CHECK(cudaFuncSetAttribute(prepare_kernel<T, true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(prepare_smem(128, true, true))));
      K3_CUDA_CHECK(
          cudaFuncSetAttribute(prepare_kernel<T, true, true>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    }
    return true;
  }();
  (void)configured;
  const dim3 chunks(unsigned(NHV), unsigned(d.c_count));
  cudaStream_t st = device::stream();
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (d.tc) {  // a scalar gate or none: every gram block as a plain bf16 product
      if (d.decay < 2)
        prepare_kernel<T, true, true><<<chunks, kPrepThreads, prepare_smem(d.K, true, true), st>>>(d);
      else
        prepare_kernel<T, true><<<chunks, kPrepThreads, prepare_smem(d.K, true), st>>>(d);
      K3_CUDA_LAUNCHED();
      return;
    }
  }
  prepare_kernel<T, false><<<chunks, kPrepThreads, prepare_smem(d.K), st>>>(d);
  K3_CUDA_LAUNCHED();
}

}  // namespace

void launch_prepare(const ChunkDev& d, int64_t NHV, DType io) {
  if (io == DType::BF16)
    launch_prepare_as<__nv_bfloat16>(d, NHV);
  else
    launch_prepare_as<float>(d, NHV);
}

}  // namespace k3::linear::detail
