// MLA's decode on the device (mixers_cuda.h, cuda::latent_attention and cuda::append_rows):
// absorbed attention of B sequences' new queries over their latent caches (fp32 or bf16 rows) in
// flash-decoding splits, by the kernel that suits the latent's shape, and the append of the new
// latent rows. The kernels and how one is chosen are described below.
// One file of about 1,300 lines: the seven kernels share the argument block, the fragment and
// ring helpers and the softmax bookkeeping (all device-inline, in an unnamed namespace), and
// latent_attention's choice among them reads every kernel's tile sizes and shared-memory layout.
#include <algorithm>
#include <cmath>

#include "core/cuda_util.cuh"
#include "mixers/mixers_cuda.h"

namespace k3::cuda {
namespace {

using namespace device;

constexpr int kThreads = 256;

// Absorbed MLA attention over B sequences' latent caches, split over the rows (flash-decoding),
// on the tensor cores. A block per (b·T + t, split, head group) walks its chunk of the rows token
// t of sequence b sees. The heads of a group (≤ 16) are the products' M rows, so a latent row is
// read from memory once per group, not once per head. Products are 3xTF32 (x = hi + lo, hi·hi +
// hi·lo + lo·hi; hi = x truncated to TF32, lo = the rest, truncated): fp32 accuracy, which the
// decode's agreement with the full forward needs. Row strides ≡ 8 (mod 32) floats keep both
// products' fragment loads free of bank conflicts; columns past W and rows past the chunk are
// zeros. Partial (m, l, acc) per split go to scratch; latent_combine_kernel merges them (the
// warpgroup kernel with one split per row writes ob itself).
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
  const void* const* lats;  // fp32 or bf16 rows, as the kernel reads them
  const int64_t* p0s;
  int64_t T, H, chunk;
  int W, R, stride, splits, groups;  // stride in elements of the cache's type
  bool vec;  // rows of whole 16-byte pieces: a 16-byte aligned cache is copied 16 bytes at a time
  float scale;
  float* part_ml;
  float* part_acc;
  float* ob;  // set (one split, warpgroup kernel): ob = acc / l written by the kernel, no partials
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
// warp (`lane`); 16-byte copies when `vec` (else plain loads and stores). A row of wv ≤ 16 pieces
// takes 32 / wv rows per pass, so no lane idles on narrow latents. T: float or bf16 (uint16_t).
template <typename T>
__device__ __forceinline__ void copy_rows(T* dst, const T* lat, int64_t base, int64_t s1, int rows, int W, int stride,
                                          bool vec, int lane) {
  if (vec) {
    constexpr int E = 16 / sizeof(T);  // elements per piece
    const int wv = W / E, per = wv <= 16 ? 32 / wv : 1;  // rows per pass
    const int r0 = wv <= 16 ? lane / wv : 0, c0 = wv <= 16 ? lane % wv : lane;
    if (r0 < per)
      for (int r = r0; r < rows; r += per) {
        const bool valid = base + r < s1;
        const T* src = lat + (valid ? (base + r) * W : 0);
        for (int c = c0; c < wv; c += 32) cp_async16_zfill(dst + r * stride + E * c, src + E * c, valid);
      }
  } else {
    for (int r = 0; r < rows; ++r)
      for (int c = lane; c < W; c += 32) dst[r * stride + c] = base + r < s1 ? lat[(base + r) * W + c] : T(0);
  }
  cp_async_commit();
}

// Zeros columns W … stride − 1 of `rows` rows `stride` apart (the padding products read and copies
// never reach), by `n` threads from `tid`.
template <typename T>
__device__ __forceinline__ void zero_padding(T* rows_at, int rows, int W, int stride, int tid, int n) {
  const int pad = stride - W;
  for (int i = tid; i < rows * pad; i += n) rows_at[i / pad * stride + W + i % pad] = T(0);
}

// Pᵀ's row stride in the narrow kernels with NH head tiles: conflict-free B loads (8t + g, 24t + g).
constexpr int narrow_pt_stride(int NH) { return NH == 1 ? 8 : 24; }
// The same for the bf16 narrow kernel, whose B fragments read rows 2t, 2t + 1 (24t + g).
constexpr int kPtStride16 = 12;

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
  const void* lat;
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
  k.vec = a.vec && (reinterpret_cast<uintptr_t>(k.lat) & 15) == 0;
  return k;
}
__device__ __forceinline__ int64_t latent_slot(const LatentArgs& a, const LatentBlock& k, int h) {
  return (k.bt * a.splits + k.split) * a.H + k.h0 + h;
}

// The wide kernels' softmax bookkeeping of a tile of RT rows from row0: thread (sh, sc) = (tid /
// 16, tid % 16) adds the warps' partial scores of rows sc, sc + 16, … of head sh (−∞ from s1 on),
// updates the head's (m, l), kept alike by its 16 threads, and writes p to P (row stride PS) and
// the head's rescale to corr.
template <int RT, int PS>
__device__ __forceinline__ void wide_softmax(const float* red, float* P, float* corr, int64_t row0, int64_t s1, float& m,
                                             float& l) {
  const int sh = threadIdx.x >> 4, sc = threadIdx.x & 15;
  float x[RT / 16], mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < RT / 16; ++j) {
    x[j] = 0.0f;
#pragma unroll
    for (int w = 0; w < kLatWarps; ++w) x[j] += red[(w * 16 + sh) * RT + sc + 16 * j];
    if (row0 + sc + 16 * j >= s1) x[j] = -INFINITY;
    mx = fmaxf(mx, x[j]);
  }
#pragma unroll
  for (int o = 1; o < 16; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  const float m2 = fmaxf(m, mx), cf = exp2f(m - m2);  // a tile has a row below s1: m2 finite
  float p = 0.0f;
#pragma unroll
  for (int j = 0; j < RT / 16; ++j) {
    const float e = exp2f(x[j] - m2);
    P[sh * PS + sc + 16 * j] = e;
    p += e;
  }
#pragma unroll
  for (int o = 1; o < 16; o *= 2) p += __shfl_xor_sync(0xffffffffu, p, o);
  l = l * cf + p;
  m = m2;
  if (sc == 0) corr[sh] = cf;
}

// The wide kernels' partial scores of this warp into its [16 heads][RT rows] of red.
template <int RT>
__device__ __forceinline__ void store_scores(float* red, const float (&s)[RT / 8][4], int warp, int g, int tq) {
  float* rw = red + warp * 16 * RT;
#pragma unroll
  for (int j = 0; j < RT / 8; ++j) {
    *reinterpret_cast<float2*>(rw + g * RT + j * 8 + 2 * tq) = make_float2(s[j][0], s[j][1]);
    *reinterpret_cast<float2*>(rw + (g + 8) * RT + j * 8 + 2 * tq) = make_float2(s[j][2], s[j][3]);
  }
}

// The wide kernels' (m, l) per head and acc [16 heads, R] (n-tile i of 8 columns at column d0(i)).
template <int NT, typename D0>
__device__ __forceinline__ void wide_store(const LatentArgs& a, const LatentBlock& k, const float (&acc)[NT][4], float m,
                                           float l, D0 d0, int g, int tq) {
  const int sh = threadIdx.x >> 4, sc = threadIdx.x & 15;
  if (sc == 0 && sh < k.G) {
    a.part_ml[2 * latent_slot(a, k, sh)] = m;
    a.part_ml[2 * latent_slot(a, k, sh) + 1] = l;
  }
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int d = d0(i) + 2 * tq;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = g + 8 * (e >> 1), c = d + (e & 1);
      if (h < k.G && c < a.R) a.part_acc[latent_slot(a, k, h) * a.R + c] = acc[i][e];
    }
  }
}

