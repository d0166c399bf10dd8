// Causal softmax attention on the tensor cores for bf16 storage, fp32 accumulation and softmax:
// the forward on Hopper's warpgroup MMA (wgmma), the backward on mma.sync (m16n8k16), both on
// FlashAttention's schedule (a block walks the other operand's tiles, the softmax online).
//
// Conventions shared by both: tiles of 16-byte chunks in shared memory are XOR-swizzled (chunk
// c of row r at c ^ (r mod 8)), so the 8 row addresses of an ldmatrix, or a wgmma's 8-row core
// matrices, hit 8 different bank groups. An accumulator tile holds, per thread, two rows (g and
// g + 8, g = lane / 4) of each 8-column block: the 4 lanes of a quad share those rows, and the
// layout of two adjacent 8-column blocks, rounded to bf16, is the A-operand layout of one 16-wide
// k step, so P and dS feed the next product from registers. The softmax runs in base 2 (exp2 of
// scores prescaled by scale·log2 e); lse is written in natural log as the SIMT kernel does.
#include <cfloat>

#include "core/cuda_util.cuh"
#include "ops/attention_mma_cuda.h"

namespace k3::cuda {
namespace {

using device::cp_async16_zfill;
using device::panel_off;
using device::pin;
using device::smem_desc_at;
using device::smem_desc_lo;
using device::wg_commit;
using device::wg_fence;
using device::wg_wait0;
using device::wg_wait1;

constexpr int kKeys = 64;  // keys per tile
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }


using device::ldmatrix_x4;
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
  const unsigned a = unsigned(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

using device::mma_bf16;

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const unsigned*>(&v);
}

// Element offset of 16-byte chunk c of row r in a tile whose rows hold D bf16 values.
template <int D>
__device__ __forceinline__ int swz(int r, int c) {
  return r * D + ((c ^ (r & 7)) << 3);
}

// n rows from `base` (row stride `stride` elements, as in a [*, H, D] array) into a swizzled tile;
// rows at or past `valid` are zero-filled.
template <int D, int THREADS>
__device__ __forceinline__ void load_tile(__nv_bfloat16* tile, const __nv_bfloat16* base, int64_t stride,
                                          int n, int valid) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < n * kChunks; i += THREADS) {
    const int r = i / kChunks, c = i % kChunks;
    const bool ok = r < valid;
    cp_async16_zfill(tile + swz<D>(r, c), ok ? base + r * stride + c * 8 : base, ok);
  }
}

// Forward on Hopper's warpgroup MMA (wgmma, sm_90a): a block of 2 warpgroups takes 128 queries,
// 64 per warpgroup. S = Q Kᵀ reads both operands from shared memory through matrix descriptors
// (m64n64k16 per 16 dimensions); O += P V takes P from registers (the accumulator layout of S,
// rounded to bf16, is wgmma's A-fragment layout) and V from shared memory transposed (V's rows
// are keys, so its N dimension, the value columns, is the contiguous one). Tiles are stored in
// the 128-byte swizzle the descriptors name: 64-column panels of 128-byte rows, 16-byte chunk c of
// row r at c ^ (r mod 8), each panel 1024-byte aligned. Keys and values stream through a 3-stage
// cp.async ring, and each warpgroup overlaps the next tile's scores with this tile's P V
// (FlashAttention-3's intra-warpgroup schedule; the loop's comments say how).
constexpr int kWgRows = 64;  // queries per warpgroup
constexpr int kStages = 3;   // key/value tiles in shared memory: in use, next, loading

