// Kernels of the mixers' device memories (mixers_cuda.h): the short convolution continuing a conv
// tail, the tail update, and attention of absorbed MLA queries over a latent cache.
#include <algorithm>
#include <cmath>

#include "core/cuda_util.cuh"
#include "mixers/mixers_cuda.h"

namespace k3::cuda {
namespace {

using namespace device;

constexpr int kThreads = 256;
constexpr int kMaxConv = 16;

// y[b, t, c] = Σ_i w[c, i] · [tail_b ; x_b][t + i, c] (tail_b holds the W − 1 rows before x_b).
__global__ void conv_tail_kernel(const float* x, const float* w, const float* const* tails, int64_t T, int64_t C,
                                 int64_t W, int64_t n, float* y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t c = i % C, bt = i / C, b = bt / T, t = bt % T, P = W - 1;
  const float* tail = tails[b];
  float acc = 0.0f;
  for (int64_t k = 0; k < W; ++k) {
    const int64_t s = t - P + k;
    acc += w[c * W + k] * (s >= 0 ? x[(bt - t + s) * C + c] : tail[(P + s) * C + c]);
  }
  y[i] = acc;
}

// tail_b ← the last W − 1 rows of [tail_b ; x_b], one thread per (sequence, channel).
__global__ void tail_update_kernel(const float* x, float* const* tails, int64_t T, int64_t C, int64_t W, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t c = i % C, b = i / C, P = W - 1;
  float* tail = tails[b];
  const float* xb = x + b * T * C;
  float rows[kMaxConv];
  for (int64_t r = 0; r < P; ++r) {
    const int64_t s = T - P + r;  // row of [tail ; x] counted from x's start
    rows[r] = s >= 0 ? xb[s * C + c] : tail[(P + s) * C + c];
  }
  for (int64_t r = 0; r < P; ++r) tail[r * C + c] = rows[r];
}

// Absorbed MLA attention over B sequences' latent caches, split over the rows (flash-decoding),
// on the tensor cores. A block per (b·T + t, split, head group) walks its chunk of the rows token
// t of sequence b sees. The heads of a group (≤ 16) are the products' M rows, so a latent row is
// read from memory once per group, not once per head. Products are 3xTF32 (x = hi + lo, hi·hi +
// hi·lo + lo·hi; hi = x truncated to TF32, lo = the rest, truncated): fp32 accuracy, which the
// decode's agreement with the full forward needs. Row strides ≡ 8 (mod 32) floats keep both
// products' fragment loads free of bank conflicts; columns past W and rows past the chunk are
// zeros. Partial (m, l, acc) per split go to scratch; latent_combine_kernel merges them.
//
// Wide latents (DeepSeek/K3's 512 + 64, and any the narrow kernels do not take): tiles of 16 rows
// land by cp.async in a two-stage block-wide ring (the next tile loads while this one is used);
//   scores [16, 16] = q [16, W] · tileᵀ: the 8 warps split W (k-steps w, w + 8, …; q's fragments
//     stay in registers for the whole chunk), their partial sums meet in shared memory;
//   softmax bookkeeping: 16 threads per head;
//   acc [16, R] += P · tile[:, :R]: the warps split R (n-tiles w, w + 8, …).
// Narrow latents (W, R ≤ 64 with ≤ 16 heads per group; W, R ≤ 128 with ≤ 8, as k3-small's
// 96 + 32 with 6 heads, 4 warps per block then, the rings being larger): every warp works alone on
// slabs of 16 rows (w, w + NW, … of the chunk) with its own two-stage ring and softmax state, so
// no barrier is needed until the warps' (m, l, acc) are merged once at the end. The products are
// transposed, so that a few heads fill n8 tiles instead of wasting most of m16 tiles:
//   Sᵀ [16 rows, heads] = tile · qᵀ (qᵀ's B fragments split once, in registers);
//   Oᵀ [R, heads] += tileᵀ · Pᵀ (Pᵀ through a small per-warp buffer).
constexpr int kMaxRank = 512;
constexpr int kHeadsPerBlock = 16;  // the products' M; more heads take more blocks
constexpr int kLatWarps = 8;
constexpr int kLatNt = kMaxRank / 8 / kLatWarps;  // value n-tiles per warp (wide)
constexpr int kMaxLatentWidth = 640;              // wide: score k-steps per warp ≤ kMaxLatentWidth / 64
constexpr int kNarrow = 64;                       // narrow: W and R ≤ 64
constexpr int kWideRows = 16;                     // rows per wide tile, and per narrow slab
constexpr int kPStride = kWideRows + 4;           // P's rows: ≡ 4 (mod 32), conflict-free A loads
constexpr float kLog2e = 1.4426950408889634f;     // scores in log₂ units: the softmax takes exp2

struct LatentArgs {
  const float* qt;
  const float* const* lats;
  const int64_t* p0s;
  int64_t T, H, chunk;
  int W, R, stride, splits, groups;
  bool w4;  // W % 4 == 0: a 16-byte aligned cache is copied 16 bytes at a time
  float scale;
  float* part_ml;
  float* part_acc;
};

// x = hi + lo with hi x truncated to TF32 (exact) and lo the rest, itself truncated (error
// ≤ 2^-20 |x|).
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(x) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi)) & 0xffffe000u;
}
struct SplitA {
  uint32_t hi[4], lo[4];
  __device__ __forceinline__ explicit SplitA(const float (&a)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) split_tf32(a[i], hi[i], lo[i]);
  }
};
struct SplitB {
  uint32_t hi[2], lo[2];
  __device__ __forceinline__ SplitB() = default;
  __device__ __forceinline__ SplitB(float b0, float b1) {
    split_tf32(b0, hi[0], lo[0]);
    split_tf32(b1, hi[1], lo[1]);
  }
};
// mma_tf32 without `volatile`, so the compiler may interleave these products with the splits and
// loads around them (the kernels here have no side effects that need the products' order).
__device__ __forceinline__ void mma_tf32_free(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// c += A·B in 3xTF32 (small terms first).
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const SplitA& a, const SplitB& b) {
  mma_tf32_free(c, a.lo, b.hi);
  mma_tf32_free(c, a.hi, b.lo);
  mma_tf32_free(c, a.hi, b.hi);
}
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const SplitA& a, float b0, float b1) {
  mma_3xtf32(c, a, SplitB(b0, b1));
}