// acc = corr · acc, skipped when no head's maximum moved (rows g and g + 8 of the C fragments).
template <int NT>
__device__ __forceinline__ void wide_rescale(float (&acc)[NT][4], const float* corr, int g) {
  const float c0 = corr[g], c1 = corr[g + 8];
  if (!__all_sync(0xffffffffu, c0 == 1.0f && c1 == 1.0f))
#pragma unroll
    for (int i = 0; i < NT; ++i) acc[i][0] *= c0, acc[i][1] *= c0, acc[i][2] *= c1, acc[i][3] *= c1;
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
  const float* lat = static_cast<const float*>(k.lat);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int ntiles = k.s0 < k.s1 ? int((k.s1 - k.s0 + RT - 1) / RT) : 0;
  const int Wp = (W + 7) / 8 * 8;

  zero_padding(tiles, 2 * RT, W, stride, threadIdx.x, blockDim.x);  // both stages, for the whole kernel
  auto load = [&](int it) {  // tile it into stage it & 1: a warp's lanes per row, two rows per warp
    copy_rows(tiles + (it & 1) * RT * stride + 2 * warp * stride, lat, k.s0 + int64_t(it) * RT + 2 * warp, k.s1, 2, W,
              stride, k.vec, lane);
  };
  static_assert(RT == 2 * kLatWarps, "two rows per warp");
  if (ntiles > 0) load(0);
  float qa[KQ][4];
  q_fragments(qa, a.qt + (k.bt * a.H + k.h0) * W, k.G, W, a.scale * kLog2e, warp, kLatWarps, g, tq);
  float acc[kLatNt][4];
#pragma unroll
  for (int i = 0; i < kLatNt; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float m = -INFINITY, l = 0.0f;  // head threadIdx.x / 16's

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
      store_scores<RT>(red, s, warp, g, tq);
    }
    __syncthreads();
    wide_softmax<RT, kPStride>(red, P, corr, k.s0 + int64_t(it) * RT, k.s1, m, l);
    __syncthreads();
    {  // acc = corr · acc + P · tile[:, :R] over this warp's value n-tiles
      wide_rescale(acc, corr, g);
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
  wide_store(a, k, acc, m, l, [&](int i) { return (warp + kLatWarps * i) * 8; }, g, tq);
}

// x0, x1 as bf16 pairs hi + lo (x = hi + lo to about 2^-16 |x|; the lower-indexed in the low half).
__device__ __forceinline__ void split_bf16x2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 r = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&r);
}
// mma_bf16 without `volatile` (see mma_tf32_free).
__device__ __forceinline__ void mma_bf16_free(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// q[h][c], q[h][c + 1] scaled (zeros past the group's G heads and past W) as a bf16 pair hi + lo.
__device__ __forceinline__ void q_pair(const float* q, int h, int c, int G, int W, float scale, uint32_t& hi,
                                       uint32_t& lo) {
  const float x0 = h < G && c < W ? q[int64_t(h) * W + c] * scale : 0.0f;
  const float x1 = h < G && c + 1 < W ? q[int64_t(h) * W + c + 1] * scale : 0.0f;
  split_bf16x2(x0, x1, hi, lo);
}

// The wide kernel over a bf16 cache: the same blocks and softmax over tiles of 32 rows (half the
// barriers per byte; four independent score chains), and plain bf16 products of the cache (exact)
// with q and P as bf16 pairs hi + lo (two products each): the decode's error is the cache's
// rounding alone. Fragments of the tile come by ldmatrix: rows as the scores' B, transposed as
// P·C's B; the warps split W in k16-steps and R in pairs of n-tiles.
constexpr int kWide16Rows = 32, kP16Stride = kWide16Rows + 4;
template <int KQ>  // score k16-steps per warp (W ≤ 128·KQ)
__global__ void __launch_bounds__(kLatWarps * 32, 2) latent_wide16_kernel(LatentArgs a) {
  constexpr int RT = kWide16Rows, PS = kP16Stride;
  extern __shared__ __align__(16) float smem[];
  const int W = a.W, R = a.R, stride = a.stride;       // stride: bf16 elements, ≡ 8 (mod 64)
  uint16_t* tiles = reinterpret_cast<uint16_t*>(smem);  // [2][RT][stride]
  float* red = smem + RT * stride;                      // [warp][16][RT]
  float* P = red + kLatWarps * 16 * RT;                 // [16][PS]
  float* corr = P + 16 * PS;                            // [16]
  const LatentBlock k = latent_block(a);
  const uint16_t* lat = static_cast<const uint16_t*>(k.lat);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int mi = lane >> 3, mr = lane & 7;  // the matrix and row this lane addresses in ldmatrix
  const int ntiles = k.s0 < k.s1 ? int((k.s1 - k.s0 + RT - 1) / RT) : 0;
  constexpr int kRowsPerWarp = RT / kLatWarps;
  static_assert(RT == 32, "a bulk copy per row, by warp 0's lanes");
  __shared__ uint64_t full[2];  // the stages' barriers (16-byte rows: bulk copies)

  // Rows of whole 16-byte pieces come by bulk copies, one per row by warp 0's lanes; rows past the
  // chunk's end keep an earlier tile's (finite) rows, their scores −∞, so both stages start as
  // zeros. Other rows by cp.async (zeros past the end).
  if (k.vec) {
    for (int i = threadIdx.x; i < RT * stride; i += blockDim.x) reinterpret_cast<uint32_t*>(tiles)[i] = 0u;
    if (threadIdx.x == 0) mbar_init(&full[0], 1), mbar_init(&full[1], 1), fence_mbar_init();
    fence_proxy_async();
  } else {
    zero_padding(tiles, 2 * RT, W, stride, threadIdx.x, blockDim.x);
  }
  __syncthreads();
  auto load = [&](int it) {  // tile it into stage it & 1
    uint16_t* dst = tiles + (it & 1) * RT * stride;
    const int64_t r0 = k.s0 + int64_t(it) * RT;
    if (k.vec) {
      if (warp == 0) {
        const int n = int(min(int64_t(RT), k.s1 - r0));
        if (lane == 0) mbar_arrive_expect_tx(&full[it & 1], unsigned(n * W * 2));
        __syncwarp();
        if (lane < n) bulk_copy_g2s(dst + lane * stride, lat + (r0 + lane) * W, unsigned(W * 2), &full[it & 1]);
      }
    } else {
      copy_rows(dst + kRowsPerWarp * warp * stride, lat, r0 + kRowsPerWarp * warp, k.s1, kRowsPerWarp, W, stride,
                false, lane);
    }
  };
  if (ntiles > 0) load(0);
  // q's A fragments for k16-steps warp + 8·i, as bf16 pairs hi + lo (zeros past G and W), scaled.
  uint32_t qh[KQ][4], ql[KQ][4];
#pragma unroll
  for (int i = 0; i < KQ; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      q_pair(a.qt + (k.bt * a.H + k.h0) * W, g + 8 * (e & 1), (warp + kLatWarps * i) * 16 + 2 * tq + 8 * (e >> 1), k.G,
             W, a.scale * kLog2e, qh[i][e], ql[i][e]);
  float acc[kLatNt][4];
#pragma unroll
  for (int i = 0; i < kLatNt; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float m = -INFINITY, l = 0.0f;

  for (int it = 0; it < ntiles; ++it) {
    if (k.vec)
      mbar_wait(&full[it & 1], unsigned(it >> 1) & 1u);
    else
      cp_async_wait0();
    __syncthreads();  // tile it visible; every warp is past tile it − 1's products
    if (it + 1 < ntiles) load(it + 1);
    const uint16_t* tile = tiles + (it & 1) * RT * stride;
    {  // partial scores: B [k = column][n = row] is the tile's rows, 16 rows (two n-tiles) per ldmatrix
      float s[RT / 8][4] = {};
#pragma unroll
      for (int i = 0; i < KQ; ++i) {
        const int k0 = (warp + kLatWarps * i) * 16;
        if (k0 >= W) break;
#pragma unroll
        for (int half = 0; half < RT / 16; ++half) {
          uint32_t b[4];
          ldmatrix_x4(b, tile + (16 * half + mr + 8 * (mi >> 1)) * stride + k0 + 8 * (mi & 1));
          mma_bf16_free(s[2 * half], ql[i], b[0], b[1]);
          mma_bf16_free(s[2 * half], qh[i], b[0], b[1]);
          mma_bf16_free(s[2 * half + 1], ql[i], b[2], b[3]);
          mma_bf16_free(s[2 * half + 1], qh[i], b[2], b[3]);
        }
      }
      store_scores<RT>(red, s, warp, g, tq);
    }
    __syncthreads();
    wide_softmax<RT, PS>(red, P, corr, k.s0 + int64_t(it) * RT, k.s1, m, l);
    __syncthreads();
    {  // acc = corr · acc + P · tile[:, :R]: B [k = row][n = column] by ldmatrix .trans, 16 columns each
      wide_rescale(acc, corr, g);
#pragma unroll
      for (int ks = 0; ks < RT / 16; ++ks) {
        uint32_t ph[4], pl[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 v =
              *reinterpret_cast<const float2*>(P + (g + 8 * (e & 1)) * PS + 16 * ks + 2 * tq + 8 * (e >> 1));
          split_bf16x2(v.x, v.y, ph[e], pl[e]);
        }
#pragma unroll
        for (int i = 0; i < kLatNt / 2; ++i) {
          const int d0 = (warp + kLatWarps * i) * 16;
          if (d0 >= R) break;
          uint32_t b[4];
          ldmatrix_x4_trans(b, tile + (16 * ks + mr + 8 * (mi & 1)) * stride + d0 + 8 * (mi >> 1));
          mma_bf16_free(acc[2 * i], pl, b[0], b[1]);
          mma_bf16_free(acc[2 * i], ph, b[0], b[1]);
          mma_bf16_free(acc[2 * i + 1], pl, b[2], b[3]);
          mma_bf16_free(acc[2 * i + 1], ph, b[2], b[3]);
        }
      }
    }
  }
  wide_store(a, k, acc, m, l, [&](int i) { return (warp + kLatWarps * (i / 2)) * 16 + 8 * (i % 2); }, g, tq);
}

// DeepSeek/K3's latent (512 + 64) over a bf16 cache on Hopper's warpgroup MMA (sm_90a): a block
// is one warpgroup over tiles of 64 rows, transposed so that the rows fill the products' M and
// the heads their N (16 heads as q's bf16 hi and lo: 32 columns, the two halves summed per head):
//   Sᵀ [64 rows, 32] = tile [64, W] · [q_hi q_lo]ᵀ (both K-major in shared memory; the k-steps
//     alternate between two accumulators, so that each product need not wait for the last);
//   Oᵀ [R, 32] += tileᵀ [R, 64 rows] · [P_hi P_lo]ᵀ (the tile read transposed: its 8 panels are
//     the products' M, their chains interleaved; P's bf16 pairs written to shared memory by the
//     softmax).
// So the cache is read exactly, q and P to about 2^-16, as the mma.sync kernels do. Tiles stream
// through a two-stage cp.async ring in the 128-byte swizzle the descriptors name (73.7 KB a
// stage; one block per SM): tile it + 1 loads while tile it is scored, weighed and summed. With
// four warps per SM every instruction's latency shows, so the loop keeps few: copies at constant
// offsets, descriptors as a low word plus constants, and no exchange of maxima between the warps
// while no score exceeds its head's reference by more than kWgLatSlack.
constexpr int kWgLatRows = 64;                         // rows per tile: the scores' M
constexpr int kWgLatThreads = 128;                     // one warpgroup
constexpr int kWgLatRankPanels = kMaxRank / 64;        // R = 512
constexpr int kWgLatWidth = 576;                       // W: 512 + 64
constexpr float kWgLatSlack = 8.0f;                    // log₂ units: p ≤ 256 between moves of m

// d (+)= A B, m64n32k16, A and B in shared memory (B K-major); TA: A is MN-major (transposed).
template <int TA>
__device__ __forceinline__ void wgmma_m64n32(float (&d)[16], uint64_t da, uint64_t db, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db), "r"(accumulate), "n"(TA));
#else
  __trap();  // built for sm_90a only (CMAKE_CUDA_ARCHITECTURES 90a)
#endif
}

// Shared memory of latent_wgmma_kernel for W columns (1024 bytes of slack align the panels).
constexpr size_t wgmma_latent_smem(int64_t W) {
  return size_t(2 * kWgLatRows + 32) * W * 2 + 2 * 32 * 64 * 2 + 2 * 4 * 16 * 4 + 1024;
}

template <int NP>  // W = 64·NP; R = kMaxRank
__global__ void __launch_bounds__(kWgLatThreads, 1) latent_wgmma_kernel(LatentArgs a) {
  constexpr int RT = kWgLatRows, W = 64 * NP, R = kMaxRank, PE = RT * 64;  // PE: a panel's elements
  extern __shared__ __align__(16) float smem[];
  const uint32_t raw = smem_u32(smem);
  uint16_t* ring = reinterpret_cast<uint16_t*>(reinterpret_cast<char*>(smem) + ((1024 - (raw & 1023)) & 1023));
  uint16_t* sq = ring + 2 * NP * PE;        // [NP panels][32][64]: q_hi (rows 0–15), q_lo (16–31)
  uint16_t* sp = sq + NP * 32 * 64;         // [2][32][64]: Pᵀ K-major, [hi/lo head][row]
  float* red = reinterpret_cast<float*>(sp + 2 * 32 * 64);  // [2][4 warps][16 heads]
  const LatentBlock k = latent_block(a);
  const uint16_t* lat = static_cast<const uint16_t*>(k.lat);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int ntiles = k.s0 < k.s1 ? int((k.s1 - k.s0 + RT - 1) / RT) : 0;
  // This thread's heads (score columns 8j + 2tq + c of the hi half; +16 in the lo half) and rows
  // (16·warp + g + 8·r of a tile).
  float o[kWgLatRankPanels][16];
#pragma unroll
  for (int p = 0; p < kWgLatRankPanels; ++p)
#pragma unroll
    for (int i = 0; i < 16; ++i) o[p][i] = 0.0f;
  float m[2][2], l[2][2], corr[2][2];
#pragma unroll
  for (int j = 0; j < 2; ++j) m[j][0] = m[j][1] = -INFINITY, l[j][0] = l[j][1] = 0.0f;

  // Tile it goes to stage it & 1 of a two-tile ring, panel by panel (its rows' columns 64p to
  // 64p + 63), one cp.async group per panel (empty past the chunk's end), so that every tile is
  // NP groups and "tile it landed" is "at most NP groups pending". This thread's 16-byte pieces
  // of a panel are piece tid & 7 of rows (tid >> 3) + 16i: the 128-byte swizzle's XOR is the
  // same for all four, and a full tile's 36 copies per thread differ by constant offsets alone.
  // (A ring of 22 panels, 4 of tile it + 2 in flight beside tile it + 1, measured no faster: the
  // loop is bound by its own latency, not the loads'.)
  const int lr = threadIdx.x >> 3, lc = threadIdx.x & 7, dst_t = lr * 64 + ((lc ^ (lr & 7)) << 3);
  auto load = [&](int it) {
    uint16_t* dst = ring + (it & 1) * NP * PE + dst_t;
    const int64_t r0 = k.s0 + int64_t(it) * RT;
    if (it < ntiles && k.vec && r0 + RT <= k.s1) {
      const uint16_t* src = lat + (r0 + lr) * W + lc * 8;
#pragma unroll
      for (int p = 0; p < NP; ++p) {
#pragma unroll
        for (int i = 0; i < RT / 16; ++i) cp_async16(dst + p * PE + i * 16 * 64, src + i * 16 * W + p * 64);
        cp_async_commit();
      }
    } else {  // the chunk's last tile (rows from s1 on are zeros), rows not 16-byte aligned, or none
      for (int p = 0; p < NP; ++p) {
        for (int i = 0; i < RT / 16 && it < ntiles; ++i) {
          const bool valid = r0 + lr + 16 * i < k.s1;
          const uint16_t* src = lat + (valid ? (r0 + lr + 16 * i) * W : 0) + p * 64 + lc * 8;
          if (k.vec) {
            cp_async16_zfill(dst + p * PE + i * 16 * 64, src, valid);
          } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) dst[p * PE + i * 16 * 64 + e] = valid ? src[e] : uint16_t(0);
          }
        }
        cp_async_commit();
      }
    }
  };
  // Slot of tile it's panel p in the ring.
  auto slot = [&](int it, int p) { return (it & 1) * NP + p; };
  // Sᵀ of tile it as two chains of products (even and odd k-steps), so that each product need
  // not wait for the one before; s = their sum, hi and lo halves in columns 0–15 and 16–31.
  float s[16], s2[16];
  // Descriptors' low words (smem_desc_at adds constant offsets): the ring's panels K-major
  // (scores) and MN-major (values), q, P.
  constexpr uint32_t kSlot = PE * 2 >> 4;  // a slot in descriptor units (16 bytes)
  const uint32_t d_ring = smem_desc_lo(ring, 16), d_ring_t = smem_desc_lo(ring, RT * 128);
  const uint32_t d_q = smem_desc_lo(sq, 16), d_p = smem_desc_lo(sp, 16);
  auto issue_scores = [&](int it) {
    pin(s);
    pin(s2);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4 * NP; ++kk) {
      const int p = kk >> 2, off = (kk & 3) * 16;
      wgmma_m64n32<0>(kk & 1 ? s2 : s, smem_desc_at(d_ring + slot(it, p) * kSlot, off * 2),
                      smem_desc_at(d_q, (p * 32 * 64 + off) * 2), kk > 1);
    }
    wg_commit();
  };
  auto sum_scores = [&] {  // after the products are waited for
    pin(s);
    pin(s2);
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] += s2[i];
  };
  // Online softmax of tile it's scores: masks rows from s1 on, writes P's bf16 pairs to sp[(it &
  // 1)] and sets corr. Each head's reference m moves only when a row's score exceeds it by more
  // than kWgLatSlack: then to the running maximum (the warps' maxima meet in red), and o and l
  // are rescaled by corr. Otherwise the tile needs neither the exchange nor the rescale, and p =
  // 2^(x − m) ≤ 2^kWgLatSlack: l and o stay relative to m, which may lie up to kWgLatSlack below
  // the split's maximum; the combine step needs only a common reference per split.
  auto softmax = [&](int it) {
    const int64_t row0 = k.s0 + int64_t(it) * RT + 16 * warp + g;
    float x[2][4], mx[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        x[j][e] = s[4 * j + e] + s[4 * (j + 2) + e];
        if (row0 + 8 * (e >> 1) >= k.s1) x[j][e] = -INFINITY;
      }
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float v = fmaxf(x[j][c], x[j][c + 2]);
#pragma unroll
        for (int o2 = 4; o2 < 32; o2 *= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o2));
        mx[j][c] = v;
      }
    }
    float* rb = red + (it & 1) * 64;
    bool over = false;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      over |= mx[j][0] > m[j][0] + kWgLatSlack || mx[j][1] > m[j][1] + kWgLatSlack;
      if (g == 0) rb[warp * 16 + 8 * j + 2 * tq] = mx[j][0], rb[warp * 16 + 8 * j + 2 * tq + 1] = mx[j][1];
    }
    if (__syncthreads_or(over)) {  // some row exceeds its head's m by more than the slack: m moves
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int h = 8 * j + 2 * tq + c;
          float v = rb[h];
#pragma unroll
          for (int w = 1; w < 4; ++w) v = fmaxf(v, rb[w * 16 + h]);
          const float m2 = fmaxf(m[j][c], v);  // a tile has a row below s1: m2 finite
          corr[j][c] = exp2f(m[j][c] - m2);
          m[j][c] = m2;
        }
    } else {
#pragma unroll
      for (int j = 0; j < 2; ++j) corr[j][0] = corr[j][1] = 1.0f;
    }
    uint16_t* pb = sp + (it & 1) * 32 * 64;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int h = 8 * j + 2 * tq + c;
        float sum = 0.0f;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float p = exp2f(x[j][c + 2 * r] - m[j][c]);
          sum += p;
          const __nv_bfloat16 hi = __float2bfloat16(p), lo = __float2bfloat16(p - __bfloat162float(hi));
          const int row = 16 * warp + g + 8 * r;
          pb[panel_off(32, h, row)] = __bfloat16_as_ushort(hi);
          pb[panel_off(32, 16 + h, row)] = __bfloat16_as_ushort(lo);
        }
        l[j][c] = l[j][c] * corr[j][c] + sum;
      }
  };
  auto issue_values = [&](int it) {  // o = corr · o + Oᵀ of tile it
    if (!__all_sync(0xffffffffu, corr[0][0] == 1.0f && corr[0][1] == 1.0f && corr[1][0] == 1.0f && corr[1][1] == 1.0f))
#pragma unroll
      for (int p = 0; p < kWgLatRankPanels; ++p)
#pragma unroll
        for (int i = 0; i < 16; ++i) o[p][i] *= corr[(i >> 2) & 1][i & 1];
    const uint32_t dp = d_p + (it & 1) * (32 * 64 * 2 >> 4);
    uint32_t dt[kWgLatRankPanels];
#pragma unroll
    for (int p = 0; p < kWgLatRankPanels; ++p) dt[p] = d_ring_t + slot(it, p) * kSlot;
#pragma unroll
    for (int p = 0; p < kWgLatRankPanels; ++p) pin(o[p]);
    wg_fence();
#pragma unroll
    for (int j = 0; j < RT / 16; ++j)  // the 8 panels' chains interleaved
#pragma unroll
      for (int p = 0; p < kWgLatRankPanels; ++p)
        wgmma_m64n32<1>(o[p], smem_desc_at(dt[p], j * 16 * 64 * 2), smem_desc_at(dp, j * 16 * 2), 1);
    wg_commit();
  };

  if (ntiles > 0) {
    load(0);
    load(1);
    // q's rows, scaled, as bf16 hi (rows 0–15) and lo (16–31); zeros past the group's G heads.
    const float* q = a.qt + (k.bt * a.H + k.h0) * W;
    const float sl2 = a.scale * kLog2e;
    for (int h = warp; h < 16; h += kWgLatThreads / 32)
      for (int c = 2 * lane; c < W; c += 64) {  // W even: pairs
        const float2 x = h < k.G ? *reinterpret_cast<const float2*>(q + int64_t(h) * W + c) : make_float2(0.0f, 0.0f);
        uint32_t hi, lo;
        split_bf16x2(x.x * sl2, x.y * sl2, hi, lo);
        *reinterpret_cast<uint32_t*>(sq + panel_off(32, h, c)) = hi;
        *reinterpret_cast<uint32_t*>(sq + panel_off(32, 16 + h, c)) = lo;
      }
    for (int it = 0; it < ntiles; ++it) {
      cp_async_wait<NP>();  // tile it landed (tile it + 1's NP panels may still be loading)
      fence_proxy_async();
      __syncthreads();  // tile it (and, the first time, q) visible to the tensor cores
      issue_scores(it);
      wg_wait0();
      sum_scores();
      softmax(it);
      fence_proxy_async();
      __syncthreads();  // P visible
      issue_values(it);
      wg_wait0();
#pragma unroll
      for (int p = 0; p < kWgLatRankPanels; ++p) pin(o[p]);
      __syncthreads();  // every warp is past tile it: its stage takes tile it + 2
      load(it + 2);
    }
  }
  // (m, l) per head: l summed over the thread's rows, then over g and the warps.
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int o2 = 4; o2 < 32; o2 *= 2) l[j][c] += __shfl_xor_sync(0xffffffffu, l[j][c], o2);
  if (g == 0)