// ROWS rows from `base` into 64-column panels; rows at or past `valid` are zero-filled. When the
// threads cover whole rows a multiple of 8 rows apart (THREADS / (D / 8) ≡ 0 mod 8), a thread's
// chunk and swizzle are the same on every pass, so its copies differ by constant offsets and one
// row stride (no address arithmetic per copy); otherwise each copy computes its place.
template <int D, int THREADS, int ROWS>
__device__ __forceinline__ void load_panels(__nv_bfloat16* tile, const __nv_bfloat16* base, int64_t stride,
                                            int valid) {
  constexpr int kChunks = D / 8;
  if constexpr (THREADS % kChunks == 0 && (THREADS / kChunks) % 8 == 0 && ROWS % (THREADS / kChunks) == 0) {
    constexpr int kStep = THREADS / kChunks;  // rows per pass
    const int r0 = threadIdx.x / kChunks, c = (threadIdx.x % kChunks) * 8;
    __nv_bfloat16* dst = tile + panel_off(ROWS, r0, c);
    const __nv_bfloat16* src = base + r0 * stride + c;
#pragma unroll
    for (int n = 0; n < ROWS / kStep; ++n) {
      const bool ok = r0 + n * kStep < valid;
      cp_async16_zfill(dst + n * kStep * 64, ok ? src + n * kStep * stride : base, ok);
    }
  } else {
    for (int i = threadIdx.x; i < ROWS * kChunks; i += THREADS) {
      const int r = i / kChunks, c = (i % kChunks) * 8;
      const bool ok = r < valid;
      cp_async16_zfill(tile + panel_off(ROWS, r, c), ok ? base + r * stride + c : base, ok);
    }
  }
}

#define K3_WG_D32                                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define K3_WG_OUT32(d)                                                                                       \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),  \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d (+)= A B, m64n64k16: A and B K-major in shared memory. accumulate 0 overwrites d.
__device__ __forceinline__ void wgmma_ss(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " K3_WG_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
      : K3_WG_OUT32(d)
      : "l"(da), "l"(db), "r"(accumulate));
#else
  __trap();  // built for sm_90a only (CMAKE_CUDA_ARCHITECTURES 90a)
#endif
}
// d += A B, m64n64k16: A in registers (the mma.sync A-fragment layout per warp), B MN-major.
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const unsigned (&a)[4], uint64_t db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " K3_WG_D32
      ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : K3_WG_OUT32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
#else
  __trap();
#endif
}