// Copies `rows` latent rows from row `base` (zeros from s1 on) into dst rows `stride` apart, by a
// warp (`lane`); 16-byte copies when `vec` (else plain loads and stores). A row of w4 ≤ 16 pieces
// takes 32 / w4 rows per pass, so no lane idles on narrow latents.
__device__ __forceinline__ void copy_rows(float* dst, const float* lat, int64_t base, int64_t s1, int rows, int W,
                                          int stride, bool vec, int lane) {
  if (vec) {
    const int w4 = W / 4, per = w4 <= 16 ? 32 / w4 : 1;  // rows per pass
    const int r0 = w4 <= 16 ? lane / w4 : 0, c0 = w4 <= 16 ? lane % w4 : lane;
    if (r0 < per)
      for (int r = r0; r < rows; r += per) {
        const bool valid = base + r < s1;
        const float* src = lat + (valid ? (base + r) * W : 0);
        for (int c = c0; c < w4; c += 32) cp_async16_zfill(dst + r * stride + 4 * c, src + 4 * c, valid);
      }
  } else {
    for (int r = 0; r < rows; ++r)
      for (int c = lane; c < W; c += 32) dst[r * stride + c] = base + r < s1 ? lat[(base + r) * W + c] : 0.0f;
  }
  cp_async_commit();
}

// Zeros columns W … stride − 1 of `rows` rows `stride` apart (the padding products read and copies
// never reach), by `n` threads from `tid`.
__device__ __forceinline__ void zero_padding(float* rows_at, int rows, int W, int stride, int tid, int n) {
  const int pad = stride - W;
  for (int i = tid; i < rows * pad; i += n) rows_at[i / pad * stride + W + i % pad] = 0.0f;
}

// Pᵀ's row stride in the narrow kernels with NH head tiles: conflict-free B loads (8t + g, 24t + g).
constexpr int narrow_pt_stride(int NH) { return NH == 1 ? 8 : 24; }