#pragma unroll
    for (int j = 0; j < 2; ++j) red[warp * 16 + 8 * j + 2 * tq] = l[j][0], red[warp * 16 + 8 * j + 2 * tq + 1] = l[j][1];
  __syncthreads();
  if (a.ob) {  // one split: what the combine step would compute (its weight 2^(m − m) = 1), here
    float L[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int h = 8 * j + 2 * tq + c;
        L[j][c] = red[h] + red[16 + h] + red[32 + h] + red[48 + h];
      }
#pragma unroll
    for (int p = 0; p < kWgLatRankPanels; ++p)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = 8 * j + 2 * tq + (e & 1), col = 64 * p + 16 * warp + g + 8 * (e >> 1);
          if (h < k.G) a.ob[(k.bt * a.H + k.h0 + h) * R + col] = (o[p][4 * j + e] + o[p][4 * (j + 2) + e]) / L[j][e & 1];
        }
    return;
  }
  if (warp == 0 && g == 0)
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int h = 8 * j + 2 * tq + c;
        if (h >= k.G) continue;
        a.part_ml[2 * latent_slot(a, k, h)] = m[j][c];
        a.part_ml[2 * latent_slot(a, k, h) + 1] = red[h] + red[16 + h] + red[32 + h] + red[48 + h];
      }
  // acc [head][column]: Oᵀ's hi and lo columns summed; rows 64p + 16·warp + g + 8·(e / 2).