template <int DK, int DV>
__global__ void __launch_bounds__(256) fwd_wgmma_kernel(const __nv_bfloat16* __restrict__ q,
                                                        const __nv_bfloat16* __restrict__ k,
                                                        const __nv_bfloat16* __restrict__ v,
                                                        __nv_bfloat16* __restrict__ y, float* __restrict__ lse,
                                                        AttnShape a) {
  constexpr int kThreads = 256, kRows = 2 * kWgRows;
  static_assert(DK % 64 == 0 && DV % 64 == 0, "64-column panels");
  extern __shared__ unsigned char smem_raw[];
  // Panels must start on 1024-byte boundaries (the swizzle's period): align the base.
  const uint32_t raw = unsigned(__cvta_generic_to_shared(smem_raw));
  __nv_bfloat16* sq = reinterpret_cast<__nv_bfloat16*>(smem_raw + ((1024 - (raw & 1023)) & 1023));  // [kRows][DK]
  __nv_bfloat16* sk = sq + kRows * DK;                 // [kStages][kKeys][DK]
  __nv_bfloat16* sv = sk + kStages * kKeys * DK;       // [kStages][kKeys][DV]

  const int64_t q0 = int64_t(gridDim.x - 1 - blockIdx.x) * kRows;  // heaviest tiles first
  const int h = blockIdx.y, b = blockIdx.z;
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2,
            t = lane & 3;
  const int64_t qstride = a.H * DK, vstride = a.H * DV;
  const __nv_bfloat16* kb = k + (int64_t(b) * a.S * a.H + h) * DK;
  const __nv_bfloat16* vb = v + (int64_t(b) * a.S * a.H + h) * DV;
  const int64_t last_key = a.pos0 + min64(q0 + kRows, a.Tq) - 1;
  const int ntiles = int(last_key / kKeys) + 1;
  // Tile j lives in stage j mod 3, loaded two tiles ahead; one cp.async group per tile (empty
  // past the last), so "tile j landed" is always "at most N groups pending".
  auto load_kv = [&](int tile) {
    if (tile < ntiles) {
      const int64_t k0 = int64_t(tile) * kKeys;
      const int valid = int(min64(kKeys, a.S - k0)), st = tile % kStages;
      load_panels<DK, kThreads, kKeys>(sk + st * kKeys * DK, kb + k0 * qstride, qstride, valid);
      load_panels<DV, kThreads, kKeys>(sv + st * kKeys * DV, vb + k0 * vstride, vstride, valid);
    }
    device::cp_async_commit();
  };
  load_panels<DK, kThreads, kRows>(sq, q + ((int64_t(b) * a.Tq + q0) * a.H + h) * DK, qstride,
                                   int(min64(kRows, a.Tq - q0)));
  load_kv(0);  // in Q's group
  load_kv(1);
  load_kv(2);

  float o[DV / 64][32];
#pragma unroll
  for (int p = 0; p < DV / 64; ++p)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[p][i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, corr[2];
  const float sl2 = a.scale * kLog2e;
  const int64_t row_q[2] = {q0 + wg * kWgRows + warp * 16 + g, q0 + wg * kWgRows + warp * 16 + g + 8};
  // This warpgroup's 64 query rows: panel p starts at sq + p·kRows·64 + wg·64·64.
  const __nv_bfloat16* wq = sq + wg * kWgRows * 64;
  float s[32];
  unsigned pa[4][4];

  // Descriptors' low words (smem_desc_at adds constant byte offsets): Q's panels, the key and
  // value stages.
  const uint32_t d_q = smem_desc_lo(wq, 16), d_k = smem_desc_lo(sk, 16), d_v = smem_desc_lo(sv, kKeys * 128);
  auto issue_scores = [&](int tile) {  // s = Q K_tileᵀ, asynchronously
    // Both descriptors advance in place (32 bytes a k-step, then to the next panel): one 64-bit
    // add per operand and product.
    uint64_t da = smem_desc_at(d_q, 0), db = smem_desc_at(d_k + (tile % kStages) * (kKeys * DK * 2 / 16), 0);
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk) {
      wgmma_ss(s, da, db, kk > 0);
      if ((kk & 3) < 3) {
        da += 2, db += 2;
      } else {
        da += (kRows * 64 * 2 - 96) >> 4, db += (kKeys * 64 * 2 - 96) >> 4;
      }
    }
    wg_commit();
  };
  // Mask, online softmax of tile `tile`'s scores in s: s becomes P (fp32), corr the factor the
  // accumulator must take before P V is added.
  auto softmax = [&](int tile) {
    const int64_t k0 = int64_t(tile) * kKeys;
    if (k0 + kKeys - 1 > a.pos0 + q0 + wg * kWgRows) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t key = k0 + nt * 8 + 2 * t + (e & 1);
          if (key > a.pos0 + row_q[e >> 1]) s[nt * 4 + e] = -INFINITY;
        }
    }
    float mref[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt * 4 + 2 * r], s[nt * 4 + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx * sl2);
      mref[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet: p = 0, no NaN
      corr[r] = exp2f(m[r] - mref[r]);
      m[r] = m_new;
      l[r] *= corr[r];
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const float pv = exp2f(fmaf(s[i], sl2, -mref[(i >> 1) & 1]));
      s[i] = pv;
      l[(i >> 1) & 1] += pv;
    }
  };
  auto pack_p = [&] {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      pa[j][0] = pack_bf16(s[8 * j + 0], s[8 * j + 1]);
      pa[j][1] = pack_bf16(s[8 * j + 2], s[8 * j + 3]);
      pa[j][2] = pack_bf16(s[8 * j + 4], s[8 * j + 5]);
      pa[j][3] = pack_bf16(s[8 * j + 6], s[8 * j + 7]);
    }
  };

  device::cp_async_wait2();  // Q and tile 0
  // cp.async wrote through the generic proxy; wgmma reads through the async proxy.
  device::fence_proxy_async();
  __syncthreads();
  pin(s);
  wg_fence();
  issue_scores(0);
  wg_wait0();
  pin(s);
  softmax(0);
  pack_p();

  auto issue_pv = [&](int tile) {  // o += P V_tile, asynchronously
    const uint32_t dv = d_v + (tile % kStages) * (kKeys * DV * 2 / 16);
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int p = 0; p < DV / 64; ++p)  // keys [16j, 16j + 16) of value panel p
        wgmma_rs(o[p], pa[j], smem_desc_at(dv, (p * kKeys * 64 + j * 16 * 64) * 2));
    wg_commit();
  };
  // Tile j < last: the scores of tile j + 1 are computed while P_j V_j runs, and their softmax
  // while the tensor cores finish it; the accumulator takes the new factor once P_j V_j is in.
  // (The last tile is peeled off, so every pass commits the same two groups.)
  for (int tile = 0; tile + 1 < ntiles; ++tile) {
    device::cp_async_wait1();  // tile + 1 landed
    device::fence_proxy_async();
    __syncthreads();
#pragma unroll
    for (int p = 0; p < DV / 64; ++p) pin(o[p]);
    pin(s);
    wg_fence();
    issue_scores(tile + 1);
    issue_pv(tile);
    wg_wait1();  // the scores (committed first) are in; P V may still run
    pin(s);
    softmax(tile + 1);
    wg_wait0();
#pragma unroll
    for (int p = 0; p < DV / 64; ++p) pin(o[p]);
    __syncthreads();  // both warpgroups are done with stage tile mod 3 (K read last pass, V now)
    load_kv(tile + 3);
    pack_p();
#pragma unroll
    for (int p = 0; p < DV / 64; ++p)
#pragma unroll
      for (int i = 0; i < 32; ++i) o[p][i] *= corr[(i >> 1) & 1];
  }