// q's A fragments for k-steps k0 = 8·(first + step·i) (zeros past the group's G heads and past W), scaled.
template <int KQ>
__device__ __forceinline__ void q_fragments(float (&qa)[KQ][4], const float* q, int G, int W, float scale, int first,
                                            int step, int g, int tq) {
#pragma unroll
  for (int i = 0; i < KQ; ++i) {
    const int k0 = (first + step * i) * 8;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = g + 8 * (e & 1), k = k0 + tq + 4 * (e >> 1);
      qa[i][e] = h < G && k < W ? q[int64_t(h) * W + k] * scale : 0.0f;
    }
  }
}

struct LatentBlock {
  int64_t bt, s0, s1, h0;
  int split, G;
  const float* lat;
  bool vec;
};
__device__ __forceinline__ LatentBlock latent_block(const LatentArgs& a) {
  LatentBlock k;
  k.bt = blockIdx.x / (int64_t(a.splits) * a.groups);
  k.split = int(blockIdx.x / a.groups % a.splits);
  const int group = int(blockIdx.x % a.groups);
  const int64_t b = k.bt / a.T, t = k.bt % a.T, n = a.p0s[b] + t + 1;
  k.h0 = int64_t(group) * kHeadsPerBlock;
  k.G = int(min(int64_t(kHeadsPerBlock), a.H - k.h0));
  k.s0 = k.split * a.chunk;
  k.s1 = min(n, k.s0 + a.chunk);
  k.lat = a.lats[b];
  k.vec = a.w4 && (reinterpret_cast<uintptr_t>(k.lat) & 15) == 0;
  return k;
}
__device__ __forceinline__ int64_t latent_slot(const LatentArgs& a, const LatentBlock& k, int h) {
  return (k.bt * a.splits + k.split) * a.H + k.h0 + h;
}