#pragma unroll
  for (int p = 0; p < kWgLatRankPanels; ++p) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = 8 * j + 2 * tq + (e & 1), col = 64 * p + 16 * warp + g + 8 * (e >> 1);
        if (h < k.G) a.part_acc[latent_slot(a, k, h) * R + col] = o[p][4 * j + e] + o[p][4 * (j + 2) + e];
      }
  }
}

// The narrow kernels' softmax of one slab: Sᵀ in s[0] + s[1] (rows g, g + 8; heads 8·nb + 2·tq +
// {0, 1}), rows from `valid` on −∞ when `partial`; updates (m, l) per head, writes Pᵀ [row][head]
// to the warp's buffer (row stride PS) and returns whether any head's maximum moved (cf: rescales).
template <int NH>
__device__ __forceinline__ bool narrow_softmax(float (&s)[2][NH][4], float (&m)[NH][2], float (&l)[NH][2],
                                               float (&cf)[NH][2], bool partial, int valid, float* Pt, int PS, int g,
                                               int tq) {
  bool moved = false;
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
      moved |= cf[nb][hh] != 1.0f;
      m[nb][hh] = m2;
      s[0][nb][hh] = exp2f(s[0][nb][hh] - m2);
      s[0][nb][hh + 2] = exp2f(s[0][nb][hh + 2] - m2);
      float ps = s[0][nb][hh] + s[0][nb][hh + 2];
#pragma unroll
      for (int o = 4; o < 32; o *= 2) ps += __shfl_xor_sync(0xffffffffu, ps, o);
      l[nb][hh] = l[nb][hh] * cf[nb][hh] + ps;
    }
    *reinterpret_cast<float2*>(Pt + g * PS + 8 * nb + 2 * tq) = make_float2(s[0][nb][0], s[0][nb][1]);
    *reinterpret_cast<float2*>(Pt + (g + 8) * PS + 8 * nb + 2 * tq) = make_float2(s[0][nb][2], s[0][nb][3]);
  }
  return __any_sync(0xffffffffu, moved);
}