#pragma unroll
  for (int p = 0; p < DV / 64; ++p) pin(o[p]);
  wg_fence();
  issue_pv(ntiles - 1);
  wg_wait0();
#pragma unroll
  for (int p = 0; p < DV / 64; ++p) pin(o[p]);

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int64_t qi = row_q[r];
    if (qi >= a.Tq) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    __nv_bfloat16* yr = y + ((int64_t(b) * a.Tq + qi) * a.H + h) * DV;
#pragma unroll
    for (int p = 0; p < DV / 64; ++p)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
        *reinterpret_cast<__nv_bfloat162*>(yr + p * 64 + nt * 8 + 2 * t) =
            __floats2bfloat162_rn(o[p][nt * 4 + 2 * r] * inv, o[p][nt * 4 + 2 * r + 1] * inv);
    if (lse && t == 0) lse[(int64_t(b) * a.H + h) * a.Tq + qi] = m[r] / kLog2e + logf(l[r]);
  }
}

template <int DK, int DV>
void launch_wgmma(const void* q, const void* k, const void* v, void* y, float* lse, const AttnShape& a) {
  constexpr int kRows = 2 * kWgRows;
  const size_t smem = (size_t(kRows) * DK + kStages * size_t(kKeys) * (DK + DV)) * sizeof(__nv_bfloat16) + 1024;
  auto kernel = fwd_wgmma_kernel<DK, DV>;
  K3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned((a.Tq + kRows - 1) / kRows), unsigned(a.H), unsigned(a.B));
  kernel<<<grid, 256, smem, device::stream()>>>(
      static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(k),
      static_cast<const __nv_bfloat16*>(v), static_cast<__nv_bfloat16*>(y), lse, a);
  K3_CUDA_LAUNCHED();
}