template <int KQ>  // score k-steps per warp (W ≤ 64·KQ)
__global__ void __launch_bounds__(kLatWarps * 32, 2) latent_wide_kernel(LatentArgs a) {
  constexpr int RT = kWideRows;
  extern __shared__ __align__(16) float smem[];
  const int W = a.W, R = a.R, stride = a.stride;
  float* tiles = smem;                     // [2][RT][stride]
  float* red = tiles + 2 * RT * stride;    // [warp][16][RT]: partial scores
  float* P = red + kLatWarps * 16 * RT;    // [16][kPStride]
  float* corr = P + 16 * kPStride;         // [16]: this tile's rescale per head
  const LatentBlock k = latent_block(a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int ntiles = k.s0 < k.s1 ? int((k.s1 - k.s0 + RT - 1) / RT) : 0;
  const int Wp = (W + 7) / 8 * 8;

  zero_padding(tiles, 2 * RT, W, stride, threadIdx.x, blockDim.x);  // both stages, for the whole kernel
  auto load = [&](int it) {  // tile it into stage it & 1: a warp's lanes per row, two rows per warp
    copy_rows(tiles + (it & 1) * RT * stride + 2 * warp * stride, k.lat, k.s0 + int64_t(it) * RT + 2 * warp, k.s1, 2, W,
              stride, k.vec, lane);
  };
  static_assert(RT == 2 * kLatWarps, "two rows per warp");
  if (ntiles > 0) load(0);
  float qa[KQ][4];
  q_fragments(qa, a.qt + (k.bt * a.H + k.h0) * W, k.G, W, a.scale * kLog2e, warp, kLatWarps, g, tq);
  float acc[kLatNt][4];
#pragma unroll
  for (int i = 0; i < kLatNt; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  // Softmax state of head sh, kept alike by its 16 threads.
  const int sh = threadIdx.x >> 4, sc = threadIdx.x & 15;
  float m = -INFINITY, l = 0.0f;

  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait0();
    __syncthreads();  // tile it visible; every warp is past tile it − 1's products
    if (it + 1 < ntiles) load(it + 1);
    const float* tile = tiles + (it & 1) * RT * stride;
    {  // partial scores over this warp's k-steps
      // q's fragments pass through an empty asm each tile, so their splits are redone per tile
      // instead of hoisted out of the loop (kept split they would take twice their registers).
#pragma unroll
      for (int i = 0; i < KQ; ++i)
        asm volatile("" : "+f"(qa[i][0]), "+f"(qa[i][1]), "+f"(qa[i][2]), "+f"(qa[i][3]));
      float s[RT / 8][4] = {};
#pragma unroll
      for (int i = 0; i < KQ; ++i) {
        const int k0 = (warp + kLatWarps * i) * 8;
        if (k0 >= Wp) break;
        const SplitA qs(qa[i]);
#pragma unroll
        for (int j = 0; j < RT / 8; ++j) {
          const float* row = tile + (j * 8 + g) * stride + k0 + tq;
          mma_3xtf32(s[j], qs, row[0], row[4]);
        }
      }
      float* rw = red + warp * 16 * RT;
#pragma unroll
      for (int j = 0; j < RT / 8; ++j) {
        *reinterpret_cast<float2*>(rw + g * RT + j * 8 + 2 * tq) = make_float2(s[j][0], s[j][1]);
        *reinterpret_cast<float2*>(rw + (g + 8) * RT + j * 8 + 2 * tq) = make_float2(s[j][2], s[j][3]);
      }
    }
    __syncthreads();
    {  // softmax bookkeeping: thread (sh, sc) takes row sc of head sh
      float x = 0.0f;
#pragma unroll
      for (int w = 0; w < kLatWarps; ++w) x += red[(w * 16 + sh) * RT + sc];
      if (k.s0 + int64_t(it) * RT + sc >= k.s1) x = -INFINITY;
      float mx = x;
#pragma unroll
      for (int o = 1; o < 16; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m2 = fmaxf(m, mx), cf = exp2f(m - m2);  // a tile has a row below s1: m2 finite
      float p = exp2f(x - m2);
      P[sh * kPStride + sc] = p;
#pragma unroll
      for (int o = 1; o < 16; o *= 2) p += __shfl_xor_sync(0xffffffffu, p, o);
      l = l * cf + p;
      m = m2;
      if (sc == 0) corr[sh] = cf;
    }
    __syncthreads();
    {  // acc = corr · acc + P · tile[:, :R] over this warp's value n-tiles
      const float c0 = corr[g], c1 = corr[g + 8];
      if (!__all_sync(0xffffffffu, c0 == 1.0f && c1 == 1.0f))  // no head's maximum moved: nothing to rescale
#pragma unroll
        for (int i = 0; i < kLatNt; ++i) acc[i][0] *= c0, acc[i][1] *= c0, acc[i][2] *= c1, acc[i][3] *= c1;
#pragma unroll
      for (int ks = 0; ks < RT / 8; ++ks) {
        const float* pr = P + g * kPStride + ks * 8 + tq;
        const float pa[4] = {pr[0], pr[8 * kPStride], pr[4], pr[8 * kPStride + 4]};
        const SplitA ps(pa);
#pragma unroll
        for (int i = 0; i < kLatNt; ++i) {
          const int d0 = (warp + kLatWarps * i) * 8;
          if (d0 >= R) break;
          const float* col = tile + (ks * 8 + tq) * stride + d0 + g;
          mma_3xtf32(acc[i], ps, col[0], col[4 * stride]);
        }
      }
    }
  }
  if (sc == 0 && sh < k.G) {
    a.part_ml[2 * latent_slot(a, k, sh)] = m;
    a.part_ml[2 * latent_slot(a, k, sh) + 1] = l;
  }
#pragma unroll
  for (int i = 0; i < kLatNt; ++i) {
    const int d = (warp + kLatWarps * i) * 8 + 2 * tq;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = g + 8 * (e >> 1), c = d + (e & 1);
      if (h < k.G && c < R) a.part_acc[latent_slot(a, k, h) * R + c] = acc[i][e];
    }
  }
}

// NH n8 tiles of heads (the group's heads ≤ 8·NH), W ≤ 8·KQ, R ≤ 16·MT, NW warps per block; q's
// fragments split once (kPresplit) or per slab (fewer registers).
template <int NH, int KQ, int MT, int NW, bool kPresplit>
__global__ void __launch_bounds__(NW * 32, NW == 8 ? 2 : 3) latent_narrow_kernel(LatentArgs a) {
  constexpr int RT = kWideRows;
  constexpr int PS = narrow_pt_stride(NH);
  extern __shared__ __align__(16) float smem[];
  const int W = a.W, R = a.R, stride = a.stride;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  float* ring = smem + warp * 2 * RT * stride;                       // this warp's [2][RT][stride]
  float* Pt = smem + NW * 2 * RT * stride + warp * RT * PS;   // this warp's Pᵀ [RT][PS]
  const LatentBlock k = latent_block(a);
  const int nslabs = k.s0 < k.s1 ? int((k.s1 - k.s0 + RT - 1) / RT) : 0;
  // The scores read up to column 8·⌈W/8⌉ − 1, the value product up to 16·⌈R/16⌉ − 1, both below
  // the stride: the padding is zeros for the whole kernel.
  zero_padding(ring, 2 * RT, W, stride, lane, 32);
  auto load = [&](int it) {  // this warp's it-th slab (slab warp + NW·it of the chunk) into stage it & 1
    copy_rows(ring + (it & 1) * RT * stride, k.lat, k.s0 + int64_t(warp + NW * it) * RT, k.s1, RT, W, stride, k.vec,
              lane);
  };
  const int mine = nslabs > warp ? (nslabs - warp + NW - 1) / NW : 0;
  if (mine > 0) load(0);
  // qᵀ as B fragments: B[k][n] = q[head 8·nb + n][8·i + k] (scaled, zeros past G and W).
  SplitB qb[kPresplit ? KQ : 1][NH];
  float qf[kPresplit ? 1 : KQ][NH][2];
  {
    const float* q = a.qt + (k.bt * a.H + k.h0) * W;
    const float sc = a.scale * kLog2e;
#pragma unroll
    for (int nb = 0; nb < NH; ++nb) {
      const int h = 8 * nb + g;
#pragma unroll
      for (int i = 0; i < KQ; ++i) {
        const int c = 8 * i + tq;
        const float b0 = h < k.G && c < W ? q[int64_t(h) * W + c] * sc : 0.0f;
        const float b1 = h < k.G && c + 4 < W ? q[int64_t(h) * W + c + 4] * sc : 0.0f;
        if constexpr (kPresplit) {
          qb[i][nb] = SplitB(b0, b1);
        } else {
          qf[i][nb][0] = b0, qf[i][nb][1] = b1;
        }
      }
    }
  }
  // Oᵀ [d, head]: m16 tiles of d, n8 tiles of heads; softmax state of heads 8·nb + 2·tq + {0, 1}.
  float acc[MT][NH][4] = {};
  float m[NH][2], l[NH][2];
#pragma unroll
  for (int nb = 0; nb < NH; ++nb) m[nb][0] = m[nb][1] = -INFINITY, l[nb][0] = l[nb][1] = 0.0f;
  const int ksteps = (W + 7) / 8, mtiles = (R + 15) / 16;
  for (int it = 0; it < mine; ++it) {
    if (it + 1 < mine) {
      load(it + 1);
      cp_async_wait1();
    } else {
      cp_async_wait0();
    }
    __syncwarp();
    const float* tile = ring + (it & 1) * RT * stride;
    // Sᵀ [row, head] = tile · qᵀ: rows g, g + 8; heads 8·nb + 2·tq + {0, 1}. With one head tile,
    // even and odd k-steps in two accumulators (two independent product chains).
    constexpr int kChains = NH == 1 ? 2 : 1;
    float s[2][NH][4] = {};
    if constexpr (!kPresplit)  // an empty asm per slab: q's splits stay in the loop, not hoisted
#pragma unroll
      for (int i = 0; i < KQ; ++i)
#pragma unroll
        for (int nb = 0; nb < NH; ++nb) asm volatile("" : "+f"(qf[i][nb][0]), "+f"(qf[i][nb][1]));
#pragma unroll
    for (int i = 0; i < KQ; ++i) {
      if (i >= ksteps) break;
      const float* r = tile + g * stride + 8 * i + tq;
      const float av[4] = {r[0], r[8 * stride], r[4], r[8 * stride + 4]};
      const SplitA as(av);
#pragma unroll
      for (int nb = 0; nb < NH; ++nb) {
        if constexpr (kPresplit)
          mma_3xtf32(s[i % kChains][nb], as, qb[i][nb]);
        else
          mma_3xtf32(s[i % kChains][nb], as, SplitB(qf[i][nb][0], qf[i][nb][1]));
      }
    }
    const int64_t base = k.s0 + int64_t(warp + NW * it) * RT;
    const bool partial = base + RT > k.s1;  // the chunk's last slab: rows from s1 on score −∞
    const int valid = partial ? int(k.s1 - base) : RT;
    float cf[NH][2];
#pragma unroll
    for (int nb = 0; nb < NH; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[0][nb][e] += s[1][nb][e];
        if (partial && g + 8 * (e >> 1) >= valid) s[0][nb][e] = -INFINITY;
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {  // head 8·nb + 2·tq + hh: rows g, g + 8 here, the rest across g
        float mx = fmaxf(s[0][nb][hh], s[0][nb][hh + 2]);
#pragma unroll
        for (int o = 4; o < 32; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m2 = fmaxf(m[nb][hh], mx);  // a slab has a row below s1: m2 finite
        cf[nb][hh] = exp2f(m[nb][hh] - m2);
        m[nb][hh] = m2;
        s[0][nb][hh] = exp2f(s[0][nb][hh] - m2);
        s[0][nb][hh + 2] = exp2f(s[0][nb][hh + 2] - m2);
        float ps = s[0][nb][hh] + s[0][nb][hh + 2];
#pragma unroll
        for (int o = 4; o < 32; o *= 2) ps += __shfl_xor_sync(0xffffffffu, ps, o);
        l[nb][hh] = l[nb][hh] * cf[nb][hh] + ps;
      }
      // Pᵀ [row][head] into the warp's buffer, read back as the B operand of Oᵀ += tileᵀ · Pᵀ.
      *reinterpret_cast<float2*>(Pt + g * PS + 8 * nb + 2 * tq) = make_float2(s[0][nb][0], s[0][nb][1]);
      *reinterpret_cast<float2*>(Pt + (g + 8) * PS + 8 * nb + 2 * tq) = make_float2(s[0][nb][2], s[0][nb][3]);
    }
    bool moved = false;
#pragma unroll
    for (int nb = 0; nb < NH; ++nb) moved |= cf[nb][0] != 1.0f || cf[nb][1] != 1.0f;
    if (__any_sync(0xffffffffu, moved))  // else no head's maximum moved: nothing to rescale
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < NH; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nb][e] *= cf[nb][e & 1];
    __syncwarp();
#pragma unroll
    for (int ks = 0; ks < RT / 8; ++ks) {
      SplitB pb[NH];
#pragma unroll
      for (int nb = 0; nb < NH; ++nb)
        pb[nb] = SplitB(Pt[(8 * ks + tq) * PS + 8 * nb + g], Pt[(8 * ks + tq + 4) * PS + 8 * nb + g]);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt >= mtiles) break;
        const float* c = tile + (8 * ks + tq) * stride + 16 * mt + g;  // A[d][row] = tile[row][d]
        const float av[4] = {c[0], c[8], c[4 * stride], c[4 * stride + 8]};
        const SplitA as(av);
#pragma unroll
        for (int nb = 0; nb < NH; ++nb) mma_3xtf32(acc[mt][nb], as, pb[nb]);
      }
    }
    __syncwarp();  // the stage and Pᵀ are free for the next slab
  }
  // Merge the warps' (m, l, acc): [warp][16] m and l, then [warp][16][R] acc over the rings.
  __syncthreads();
  float* wm = smem;
  float* wl = wm + NW * 16;
  float* wacc = wl + NW * 16;