// A narrow kernel warp's two-stage ring of RT-row slabs [2][RT][stride] of T (fp32 or bf16).
// Rows of whole 16-byte pieces come by bulk copies, one per row by the warp's lanes, on a barrier
// per stage; rows past the chunk's end then keep an earlier slab's (finite) rows, their scores
// −∞, so the ring starts as zeros. Other rows by cp.async (zeros past the end), the padding
// columns zeroed once.
template <typename T, int RT>
struct WarpRing {
  static_assert(RT <= 32, "a bulk copy per row, by the warp's lanes");
  T* ring;
  uint64_t* full;  // [2] in shared memory
  const T* lat;
  int64_t s0, s1;  // the block's chunk of rows; the warp takes slabs warp, warp + nw, …
  int W, stride, lane, warp, nw;
  bool bulk;

  __device__ __forceinline__ void init() {
    if (bulk) {
      for (int i = lane; i < 2 * RT * stride * int(sizeof(T)) / 4; i += 32) reinterpret_cast<uint32_t*>(ring)[i] = 0u;
      if (lane == 0) mbar_init(&full[0], 1), mbar_init(&full[1], 1), fence_mbar_init();
      fence_proxy_async();
    } else {
      zero_padding(ring, 2 * RT, W, stride, lane, 32);
    }
    __syncwarp();
  }
  // The warp's slabs, and the first row of its it-th.
  __device__ __forceinline__ int slabs() const {
    const int n = s0 < s1 ? int((s1 - s0 + RT - 1) / RT) : 0;
    return n > warp ? (n - warp + nw - 1) / nw : 0;
  }
  __device__ __forceinline__ int64_t row(int it) const { return s0 + int64_t(warp + nw * it) * RT; }
  __device__ __forceinline__ const T* slab(int it) const { return ring + (it & 1) * RT * stride; }
  // Slab it into stage it & 1.
  __device__ __forceinline__ void load(int it) {
    T* dst = ring + (it & 1) * RT * stride;
    const int64_t r0 = row(it);
    if (bulk) {
      const int n = int(min(int64_t(RT), s1 - r0));
      if (lane == 0) mbar_arrive_expect_tx(&full[it & 1], unsigned(n * W * int(sizeof(T))));
      __syncwarp();
      if (lane < n) bulk_copy_g2s(dst + lane * stride, lat + (r0 + lane) * W, unsigned(W * int(sizeof(T))), &full[it & 1]);
    } else {
      copy_rows(dst, lat, r0, s1, RT, W, stride, false, lane);
    }
  }
  // Of the warp's `mine` slabs, it + 1 starts loading (if there is one), then slab it has landed
  // and is visible to the warp.
  __device__ __forceinline__ void step(int it, int mine) {
    const bool more = it + 1 < mine;
    if (more) load(it + 1);
    if (bulk)
      mbar_wait(&full[it & 1], unsigned(it >> 1) & 1u);
    else if (more)
      cp_async_wait1();
    else
      cp_async_wait0();
    __syncwarp();
  }
};