// Backward: one block per (64 keys, head, sequence), 4 warps of 16 keys; tiles of QT queries (with
// their dy rows, lse and D = Σ dy·y) stream through shared memory double-buffered, from the first
// query that sees the block's keys to the last. Per tile each warp forms its keys' rows of
// Sᵀ = K Qᵀ and dPᵀ = V dYᵀ (keys as rows, so dK and dV stay in registers for the whole walk),
// Pᵀ = exp(Sᵀ − lse) and dSᵀ = Pᵀ ∘ (dPᵀ − D); dV += Pᵀ dY and dK += dSᵀ Q take Pᵀ and dSᵀ from
// the accumulators as A operands. dS goes through shared memory (transposed) for dQ = dS K, which
// the 4 warps split and add to global memory atomically (FlashAttention-2's scheme).
template <int D, int QT>
__global__ void __launch_bounds__(128) bwd_mma_kernel(const __nv_bfloat16* __restrict__ q,
                                                      const __nv_bfloat16* __restrict__ k,
                                                      const __nv_bfloat16* __restrict__ v,
                                                      const float* __restrict__ lse, const float* __restrict__ Drow,
                                                      const __nv_bfloat16* __restrict__ dy, float* __restrict__ dq,
                                                      float* __restrict__ dk, float* __restrict__ dv, AttnShape a) {
  constexpr int kThreads = 128;
  static_assert(QT % 16 == 0 && 64 % QT == 0, "4 warps split the dQ tile's 16-row groups");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* sk = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [kKeys][D]
  __nv_bfloat16* sv = sk + kKeys * D;                               // [kKeys][D]
  __nv_bfloat16* sq = sv + kKeys * D;                               // [2][QT][D]
  __nv_bfloat16* sdy = sq + 2 * QT * D;                             // [2][QT][D]
  __nv_bfloat16* sds = sdy + 2 * QT * D;                            // [QT][kKeys]: dS, queries as rows
  float* slse = reinterpret_cast<float*>(sds + QT * kKeys);         // [2][QT], log2 units
  float* sdd = slse + 2 * QT;                                       // [2][QT]

  const int64_t k0 = int64_t(blockIdx.x) * kKeys;
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, mi = lane >> 3;
  const int64_t stride = a.H * D;
  const float sl2 = a.scale * kLog2e;

  auto load_queries = [&](int64_t i0, int buf) {
    const int valid = int(min64(QT, a.Tq - i0));
    const int64_t row0 = (int64_t(b) * a.Tq + i0) * a.H + h;
    load_tile<D, kThreads>(sq + buf * QT * D, q + row0 * D, stride, QT, valid);
    load_tile<D, kThreads>(sdy + buf * QT * D, dy + row0 * D, stride, QT, valid);
    if (threadIdx.x < QT) {
      const int r = threadIdx.x;
      const int64_t li = (int64_t(b) * a.H + h) * a.Tq + i0 + r;
      slse[buf * QT + r] = r < valid ? lse[li] * kLog2e : INFINITY;  // a padded query: p = 0
      sdd[buf * QT + r] = r < valid ? Drow[li] : 0.0f;
    }
  };
  {
    const int valid = int(min64(kKeys, a.S - k0));
    const int64_t row0 = (int64_t(b) * a.S + k0) * a.H + h;
    load_tile<D, kThreads>(sk, k + row0 * D, stride, kKeys, valid);
    load_tile<D, kThreads>(sv, v + row0 * D, stride, kKeys, valid);
  }
  const int64_t i_first = (k0 > a.pos0 ? k0 - a.pos0 : 0) / QT * QT;
  if (i_first < a.Tq) load_queries(i_first, 0);
  device::cp_async_commit();

  float dka[D / 8][4] = {}, dva[D / 8][4] = {};
  for (int64_t i0 = i_first, it = 0; i0 < a.Tq; i0 += QT, ++it) {
    const int buf = int(it & 1);
    if (i0 + QT < a.Tq) {
      load_queries(i0 + QT, buf ^ 1);  // that buffer's last readers passed this tile's first barrier
      device::cp_async_commit();
      device::cp_async_wait1();
    } else {
      device::cp_async_wait0();
    }
    __syncthreads();
    const __nv_bfloat16* tq = sq + buf * QT * D;
    const __nv_bfloat16* tdy = sdy + buf * QT * D;

    float st[QT / 8][4] = {}, dpt[QT / 8][4] = {};  // Sᵀ and dPᵀ: this warp's 16 keys × QT queries
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned ka[4], va[4];
      ldmatrix_x4(ka, sk + swz<D>(warp * 16 + (lane & 15), 2 * kk + (lane >> 4)));
      ldmatrix_x4(va, sv + swz<D>(warp * 16 + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
      for (int nt = 0; nt < QT / 8; nt += 2) {
        unsigned bq[4], bd[4];
        ldmatrix_x4(bq, tq + swz<D>(nt * 8 + (mi >> 1) * 8 + (lane & 7), 2 * kk + (mi & 1)));
        ldmatrix_x4(bd, tdy + swz<D>(nt * 8 + (mi >> 1) * 8 + (lane & 7), 2 * kk + (mi & 1)));
        mma_bf16(st[nt], ka, bq[0], bq[1]);
        mma_bf16(st[nt + 1], ka, bq[2], bq[3]);
        mma_bf16(dpt[nt], va, bd[0], bd[1]);
        mma_bf16(dpt[nt + 1], va, bd[2], bd[3]);
      }
    }
    const bool diag = k0 + kKeys - 1 > a.pos0 + i0;  // some key of the block is past some query
#pragma unroll
    for (int nt = 0; nt < QT / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * t + (e & 1);
        const int64_t key = k0 + warp * 16 + g + 8 * (e >> 1);
        float p = exp2f(fmaf(st[nt][e], sl2, -slse[buf * QT + qc]));
        if (diag && key > a.pos0 + i0 + qc) p = 0.0f;
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - sdd[buf * QT + qc]);  // dSᵀ, before the scale
      }
    // dV += Pᵀ dY and dK += dSᵀ Q: accumulator tiles 2j, 2j + 1 are the A fragment of queries
    // [16j, 16j + 16); the B fragments come transposed from the query-major tiles.
#pragma unroll
    for (int j = 0; j < QT / 16; ++j) {
      const unsigned pa[4] = {pack_bf16(st[2 * j][0], st[2 * j][1]), pack_bf16(st[2 * j][2], st[2 * j][3]),
                              pack_bf16(st[2 * j + 1][0], st[2 * j + 1][1]),
                              pack_bf16(st[2 * j + 1][2], st[2 * j + 1][3])};
      const unsigned sa[4] = {pack_bf16(dpt[2 * j][0], dpt[2 * j][1]), pack_bf16(dpt[2 * j][2], dpt[2 * j][3]),
                              pack_bf16(dpt[2 * j + 1][0], dpt[2 * j + 1][1]),
                              pack_bf16(dpt[2 * j + 1][2], dpt[2 * j + 1][3])};
#pragma unroll
      for (int dt = 0; dt < D / 8; dt += 2) {
        unsigned bd[4], bq[4];
        ldmatrix_x4_trans(bd, tdy + swz<D>(16 * j + (mi & 1) * 8 + (lane & 7), dt + (mi >> 1)));
        ldmatrix_x4_trans(bq, tq + swz<D>(16 * j + (mi & 1) * 8 + (lane & 7), dt + (mi >> 1)));
        mma_bf16(dva[dt], pa, bd[0], bd[1]);
        mma_bf16(dva[dt + 1], pa, bd[2], bd[3]);
        mma_bf16(dka[dt], sa, bq[0], bq[1]);
        mma_bf16(dka[dt + 1], sa, bq[2], bq[3]);
      }
    }
    // dS into shared memory, queries as rows.
#pragma unroll
    for (int nt = 0; nt < QT / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * t + (e & 1), kc = warp * 16 + g + 8 * (e >> 1);
        sds[swz<kKeys>(qc, kc >> 3) + (kc & 7)] = __float2bfloat16(dpt[nt][e]);
      }
    __syncthreads();
    // dQ[QT, D] += scale · dS K: warps split the rows in 16-row groups and, when QT < 64, the columns.
    constexpr int kGroups = QT / 16, kCols = D / (4 / kGroups);
    const int rg = warp % kGroups, c0 = (warp / kGroups) * kCols;
    float dqa[kCols / 8][4] = {};
#pragma unroll
    for (int j = 0; j < kKeys / 16; ++j) {
      unsigned da[4];
      ldmatrix_x4(da, sds + swz<kKeys>(rg * 16 + (lane & 15), 2 * j + (lane >> 4)));
#pragma unroll
      for (int dt = 0; dt < kCols / 8; dt += 2) {
        unsigned bk[4];
        ldmatrix_x4_trans(bk, sk + swz<D>(16 * j + (mi & 1) * 8 + (lane & 7), c0 / 8 + dt + (mi >> 1)));
        mma_bf16(dqa[dt], da, bk[0], bk[1]);
        mma_bf16(dqa[dt + 1], da, bk[2], bk[3]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t qi = i0 + rg * 16 + g + 8 * r;
      if (qi >= a.Tq) continue;
      float* dqr = dq + ((int64_t(b) * a.Tq + qi) * a.H + h) * D + c0 + 2 * t;
#pragma unroll
      for (int dt = 0; dt < kCols / 8; ++dt) {
        atomicAdd(dqr + dt * 8, dqa[dt][2 * r] * a.scale);
        atomicAdd(dqr + dt * 8 + 1, dqa[dt][2 * r + 1] * a.scale);
      }
    }
    // No closing barrier: the next tile's loads go to the other buffer, whose last reads came
    // before this tile's middle barrier; sds is next written after the next tile's first barrier.
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = k0 + warp * 16 + g + 8 * r;
    if (key >= a.S) continue;
    const int64_t off = ((int64_t(b) * a.S + key) * a.H + h) * D + 2 * t;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      float2* pk = reinterpret_cast<float2*>(dk + off + dt * 8);
      float2* pv = reinterpret_cast<float2*>(dv + off + dt * 8);
      const float2 ok = *pk, ov = *pv;
      *pk = make_float2(ok.x + dka[dt][2 * r] * a.scale, ok.y + dka[dt][2 * r + 1] * a.scale);
      *pv = make_float2(ov.x + dva[dt][2 * r], ov.y + dva[dt][2 * r + 1]);
    }
  }
}

template <int D, int QT>
void launch_bwd(const void* q, const void* k, const void* v, const float* lse, const float* Drow, const void* dy,
                float* dq, float* dk, float* dv, const AttnShape& a) {
  const size_t smem = (2 * size_t(kKeys) * D + 4 * size_t(QT) * D + size_t(QT) * kKeys) * sizeof(__nv_bfloat16) +
                      4 * size_t(QT) * sizeof(float);
  auto kernel = bwd_mma_kernel<D, QT>;
  K3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned((a.S + kKeys - 1) / kKeys), unsigned(a.H), unsigned(a.B));
  kernel<<<grid, 128, smem, device::stream()>>>(
      static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(k),
      static_cast<const __nv_bfloat16*>(v), lse, Drow, static_cast<const __nv_bfloat16*>(dy), dq, dk, dv, a);
  K3_CUDA_LAUNCHED();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

bool attention_forward_mma(const void* q, const void* k, const void* v, void* y, float* lse, const AttnShape& a) {
  if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(y)) return false;
  if (a.hd == 64 && a.hdv == 64) return launch_wgmma<64, 64>(q, k, v, y, lse, a), true;
  if (a.hd == 128 && a.hdv == 128) return launch_wgmma<128, 128>(q, k, v, y, lse, a), true;
  if (a.hd == 192 && a.hdv == 128) return launch_wgmma<192, 128>(q, k, v, y, lse, a), true;  // MLA prefill
  return false;
}

bool attention_backward_mma(const void* q, const void* k, const void* v, const float* lse, const float* D,
                            const void* dy, float* dq, float* dk, float* dv, const AttnShape& a) {
  if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(dy) || !aligned16(dk) || !aligned16(dv))
    return false;
  if (a.hd == 64 && a.hdv == 64) return launch_bwd<64, 64>(q, k, v, lse, D, dy, dq, dk, dv, a), true;
  if (a.hd == 128 && a.hdv == 128) return launch_bwd<128, 32>(q, k, v, lse, D, dy, dq, dk, dv, a), true;
  return false;
}

}  // namespace k3::cuda