#pragma unroll
  for (int nb = 0; nb < NH; ++nb)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int h = 8 * nb + 2 * tq + hh;
      if (g == 0) wm[warp * 16 + h] = m[nb][hh], wl[warp * 16 + h] = l[nb][hh];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int d = 16 * mt + g + 8 * half;
          if (d < R) wacc[(warp * 16 + h) * R + d] = acc[mt][nb][2 * half + hh];
        }
    }
  __syncthreads();
  for (int i = threadIdx.x; i < k.G * (R + 1); i += blockDim.x) {
    const int h = i / (R + 1), c = i % (R + 1) - 1;  // c = −1: the head's (m, l)
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, wm[w * 16 + h]);
    float x = 0.0f;
    if (M != -INFINITY)
#pragma unroll
      for (int w = 0; w < NW; ++w) x += exp2f(wm[w * 16 + h] - M) * (c < 0 ? wl[w * 16 + h] : wacc[(w * 16 + h) * R + c]);
    if (c < 0) {
      a.part_ml[2 * latent_slot(a, k, h)] = M;
      a.part_ml[2 * latent_slot(a, k, h) + 1] = x;
    } else {
      a.part_acc[latent_slot(a, k, h) * R + c] = x;
    }
  }
}

// One block per (row bt, head h): ob = Σ_split 2^(m_i − M) acc_i / Σ_split 2^(m_i − M) l_i (m in
// log₂ units). The weights are computed once per split into shared memory (splits ≤ kMaxSplits).
constexpr int kMaxSplits = 1024, kCombineThreads = 256;
__global__ void __launch_bounds__(kCombineThreads) latent_combine_kernel(const float* part_ml, const float* part_acc,
                                                                        int64_t H, int64_t R, int splits, float* ob) {
  __shared__ float wts[kMaxSplits], scratch[32];
  const int64_t bt = blockIdx.x / H, h = blockIdx.x % H;
  auto at = [&](int i) { return (bt * splits + i) * H + h; };
  float M = -INFINITY;
  for (int i = threadIdx.x; i < splits; i += blockDim.x) M = fmaxf(M, part_ml[2 * at(i)]);
  M = warp_max(M);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = M;
  __syncthreads();
  M = -INFINITY;
  for (int w = 0; w < int(blockDim.x >> 5); ++w) M = fmaxf(M, scratch[w]);
  float L = 0.0f;
  for (int i = threadIdx.x; i < splits; i += blockDim.x) {
    const float mi = part_ml[2 * at(i)], w = mi == -INFINITY ? 0.0f : exp2f(mi - M);
    wts[i] = w;
    L += w * part_ml[2 * at(i) + 1];
  }
  L = block_sum(L, scratch);  // its barriers also publish wts
  for (int64_t c = threadIdx.x; c < R; c += blockDim.x) {
    float o = 0.0f;
    for (int i = 0; i < splits; ++i)
      if (wts[i] != 0.0f) o += wts[i] * part_acc[at(i) * R + c];
    ob[(bt * H + h) * R + c] = o / L;
  }
}