// Oᵀ accumulators [MT][NH] (d = 16·mt + g (+8), heads 8·nb + 2·tq (+1)) rescaled by cf per head.
template <int MT, int NH>
__device__ __forceinline__ void narrow_rescale(float (&acc)[MT][NH][4], const float (&cf)[NH][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nb = 0; nb < NH; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nb][e] *= cf[nb][e & 1];
}

// Merges the NW warps' (m, l, acc) of a narrow block through shared memory ([warp][16] m and l,
// then [warp][16][R] acc over the rings) into the block's partial results.
template <int NW, int NH, int MT>
__device__ __forceinline__ void narrow_merge(float* smem, const LatentArgs& a, const LatentBlock& k,
                                             const float (&acc)[MT][NH][4], const float (&m)[NH][2],
                                             const float (&l)[NH][2], int warp, int g, int tq) {
  const int R = a.R;
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
  const float* lat = static_cast<const float*>(k.lat);
  // The scores read up to column 8·⌈W/8⌉ − 1, the value product up to 16·⌈R/16⌉ − 1, both below
  // the stride: the padding is zeros for the whole kernel.
  __shared__ uint64_t full[NW][2];
  WarpRing<float, RT> rs{ring, full[warp], lat, k.s0, k.s1, W, stride, lane, warp, NW, k.vec};
  rs.init();
  const int mine = rs.slabs();
  if (mine > 0) rs.load(0);
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
    rs.step(it, mine);
    const float* tile = rs.slab(it);
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
    const int64_t base = rs.row(it);
    float cf[NH][2];
    if (narrow_softmax(s, m, l, cf, base + RT > k.s1, int(k.s1 - base), Pt, PS, g, tq)) narrow_rescale(acc, cf);
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
  narrow_merge<NW>(smem, a, k, acc, m, l, warp, g, tq);
}

// The narrow kernel over a bf16 cache (≤ 8 heads per group, W ≤ 16·KQ, R ≤ 16·MT): the same
// warp-independent slabs and transposed products, with slabs of 32 rows (a bf16 row has half the
// bytes; two row tiles give independent product chains), the tile exact in bf16 by ldmatrix (rows
// as Sᵀ's A, transposed as Oᵀ's A) and qᵀ, Pᵀ as bf16 pairs hi + lo (two products each).
constexpr int kNarrow16Rows = 32;
template <int KQ, int MT, int NW>
__global__ void __launch_bounds__(NW * 32, 3) latent_narrow16_kernel(LatentArgs a) {
  constexpr int RT = kNarrow16Rows, MR = RT / 16, PS = kPtStride16;
  extern __shared__ __align__(16) float smem[];
  const int W = a.W, R = a.R, stride = a.stride;  // stride: bf16 elements, ≡ 8 (mod 64)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int mi = lane >> 3, mr = lane & 7;
  uint16_t* ring = reinterpret_cast<uint16_t*>(smem) + warp * 2 * RT * stride;  // this warp's [2][RT][stride]
  float* Pt = smem + NW * RT * stride + warp * RT * PS;                            // this warp's Pᵀ [RT][PS]
  const LatentBlock k = latent_block(a);
  const uint16_t* lat = static_cast<const uint16_t*>(k.lat);
  __shared__ uint64_t full[NW][2];
  WarpRing<uint16_t, RT> rs{ring, full[warp], lat, k.s0, k.s1, W, stride, lane, warp, NW, k.vec};
  rs.init();
  const int mine = rs.slabs();
  if (mine > 0) rs.load(0);
  // qᵀ as B fragments, bf16 pairs hi + lo: b0 = q[g][16i + 2tq, +1], b1 = q[g][16i + 2tq + 8, +9].
  uint32_t qh[KQ][2], ql[KQ][2];
#pragma unroll
  for (int i = 0; i < KQ; ++i)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      q_pair(a.qt + (k.bt * a.H + k.h0) * W, g, 16 * i + 2 * tq + 8 * e, k.G, W, a.scale * kLog2e, qh[i][e], ql[i][e]);
  float acc[MT][1][4] = {};
  float m[1][2] = {{-INFINITY, -INFINITY}}, l[1][2] = {{0.0f, 0.0f}};
  for (int it = 0; it < mine; ++it) {
    rs.step(it, mine);
    const uint16_t* tile = rs.slab(it);
    // Sᵀ [row, head] per row tile j: rows 16j + g (+8), heads 2tq (+1).
    float s[MR][4] = {};
#pragma unroll
    for (int i = 0; i < KQ; ++i) {
      if (16 * i >= W) break;
#pragma unroll
      for (int j = 0; j < MR; ++j) {
        uint32_t av[4];
        ldmatrix_x4(av, tile + (16 * j + mr + 8 * (mi & 1)) * stride + 16 * i + 8 * (mi >> 1));
        mma_bf16_free(s[j], av, ql[i][0], ql[i][1]);
        mma_bf16_free(s[j], av, qh[i][0], qh[i][1]);
      }
    }
    const int64_t base = rs.row(it);
    bool moved = false;
    float cf[1][2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {  // head 2tq + hh: rows 16j + g (+8) here, the rest across g
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < MR; ++j)
#pragma unroll
        for (int e = hh; e < 4; e += 2) {
          if (base + 16 * j + g + 8 * (e >> 1) >= k.s1) s[j][e] = -INFINITY;
          mx = fmaxf(mx, s[j][e]);
        }
#pragma unroll
      for (int o = 4; o < 32; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m2 = fmaxf(m[0][hh], mx);  // a slab has a row below s1: m2 finite
      cf[0][hh] = exp2f(m[0][hh] - m2);
      moved |= cf[0][hh] != 1.0f;
      m[0][hh] = m2;
      float ps = 0.0f;
#pragma unroll
      for (int j = 0; j < MR; ++j)
#pragma unroll
        for (int e = hh; e < 4; e += 2) ps += s[j][e] = exp2f(s[j][e] - m2);
#pragma unroll
      for (int o = 4; o < 32; o *= 2) ps += __shfl_xor_sync(0xffffffffu, ps, o);
      l[0][hh] = l[0][hh] * cf[0][hh] + ps;
    }
#pragma unroll
    for (int j = 0; j < MR; ++j) {
      *reinterpret_cast<float2*>(Pt + (16 * j + g) * PS + 2 * tq) = make_float2(s[j][0], s[j][1]);
      *reinterpret_cast<float2*>(Pt + (16 * j + g + 8) * PS + 2 * tq) = make_float2(s[j][2], s[j][3]);
    }
    if (__any_sync(0xffffffffu, moved)) narrow_rescale(acc, cf);
    __syncwarp();
#pragma unroll
    for (int ks = 0; ks < MR; ++ks) {
      uint32_t ph[2], pl[2];  // Pᵀ's B fragment: rows 16ks + 2tq, +1 (+8) of head g
#pragma unroll
      for (int e = 0; e < 2; ++e)
        split_bf16x2(Pt[(16 * ks + 2 * tq + 8 * e) * PS + g], Pt[(16 * ks + 2 * tq + 8 * e + 1) * PS + g], ph[e], pl[e]);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (16 * mt >= R) break;
        uint32_t av[4];  // A [d][row] = tile[row][d]
        ldmatrix_x4_trans(av, tile + (16 * ks + mr + 8 * (mi >> 1)) * stride + 16 * mt + 8 * (mi & 1));
        mma_bf16_free(acc[mt][0], av, pl[0], pl[1]);
        mma_bf16_free(acc[mt][0], av, ph[0], ph[1]);
      }
    }
    __syncwarp();
  }
  narrow_merge<NW>(smem, a, k, acc, m, l, warp, g, tq);
}

// One block per (row bt, head h): ob = Σ_split 2^(m_i − M) acc_i / Σ_split 2^(m_i − M) l_i (m in
// log₂ units). The weights are computed once per split into shared memory (splits ≤ kMaxSplits).
// A thread sums four columns (as float4 when R % 4 == 0 and ob is 16-byte aligned; else one column
// per pass) over the splits, loading kCombineLoads splits before summing them, so that many loads
// are in flight at once: a loop of one dependent load per split took about a microsecond a split
// at small batches, where the splits are many.
constexpr int kMaxSplits = 1024, kCombineThreads = 128, kCombineLoads = 8;
__global__ void __launch_bounds__(kCombineThreads) latent_combine_kernel(const float* part_ml, const float* part_acc,
                                                                        int64_t H, int64_t R, int splits, float* ob,
                                                                        bool vec) {
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
  // vec: R % 4 == 0 and ob 16-byte aligned. Splits of weight 0 (no rows) are loaded but not
  // summed, whatever their acc holds.
  if (vec) {
    for (int64_t c = 4 * int64_t(threadIdx.x); c < R; c += 4 * blockDim.x) {
      float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      for (int i0 = 0; i0 < splits; i0 += kCombineLoads) {
        float4 x[kCombineLoads];
#pragma unroll
        for (int u = 0; u < kCombineLoads; ++u)
          if (i0 + u < splits) x[u] = *reinterpret_cast<const float4*>(part_acc + at(i0 + u) * R + c);
#pragma unroll
        for (int u = 0; u < kCombineLoads; ++u)
          if (i0 + u < splits && wts[i0 + u] != 0.0f) {
            const float w = wts[i0 + u];
            o.x += w * x[u].x, o.y += w * x[u].y, o.z += w * x[u].z, o.w += w * x[u].w;
          }
      }
      *reinterpret_cast<float4*>(ob + (bt * H + h) * R + c) = make_float4(o.x / L, o.y / L, o.z / L, o.w / L);
    }
  } else {
    for (int64_t c = threadIdx.x; c < R; c += blockDim.x) {
      float o = 0.0f;
      for (int i0 = 0; i0 < splits; i0 += kCombineLoads) {
        float x[kCombineLoads];
#pragma unroll
        for (int u = 0; u < kCombineLoads; ++u)
          if (i0 + u < splits) x[u] = part_acc[at(i0 + u) * R + c];
#pragma unroll
        for (int u = 0; u < kCombineLoads; ++u)
          if (i0 + u < splits && wts[i0 + u] != 0.0f) o += wts[i0 + u] * x[u];
      }
      ob[(bt * H + h) * R + c] = o / L;
    }
  }
}

}  // namespace

// The narrow instantiations: up to 8 or 16 heads at W, R ≤ 64; up to 8 heads at W, R ≤ 128; bf16:
// up to 8 heads at W, R ≤ 128.
constexpr auto kNarrow1 = latent_narrow_kernel<1, kNarrow / 8, kNarrow / 16, kLatWarps, true>;
constexpr auto kNarrow2 = latent_narrow_kernel<2, kNarrow / 8, kNarrow / 16, kLatWarps, true>;
constexpr auto kNarrow3 = latent_narrow_kernel<1, kNarrow / 4, kNarrow / 8, 4, false>;
constexpr int kNarrow16Warps = 4;
constexpr auto kNarrow16 = latent_narrow16_kernel<2 * kNarrow / 16, 2 * kNarrow / 16, kNarrow16Warps>;
constexpr auto kWide = latent_wide_kernel<kMaxLatentWidth / 64>;
constexpr auto kWide16 = latent_wide16_kernel<kMaxLatentWidth / 128>;
constexpr auto kWgLat = latent_wgmma_kernel<kWgLatWidth / 64>;
LatentKernel g_latent_kernel = LatentKernel::Auto;

void set_latent_kernel(LatentKernel k) { g_latent_kernel = k; }

// Tiles per block of latent_wgmma_kernel for `items` (token, head group) rows over at most
// `tiles` tiles each, on `sms` SMs (one block each). The warpgroup kernel pays about two tiles'
// time per block beyond its tiles (filling its ring, its partial results), so the chunk minimises
// waves · (2 + tiles per chunk), as if every sequence were the longest: one wave of long chunks
// rather than four of short ones (at 256 sequences of 4,096 rows, 0.318 against 0.356 ms, and
// 0.307 once a single chunk writes ob itself, without the combine step; at 16, 0.042 against
// 0.077). A decode step's rows are the cache's plus its new token: 4,097 rows there are 65 tiles,
// two chunks. Chunks are at most 64 tiles (4,096 rows), so that a batch of unequal
// lengths, whose longest sequence the rule takes for all, splits its long ones finely enough.
inline int64_t wgmma_latent_chunk(int64_t items, int64_t tiles, int64_t sms) {
  constexpr int64_t kFixed = 2, kMaxTiles = 64;
  const int64_t lo = std::max<int64_t>(1, (tiles + kMaxSplits - 1) / kMaxSplits);  // ≤ kMaxSplits chunks
  int64_t best = lo, best_cost = INT64_MAX;
  for (int64_t ct = lo; ct <= std::max(lo, std::min(tiles, kMaxTiles)); ++ct) {
    const int64_t splits = (tiles + ct - 1) / ct;
    const int64_t cost = (items * splits + sms - 1) / sms * (kFixed + ct);
    if (cost <= best_cost) best = ct, best_cost = cost;  // ties: the longer chunk (fewer partials)
  }
  return best;
}