// dst[b·n + i] = src[b][i] (gather), or the reverse (scatter), over B blocks of n floats.
__global__ void blocks_kernel(const float* const* srcs, const float* src, float* const* dsts, float* dst, int64_t n,
                              int64_t total) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t b = i / n, k = i % n;
  if (srcs)
    dst[i] = srcs[b][k];
  else
    dsts[b][k] = src[i];
}

}  // namespace

void gather_blocks(const float* const* srcs, int64_t B, int64_t n, float* dst) {
  if (!B || !n) return;
  blocks_kernel<<<blocks_for(B * n, kThreads), kThreads, 0, device::stream()>>>(srcs, nullptr, nullptr, dst, n, B * n);
  K3_CUDA_LAUNCHED();
}

void scatter_blocks(const float* src, int64_t B, int64_t n, float* const* dsts) {
  if (!B || !n) return;
  blocks_kernel<<<blocks_for(B * n, kThreads), kThreads, 0, device::stream()>>>(nullptr, src, dsts, nullptr, n, B * n);
  K3_CUDA_LAUNCHED();
}

void conv_with_tails(const float* x, const float* w, float* const* tails, int64_t B, int64_t T, int64_t C, int64_t W,
                     float* y) {
  if (!B || !T || !C) return;
  if (W - 1 > kMaxConv) throw error("short_conv", "conv size ", W, " exceeds the CUDA kernel's ", kMaxConv + 1);
  const int64_t n = B * T * C, m = B * C;
  conv_tail_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(x, w, tails, T, C, W, n, y);
  K3_CUDA_LAUNCHED();
  if (W <= 1) return;
  tail_update_kernel<<<blocks_for(m, kThreads), kThreads, 0, device::stream()>>>(x, tails, T, C, W, m);
  K3_CUDA_LAUNCHED();
}

// The narrow instantiations: up to 8 or 16 heads at W, R ≤ 64; up to 8 heads at W, R ≤ 128.
constexpr auto kNarrow1 = latent_narrow_kernel<1, kNarrow / 8, kNarrow / 16, kLatWarps, true>;
constexpr auto kNarrow2 = latent_narrow_kernel<2, kNarrow / 8, kNarrow / 16, kLatWarps, true>;
constexpr auto kNarrow3 = latent_narrow_kernel<1, kNarrow / 4, kNarrow / 8, 4, false>;

void latent_attention(const float* qt, const float* const* lats, const int64_t* p0s, int64_t longest, float* ob,
                      int64_t B, int64_t T, int64_t H, int64_t W, int64_t R, float scale) {
  if (R > kMaxRank) throw error("mla", "kv_lora_rank ", R, " exceeds the CUDA decode kernel's ", kMaxRank);
  if (W > kMaxLatentWidth || W < R)
    throw error("mla", "latent width ", W, " (kv_lora_rank ", R, " + rope) must lie between the rank and the CUDA ",
                "decode kernel's ", kMaxLatentWidth);
  if (!B || !T || !H) return;
  // Narrow kernels: W, R ≤ 64 (any group), or ≤ 128 with at most 8 heads per group (k3-small's
  // 96 + 32 with 6 heads); the rest wide.
  const int64_t G0 = std::min<int64_t>(H, kHeadsPerBlock);
  const int narrow = W <= kNarrow && R <= kNarrow ? (G0 <= 8 ? 1 : 2) : W <= 2 * kNarrow && R <= 2 * kNarrow && G0 <= 8 ? 3 : 0;
  const int warps = narrow == 3 ? 4 : kLatWarps;
  constexpr int RT = kWideRows;
  // About four waves of resident blocks (two per SM) over all (sequence, token, head group) rows,
  // so the last wave's idle SMs cost little; chunks of whole tiles, at least 64 latent rows (256
  // narrow ones, whose partial results weigh more against their rows), at most kMaxSplits.
  const int64_t rows = B * T, groups = (H + kHeadsPerBlock - 1) / kHeadsPerBlock, target = 8 * device::sm_count();
  const int64_t min_chunk = narrow ? 256 : 64;
  int splits = int(std::max<int64_t>(1, std::min<int64_t>({(target + rows * groups - 1) / (rows * groups),
                                                           (longest + min_chunk - 1) / min_chunk, int64_t(kMaxSplits)})));
  int64_t chunk = (longest + splits - 1) / splits;
  chunk = (chunk + RT - 1) / RT * RT;
  splits = int((longest + chunk - 1) / chunk);
  device::Buffer ml(size_t(rows * splits * H * 2) * 4), acc(size_t(rows * splits * H * R) * 4);
  LatentArgs a{};
  a.qt = qt, a.lats = lats, a.p0s = p0s, a.T = T, a.H = H, a.chunk = chunk;
  a.W = int(W), a.R = int(R), a.splits = splits, a.groups = int(groups), a.scale = scale;
  // Rows hold every column a kernel reads: Wp (the scores' k-steps) and, narrow, whole m16 tiles of
  // R (the value product's A rows past R are read, their results dropped); ≡ 8 (mod 32).
  const int span = std::max(int((W + 7) / 8 * 8), narrow ? int((R + 15) / 16 * 16) : 0);
  a.stride = span + ((8 - span) % 32 + 32) % 32;
  a.w4 = W % 4 == 0;
  a.part_ml = ml.as<float>(), a.part_acc = acc.as<float>();
  const size_t smem = narrow ? size_t(warps * (2 * RT * a.stride + RT * narrow_pt_stride(narrow == 2 ? 2 : 1))) * 4
                             : size_t(2 * RT * a.stride + kLatWarps * 16 * RT + 16 * kPStride + 16) * 4;
  static const bool opted = [] {
    for (auto* f : {kNarrow1, kNarrow2, kNarrow3, latent_wide_kernel<kMaxLatentWidth / 64>})
      K3_CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    return true;
  }();
  (void)opted;
  const int64_t blocks = rows * splits * groups;
  if (blocks > INT32_MAX || rows * H > INT32_MAX)
    throw error("mla", "latent attention over ", blocks, " blocks (", rows * H, " rows × heads) exceeds the grid");
  auto* kernel = narrow == 1 ? kNarrow1 : narrow == 2 ? kNarrow2 : narrow == 3 ? kNarrow3
               : latent_wide_kernel<kMaxLatentWidth / 64>;
  kernel<<<unsigned(blocks), unsigned(warps * 32), smem, device::stream()>>>(a);
  K3_CUDA_LAUNCHED();
  latent_combine_kernel<<<unsigned(rows * H), kCombineThreads, 0, device::stream()>>>(ml.as<float>(), acc.as<float>(), H, R,
                                                                          splits, ob);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