void latent_attention(const float* qt, const void* const* lats, device::Storage storage, const int64_t* p0s,
                      int64_t longest, float* ob, int64_t B, int64_t T, int64_t H, int64_t W, int64_t R, float scale) {
  if (R > kMaxRank) throw error("mla", "kv_lora_rank ", R, " exceeds the CUDA decode kernel's ", kMaxRank);
  if (W > kMaxLatentWidth || W < R)
    throw error("mla", "latent width ", W, " (kv_lora_rank ", R, " + rope) must lie between the rank and the CUDA ",
                "decode kernel's ", kMaxLatentWidth);
  if (!B || !T || !H) return;
  const bool bf16 = storage == device::Storage::BF16;
  // Narrow kernels: W, R ≤ 64 (any group), or ≤ 128 with at most 8 heads per group (k3-small's
  // 96 + 32 with 6 heads); bf16 only the latter. The rest wide.
  const int64_t G0 = std::min<int64_t>(H, kHeadsPerBlock);
  const bool upto128 = W <= 2 * kNarrow && R <= 2 * kNarrow && G0 <= 8;
  const int narrow = bf16 ? (upto128 ? 4 : 0)
                          : W <= kNarrow && R <= kNarrow ? (G0 <= 8 ? 1 : 2) : upto128 ? 3 : 0;
  // bf16 latents of DeepSeek/K3's shape (512 + 64): the warpgroup kernel (unless
  // set_latent_kernel says otherwise), about 1.7–2.5x the mma.sync kernel's speed at 16–256
  // sequences of 4,096 rows (16 heads).
  const int64_t rows = B * T, groups = (H + kHeadsPerBlock - 1) / kHeadsPerBlock;
  const bool wg = bf16 && !narrow && W == kWgLatWidth && R == kMaxRank && g_latent_kernel != LatentKernel::MmaSync;
  const int warps = narrow == 3 ? 4 : narrow == 4 ? kNarrow16Warps : wg ? kWgLatThreads / 32 : kLatWarps;
  constexpr int RT = kWideRows;
  // The warpgroup kernel: wgmma_latent_chunk. The others: about four waves of resident blocks
  // (two per SM) over all (sequence, token, head group) rows, so the last wave's idle SMs cost
  // little; chunks of whole tiles (tiles or slabs of 16 rows, 32 in bf16), at least 64 latent
  // rows (256 narrow ones, whose partial results weigh more against their rows), at most
  // kMaxSplits.
  const int64_t tile_rows = wg ? kWgLatRows : bf16 ? kWide16Rows : RT;
  static_assert(kWide16Rows == kNarrow16Rows, "one chunk granularity for the bf16 kernels");
  int64_t chunk = 0;
  if (wg) {
    chunk = wgmma_latent_chunk(rows * groups, (longest + kWgLatRows - 1) / kWgLatRows, device::sm_count()) * kWgLatRows;
  } else {
    const int64_t target = 8 * device::sm_count(), min_chunk = narrow ? 256 : 64;
    const int64_t splits0 = std::max<int64_t>(1, std::min<int64_t>({(target + rows * groups - 1) / (rows * groups),
                                                                     (longest + min_chunk - 1) / min_chunk,
                                                                     int64_t(kMaxSplits)}));
    chunk = (longest + splits0 - 1) / splits0;
    chunk = (chunk + tile_rows - 1) / tile_rows * tile_rows;
  }
  const int splits = int((longest + chunk - 1) / chunk);
  const bool direct = wg && splits == 1;  // the kernel writes ob itself: no partials, no combine
  device::Buffer ml, acc;
  if (!direct) ml = device::Buffer(size_t(rows * splits * H * 2) * 4), acc = device::Buffer(size_t(rows * splits * H * R) * 4);
  LatentArgs a{};
  a.qt = qt, a.lats = lats, a.p0s = p0s, a.T = T, a.H = H, a.chunk = chunk;
  a.W = int(W), a.R = int(R), a.splits = splits, a.groups = int(groups), a.scale = scale;
  // Rows hold every column a kernel reads: the scores' k-steps (8 columns, 16 in bf16) and,
  // narrow, whole m16 tiles of R (the value product's rows past R are read, their results
  // dropped). Strides of 32 bytes (mod 128) keep the fragment loads free of bank conflicts: fp32
  // ≡ 8 (mod 32) elements, bf16 ≡ 8 (mod 64).
  const int kstep = bf16 ? 16 : 8, period = bf16 ? 64 : 32;
  const int span = std::max(int((W + kstep - 1) / kstep * kstep), narrow ? int((R + 15) / 16 * 16) : 0);
  a.stride = span + ((8 - span) % period + period) % period;
  a.vec = W % (bf16 ? 8 : 4) == 0;
  a.part_ml = ml.as<float>(), a.part_acc = acc.as<float>(), a.ob = direct ? ob : nullptr;
  // Two-stage rings of tiles (block) or slabs (warp), then per warp Pᵀ (narrow), or the partial
  // scores, P and corr (wide); the narrow kernels' merge reuses the rings.
  const size_t ring = size_t(2 * tile_rows * a.stride) * (bf16 ? 2 : 4);
  const size_t merge = size_t(2 * warps * 16 + warps * 16 * R) * 4;
  size_t smem = 0;
  if (wg) {
    smem = wgmma_latent_smem(W);
  } else if (narrow) {
    const int ps = narrow == 4 ? kPtStride16 : narrow_pt_stride(narrow == 2 ? 2 : 1);
    smem = std::max(warps * (ring + size_t(tile_rows * ps) * 4), merge);
  } else {
    smem = ring + size_t(kLatWarps * 16 * tile_rows + 16 * (bf16 ? kP16Stride : kPStride) + 16) * 4;
  }
  static const bool opted = [] {
    for (auto* f : {kNarrow1, kNarrow2, kNarrow3, kNarrow16, kWide, kWide16})
      K3_CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    K3_CUDA_CHECK(cudaFuncSetAttribute(kWgLat, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(wgmma_latent_smem(kWgLatWidth))));
    return true;
  }();
  (void)opted;
  const int64_t blocks = rows * splits * groups;
  if (blocks > INT32_MAX || rows * H > INT32_MAX)
    throw error("mla", "latent attention over ", blocks, " blocks (", rows * H, " rows × heads) exceeds the grid");
  auto* kernel = narrow == 1 ? kNarrow1 : narrow == 2 ? kNarrow2 : narrow == 3 ? kNarrow3 : narrow == 4 ? kNarrow16
               : wg ? kWgLat : bf16 ? kWide16 : kWide;
  kernel<<<unsigned(blocks), unsigned(warps * 32), smem, device::stream()>>>(a);
  K3_CUDA_LAUNCHED();
  if (direct) return;
  const bool vec_out = R % 4 == 0 && reinterpret_cast<uintptr_t>(ob) % 16 == 0;
  latent_combine_kernel<<<unsigned(rows * H), kCombineThreads, 0, device::stream()>>>(ml.as<float>(), acc.as<float>(), H, R,
                                                                          splits, ob, vec_out);
  K3_CUDA_LAUNCHED();
}

__global__ void append_rows_kernel(const float* src, int64_t ld, int64_t T, int64_t w, void* const* dsts,
                                   const int64_t* at, bool bf16, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t row = i / w, c = i % w, b = row / T, t = row % T;
  const int64_t d = (at[b] + t) * w + c;
  const float x = src[row * ld + c];
  if (bf16)
    static_cast<__nv_bfloat16*>(dsts[b])[d] = __float2bfloat16(x);
  else
    static_cast<float*>(dsts[b])[d] = x;
}

void append_rows(const float* src, int64_t ld, int64_t B, int64_t T, int64_t w, void* const* dsts, const int64_t* at,
                 device::Storage storage) {
  const int64_t n = B * T * w;
  if (!n) return;
  append_rows_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(
      src, ld, T, w, dsts, at, storage == device::Storage::BF16, n);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
