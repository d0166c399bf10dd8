// Causal softmax attention on Hopper's warpgroup MMA (wgmma, sm_90a) for bf16 storage, fp32
// accumulation and softmax, forward and backward on FlashAttention's schedule (a block walks the
// other operand's tiles). Tiles reach shared memory by tensor copies (the TMA) in the 128-byte
// swizzle the wgmma descriptors name. An accumulator tile holds, per thread, two rows (g and
// g + 8, g = lane / 4) of each 8-column block: the 4 lanes of a quad share those rows, and the
// layout of two adjacent 8-column blocks, rounded to bf16, is the A-operand layout of one 16-wide
// k step, so P and dS feed the next product from registers. The softmax runs in base 2 (exp2 of
// scores prescaled by scale·log2 e); lse is written in natural log as the SIMT kernel does.
#include <cudaTypedefs.h>

#include <cfloat>

#include "core/cuda_util.cuh"
#include "ops/attention_mma_cuda.h"

namespace k3::cuda {
namespace {

using device::pin;
using device::smem_desc_at;
using device::smem_desc_lo;
using device::wg_commit;
using device::wg_fence;
using device::wg_wait0;
using device::wg_wait1;

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const unsigned*>(&v);
}

// Forward on Hopper's warpgroup MMA (wgmma, sm_90a): a block of 2 warpgroups takes 128 queries,
// 64 per warpgroup, and walks tiles of KEYS keys. S = Q Kᵀ reads both operands from shared memory
// through matrix descriptors (m64nKEYSk16 per 16 dimensions); O += P V takes P from registers (the
// accumulator layout of S, rounded to bf16, is wgmma's A-fragment layout) and V from shared memory
// transposed (V's rows are keys, so its N dimension, the value columns, is the contiguous one).
// Tiles are stored in the 128-byte swizzle the descriptors name: 64-column panels of 128-byte
// rows, 16-byte chunk c of row r at c ^ (r mod 8), each panel 1024-byte aligned, which is the
// layout the TMA writes a box of 64 columns in with CU_TENSOR_MAP_SWIZZLE_128B. So Q and the key
// and value tiles arrive by tensor copies (one thread issues a tile's boxes; no thread computes
// an address), into a ring of STAGES stages, each with an mbarrier the copies complete. A stage
// is refilled by the last of the 8 warps to finish with it (a counter per stage): no block-wide
// barrier in the loop, so the warpgroups drift apart and overlap each other's softmax. Each
// warpgroup also overlaps the next tile's scores with this tile's P V (FlashAttention-3's
// intra-warpgroup schedule; the loop's comments say how). Rows past the tensor's end (queries
// past Tq, keys past S) arrive as zeros from the TMA and are masked or not written.
constexpr int kWgRows = 64;  // queries per warpgroup

struct FwdMaps {
  CUtensorMap q, k, v;  // [B, T, H, d] bf16 as 4-D maps (d, H, T, B), boxes of 64 × 1 × rows × 1
};

#define K3_WG_D32                                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define K3_WG_D40                                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define K3_WG_D64                                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "   \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define K3_WG_OUT32(d, o)                                                                                       \
  "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]),             \
      "+f"(d[o + 6]), "+f"(d[o + 7]), "+f"(d[o + 8]), "+f"(d[o + 9]), "+f"(d[o + 10]), "+f"(d[o + 11]),       \
      "+f"(d[o + 12]), "+f"(d[o + 13]), "+f"(d[o + 14]), "+f"(d[o + 15]), "+f"(d[o + 16]), "+f"(d[o + 17]),   \
      "+f"(d[o + 18]), "+f"(d[o + 19]), "+f"(d[o + 20]), "+f"(d[o + 21]), "+f"(d[o + 22]), "+f"(d[o + 23]),   \
      "+f"(d[o + 24]), "+f"(d[o + 25]), "+f"(d[o + 26]), "+f"(d[o + 27]), "+f"(d[o + 28]), "+f"(d[o + 29]),   \
      "+f"(d[o + 30]), "+f"(d[o + 31])

// d (+)= A B, m64nNk16 with N = 2·(d's size) (80 or 128): A and B K-major in shared memory.
// accumulate 0 overwrites d.
__device__ __forceinline__ void wgmma_ss(float (&d)[40], uint64_t da, uint64_t db, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 " K3_WG_D40 ", %40, %41, p, 1, 1, 0, 0;\n}\n"
      : K3_WG_OUT32(d, 0), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
        "+f"(d[38]), "+f"(d[39])
      : "l"(da), "l"(db), "r"(accumulate));
#else
  __trap();
#endif
}
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " K3_WG_D64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
      : K3_WG_OUT32(d, 0), K3_WG_OUT32(d, 32)
      : "l"(da), "l"(db), "r"(accumulate));
#else
  __trap();
#endif
}
// d += A B, m64n64k16: A in registers (the mma.sync A-fragment layout per warp), B MN-major.
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const unsigned (&a)[4], uint64_t db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " K3_WG_D32
      ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : K3_WG_OUT32(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
#else
  __trap();
#endif
}

// d (+)= A B, m64n64k16 from shared memory; TA / TB: 0 K-major, 1 MN-major.
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss64(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " K3_WG_D32 ", %32, %33, p, 1, 1, %35, %36;\n}\n"
      : K3_WG_OUT32(d, 0)
      : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB));
#else
  __trap();
#endif
}

// d (+)= A B, m64n64k16 (64-key tiles), both K-major.
__device__ __forceinline__ void wgmma_ss(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  wgmma_ss64<0, 0>(d, da, db, accumulate);
}

// Tile shapes: 128-key tiles and a 3-stage ring where shared memory holds them (hd ≤ 128);
// MLA's 192-column keys take 80-key tiles (3 stages of 128 keys would not fit; 80 rows of 128
// bytes keep every panel 1024-byte aligned). 64-key tiles (hd 64, short sequences) take a 4-stage
// ring and fit two blocks an SM (registers and shared memory).
constexpr int64_t kShortKeys = 2048;  // keys up to which hd 64 takes 64-key tiles

template <int DK, int DV, int KEYS = (DK <= 128 ? 128 : 80)>
struct FwdTiles {
  static constexpr int kKeys = KEYS;
  static constexpr int kStages = KEYS == 64 ? 4 : 3;
  static constexpr int kBlocksPerSM = KEYS == 64 ? 2 : 1;
  static constexpr int kRows = 2 * kWgRows;
  static constexpr unsigned kStageBytes = unsigned(kKeys) * (DK + DV) * 2;
  static constexpr size_t kSmem = size_t(kRows) * DK * 2 + kStages * size_t(kStageBytes) + 1024;
  // The barriers take ~1 KB of static shared memory beside it (1,072 bytes as built).
  static_assert(kSmem + 2048 <= 227 * 1024, "the ring and the barriers must fit in shared memory");
};

// The counter's previous value, the increment ordered after this thread's earlier accesses and
// before its later ones (acq_rel), so the warp that sees the last release and refills the stage
// is ordered after every warp's use of it.
__device__ __forceinline__ unsigned count_release(unsigned* counter) {
  unsigned old;
  asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;\n"
               : "=r"(old)
               : "r"(device::smem_u32(counter))
               : "memory");
  return old;
}

template <int DK, int DV, int KEYS>
__global__ void __launch_bounds__(256, FwdTiles<DK, DV, KEYS>::kBlocksPerSM)
    fwd_wgmma_kernel(const __grid_constant__ FwdMaps maps, __nv_bfloat16* __restrict__ y, float* __restrict__ lse,
                     AttnShape a) {
  using Tiles = FwdTiles<DK, DV, KEYS>;
  constexpr int kTileKeys = Tiles::kKeys, kStages = Tiles::kStages, kRows = Tiles::kRows;
  static_assert(DK % 64 == 0 && DV % 64 == 0, "64-column panels");
  static_assert(kTileKeys % 16 == 0, "16-key steps of P V; panels of 1024-byte multiples");
  extern __shared__ unsigned char smem_raw[];
  __shared__ uint64_t full[kStages], q_full;
  __shared__ unsigned released[kStages];  // warps done with the stage, over its fills
  // Panels must start on 1024-byte boundaries (the swizzle's period): align the base.
  const uint32_t raw = unsigned(__cvta_generic_to_shared(smem_raw));
  __nv_bfloat16* sq = reinterpret_cast<__nv_bfloat16*>(smem_raw + ((1024 - (raw & 1023)) & 1023));  // [kRows][DK]
  __nv_bfloat16* sk = sq + kRows * DK;            // [kStages][kTileKeys][DK]
  __nv_bfloat16* sv = sk + kStages * kTileKeys * DK;  // [kStages][kTileKeys][DV]

  // The grid is flat, query tiles slowest and last tiles (the most keys) first over every head and
  // sequence, so the last wave holds the lightest tiles rather than a head's heaviest.
  const int heads = int(a.H * a.B), ntq = int((a.Tq + kRows - 1) / kRows);
  const int q0 = (ntq - 1 - int(blockIdx.x) / heads) * kRows;
  const int h = int(blockIdx.x) % heads % int(a.H), b = int(blockIdx.x) % heads / int(a.H);
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2,
            t = lane & 3;
  const int64_t last_key = a.pos0 + min64(q0 + kRows, a.Tq) - 1;
  const int ntiles = int(last_key / kTileKeys) + 1;
  // Tile j lives in stage j mod kStages: fill j / kStages of that stage's barrier.
  auto load_kv = [&](int tile) {  // one thread
    const int st = tile % kStages, k0 = tile * kTileKeys;
    device::mbar_arrive_expect_tx(&full[st], Tiles::kStageBytes);
#pragma unroll
    for (int p = 0; p < DK / 64; ++p)
      device::tma_load_4d(sk + (st * DK + p * 64) * kTileKeys, &maps.k, p * 64, h, k0, b, &full[st]);
#pragma unroll
    for (int p = 0; p < DV / 64; ++p)
      device::tma_load_4d(sv + (st * DV + p * 64) * kTileKeys, &maps.v, p * 64, h, k0, b, &full[st]);
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) device::mbar_init(&full[s], 1), released[s] = 0;
    device::mbar_init(&q_full, 1);
    device::fence_mbar_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    device::mbar_arrive_expect_tx(&q_full, unsigned(kRows) * DK * 2);
#pragma unroll
    for (int p = 0; p < DK / 64; ++p) device::tma_load_4d(sq + p * kRows * 64, &maps.q, p * 64, h, q0, b, &q_full);
    for (int j = 0; j < kStages && j < ntiles; ++j) load_kv(j);
  }

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
  float s[kTileKeys / 2];
  unsigned pa[kTileKeys / 16][4];

  // Descriptors' low words (smem_desc_at adds constant byte offsets): Q's panels, the key and
  // value stages.
  const uint32_t d_q = smem_desc_lo(wq, 16), d_k = smem_desc_lo(sk, 16), d_v = smem_desc_lo(sv, kTileKeys * 128);
  auto issue_scores = [&](int tile) {  // s = Q K_tileᵀ, asynchronously
    // Both descriptors advance in place (32 bytes a k-step, then to the next panel): one 64-bit
    // add per operand and product.
    uint64_t da = smem_desc_at(d_q, 0), db = smem_desc_at(d_k + (tile % kStages) * (kTileKeys * DK * 2 / 16), 0);
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk) {
      wgmma_ss(s, da, db, kk > 0);
      if ((kk & 3) < 3) {
        da += 2, db += 2;
      } else {
        da += (kRows * 64 * 2 - 96) >> 4, db += (kTileKeys * 64 * 2 - 96) >> 4;
      }
    }
    wg_commit();
  };
  // Mask, online softmax of tile `tile`'s scores in s: s becomes P (fp32), corr the factor the
  // accumulator must take before P V is added.
  auto softmax = [&](int tile) {
    const int64_t k0 = int64_t(tile) * kTileKeys;
    if (k0 + kTileKeys - 1 > a.pos0 + q0 + wg * kWgRows) {
#pragma unroll
      for (int nt = 0; nt < kTileKeys / 8; ++nt)
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
      for (int nt = 0; nt < kTileKeys / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt * 4 + 2 * r], s[nt * 4 + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx * sl2);
      mref[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet: p = 0, no NaN
      corr[r] = exp2f(m[r] - mref[r]);
      m[r] = m_new;
      l[r] *= corr[r];
    }
#pragma unroll
    for (int i = 0; i < kTileKeys / 2; ++i) {
      const float pv = exp2f(fmaf(s[i], sl2, -mref[(i >> 1) & 1]));
      s[i] = pv;
      l[(i >> 1) & 1] += pv;
    }
  };
  auto pack_p = [&] {
#pragma unroll
    for (int j = 0; j < kTileKeys / 16; ++j) {
      pa[j][0] = pack_bf16(s[8 * j + 0], s[8 * j + 1]);
      pa[j][1] = pack_bf16(s[8 * j + 2], s[8 * j + 3]);
      pa[j][2] = pack_bf16(s[8 * j + 4], s[8 * j + 5]);
      pa[j][3] = pack_bf16(s[8 * j + 6], s[8 * j + 7]);
    }
  };

  device::mbar_wait(&q_full, 0);
  device::mbar_wait(&full[0], 0);
  pin(s);
  wg_fence();
  issue_scores(0);
  wg_wait0();
  pin(s);
  softmax(0);
  pack_p();

  auto issue_pv = [&](int tile) {  // o += P V_tile, asynchronously
    const uint32_t dv = d_v + (tile % kStages) * (kTileKeys * DV * 2 / 16);
#pragma unroll
    for (int j = 0; j < kTileKeys / 16; ++j)
#pragma unroll
      for (int p = 0; p < DV / 64; ++p)  // keys [16j, 16j + 16) of value panel p
        wgmma_rs(o[p], pa[j], smem_desc_at(dv, (p * kTileKeys * 64 + j * 16 * 64) * 2));
    wg_commit();
  };
  // Tile j < last: the scores of tile j + 1 are computed while P_j V_j runs, and their softmax
  // while the tensor cores finish it; the accumulator takes the new factor once P_j V_j is in.
  // (The last tile is peeled off, so every pass commits the same two groups.)
  for (int tile = 0; tile + 1 < ntiles; ++tile) {
    device::mbar_wait(&full[(tile + 1) % kStages], unsigned((tile + 1) / kStages) & 1u);  // tile + 1 landed
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
    // This warp is done with stage tile mod kStages (K read by the scores last pass, V now); the
    // last of the 8 warps refills it with tile + kStages.
    if (lane == 0 && (count_release(&released[tile % kStages]) & 7u) == 7u && tile + kStages < ntiles)
      load_kv(tile + kStages);
    __syncwarp();
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

// cuTensorMapEncodeTiled, from the driver through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    K3_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || !f)
      throw error("attention", "the CUDA driver has no cuTensorMapEncodeTiled (tensor copies need CUDA 12 or later)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A [B, T, H, d] bf16 array, its T rows ld elements apart (H·d: contiguous; more: the heads are a
// column block of wider rows, as q, k and v in a fused projection's output), as the 4-D map
// (d, H, T, B) with boxes of 64 columns × `rows` rows of one head, 128-byte swizzled; reads past T
// (or any edge) give zeros.
CUtensorMap head_rows_map(const void* base, int64_t B, int64_t T, int64_t H, int64_t d, int rows, int64_t ld) {
  CUtensorMap m;
  const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(H), cuuint64_t(T), cuuint64_t(B)};
  const cuuint64_t strides[3] = {cuuint64_t(d) * 2, cuuint64_t(ld) * 2, cuuint64_t(T * ld) * 2};
  const cuuint32_t box[4] = {64, 1, cuuint32_t(rows), 1}, unit[4] = {1, 1, 1, 1};
  const CUresult r = tensor_map_encoder()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(base), dims,
                                          strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw error("attention", "cuTensorMapEncodeTiled failed (CUresult ", int(r), ") for a [", B, ", ", T, ", ", H, ", ",
                d, "] bf16 array");
  return m;
}

template <int DK, int DV, int KEYS = (DK <= 128 ? 128 : 80)>
void launch_wgmma(const void* q, const void* k, const void* v, void* y, float* lse, const AttnShape& a,
                  const QkvRows& ld) {
  using Tiles = FwdTiles<DK, DV, KEYS>;
  const FwdMaps maps{head_rows_map(q, a.B, a.Tq, a.H, DK, Tiles::kRows, ld.q),
                     head_rows_map(k, a.B, a.S, a.H, DK, Tiles::kKeys, ld.k),
                     head_rows_map(v, a.B, a.S, a.H, DV, Tiles::kKeys, ld.v)};
  auto kernel = fwd_wgmma_kernel<DK, DV, KEYS>;
  K3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Tiles::kSmem)));
  const int64_t blocks = (a.Tq + Tiles::kRows - 1) / Tiles::kRows * a.H * a.B;
  kernel<<<unsigned(blocks), 256, Tiles::kSmem, device::stream()>>>(maps, static_cast<__nv_bfloat16*>(y), lse, a);
  K3_CUDA_LAUNCHED();
}

// Backward on wgmma: one warpgroup per (64 keys, head, sequence), walking 64-query tiles (Q and
// dY by tensor copies into a 2-stage ring, lse and D = Σ dy·y beside them) from the first query
// that sees its keys to the last. Keys are the rows of every product the block keeps, so dK and
// dV stay in registers for the whole walk:
//   Sᵀ = K Qᵀ, dPᵀ = V dYᵀ       (both operands K-major in shared memory, m64n64k16)
//   Pᵀ = exp(Sᵀ − lse), dSᵀ = Pᵀ ∘ (dPᵀ − D)
//   dV += Pᵀ dY, dK += dSᵀ Q     (Pᵀ and dSᵀ from registers: the accumulator layout rounded to
//                                 bf16 is the A fragment; dY and Q MN-major, as V in the forward)
//   dQ = dS K                    (dSᵀ through shared memory, keys as rows: A MN-major, K MN-major)
// and dQ is added to global memory atomically, two columns per add (FlashAttention-2's scheme).
// A stage is refilled by the last of the 4 warps done with it, as in the forward.
constexpr int kBwdRows = 64;  // keys per block, queries per tile

struct BwdMaps {
  CUtensorMap q, k, v, dy;  // [B, T, H, d] bf16 as 4-D maps (d, H, T, B), boxes of 64 × 1 × 64 × 1
};

// dSᵀ is written by each warp's stores and read by the whole warpgroup's dQ product, whose wait
// in one warp says nothing of the others' share: the next tile's stores must not start before
// every warp's dQ is done. At hd 64 dSᵀ alternates between two buffers (a warp writing buffer
// it mod 2 has passed tile it − 1's barrier, which each warp reaches after its dQ of tile it − 2
// is in); at hd 128 a second buffer would cost the second block an SM holds, so a barrier before
// the stores stands in.
template <int D>
struct BwdTiles {
  static constexpr int kPanels = D / 64;
  static constexpr int kDsBufs = D <= 64 ? 2 : 1;
  static constexpr unsigned kTileBytes = unsigned(kBwdRows) * D * 2;  // one 64-row tile of D columns
  static constexpr unsigned kDsBytes = unsigned(kBwdRows) * kBwdRows * 2;
  static constexpr size_t kSmem = 2 * size_t(kTileBytes) /* K, V */ + 4 * size_t(kTileBytes) /* 2 stages of Q, dY */ +
                                  kDsBufs * size_t(kDsBytes) /* dSᵀ */ + 1024;
  // Two blocks an SM: each takes its dynamic and static shared memory and 1 KB the system keeps.
  static_assert(2 * (kSmem + 2048) <= 228 * 1024, "two blocks' tiles and barriers must fit in an SM");
};

template <int D>
__global__ void __launch_bounds__(128, D <= 64 ? 3 : 2) bwd_wgmma_kernel(const __grid_constant__ BwdMaps maps,
                                                           const float* __restrict__ lse,
                                                           const float* __restrict__ Drow, const AttnGrads o,
                                                           AttnShape a) {
  using Tiles = BwdTiles<D>;
  constexpr int kP = Tiles::kPanels, kN = kBwdRows;
  constexpr unsigned kPanelBytes = kN * 128;  // one 64-column panel of a 64-row tile
  extern __shared__ unsigned char smem_raw[];
  __shared__ uint64_t full[2], kv_full;
  __shared__ unsigned released[2];
  __shared__ float slse[2][kN], sdd[2][kN];  // per stage: lse (log2 units) and D of the tile's queries
  const uint32_t raw = unsigned(__cvta_generic_to_shared(smem_raw));
  __nv_bfloat16* sk = reinterpret_cast<__nv_bfloat16*>(smem_raw + ((1024 - (raw & 1023)) & 1023));
  __nv_bfloat16* sv = sk + kN * D;
  __nv_bfloat16* sq = sv + kN * D;    // stage s: Q at sq + 2s·kN·D, dY right after it
  __nv_bfloat16* sds = sq + 4 * kN * D;  // dSᵀ [keys][queries], kDsBufs of them

  // A flat grid, key blocks slowest: the first keys (the most queries) first over every head and
  // sequence, the lightest blocks in the last wave.
  const int heads = int(a.H * a.B);
  const int64_t k0 = int64_t(blockIdx.x / unsigned(heads)) * kN;
  const int h = int(blockIdx.x) % heads % int(a.H), b = int(blockIdx.x) % heads / int(a.H);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t i_first = (k0 > a.pos0 ? k0 - a.pos0 : 0) / kN * kN;
  if (i_first >= a.Tq) {  // keys no query sees: nothing to add, zeros to write when not adding
    if (o.dk_b)
      for (int e = threadIdx.x; e < kN * D; e += blockDim.x) {
        const int64_t row = k0 + e / D;
        if (row >= a.S) break;
        const int64_t off = (int64_t(b) * a.S + row) * o.ld_b + int64_t(h) * D + e % D;
        static_cast<__nv_bfloat16*>(o.dk_b)[off] = __float2bfloat16(0.0f);
        static_cast<__nv_bfloat16*>(o.dv_b)[off] = __float2bfloat16(0.0f);
      }
    else if (!o.accumulate_kv)
      for (int e = threadIdx.x; e < kN * D; e += blockDim.x) {
        const int64_t row = k0 + e / D;
        if (row >= a.S) break;
        const int64_t off = ((int64_t(b) * a.S + row) * a.H + h) * D + e % D;
        o.dk[off] = 0.0f, o.dv[off] = 0.0f;
      }
    return;
  }
  const int ntiles = int((a.Tq - i_first + kN - 1) / kN);
  const float sl2 = a.scale * kLog2e;
  const int64_t lse_row = (int64_t(b) * a.H + h) * a.Tq;

  auto load_stage = [&](int tile) {  // one thread: Q and dY of query tile `tile` into its stage
    const int st = tile & 1, i0 = int(i_first) + tile * kN;
    __nv_bfloat16* dst = sq + st * 2 * kN * D;
    device::mbar_arrive_expect_tx(&full[st], 2 * Tiles::kTileBytes);
#pragma unroll
    for (int p = 0; p < kP; ++p) {
      device::tma_load_4d(dst + p * kN * 64, &maps.q, p * 64, h, i0, b, &full[st]);
      device::tma_load_4d(dst + kN * D + p * kN * 64, &maps.dy, p * 64, h, i0, b, &full[st]);
    }
  };
  // Thread x's share of a tile's lse and D: x < 64 the lse of query x (log2 units; +inf past the
  // end, so p = 0 there), else D of query x − 64.
  auto row_value = [&](int tile) {
    const int r = threadIdx.x & (kN - 1);
    const int64_t qi = i_first + int64_t(tile) * kN + r;
    if (qi >= a.Tq) return threadIdx.x < kN ? INFINITY : 0.0f;
    return threadIdx.x < kN ? lse[lse_row + qi] * kLog2e : Drow[lse_row + qi];
  };
  auto put_row_value = [&](int st, float x) {
    (threadIdx.x < kN ? slse[st] : sdd[st])[threadIdx.x & (kN - 1)] = x;
  };
  if (threadIdx.x == 0) {
    device::mbar_init(&full[0], 1), device::mbar_init(&full[1], 1), device::mbar_init(&kv_full, 1);
    released[0] = released[1] = 0;
    device::fence_mbar_init();
  }
  put_row_value(0, row_value(0));
  __syncthreads();
  if (threadIdx.x == 0) {
    device::mbar_arrive_expect_tx(&kv_full, 2 * Tiles::kTileBytes);
#pragma unroll
    for (int p = 0; p < kP; ++p) {
      device::tma_load_4d(sk + p * kN * 64, &maps.k, p * 64, h, int(k0), b, &kv_full);
      device::tma_load_4d(sv + p * kN * 64, &maps.v, p * 64, h, int(k0), b, &kv_full);
    }
    load_stage(0);
    if (ntiles > 1) load_stage(1);
  }

  float dka[kP][32], dva[kP][32];
#pragma unroll
  for (int p = 0; p < kP; ++p)
#pragma unroll
    for (int i = 0; i < 32; ++i) dka[p][i] = dva[p][i] = 0.0f;
  const uint32_t d_k = smem_desc_lo(sk, kPanelBytes), d_v = smem_desc_lo(sv, kPanelBytes),
                 d_q = smem_desc_lo(sq, kPanelBytes), d_ds = smem_desc_lo(sds, kPanelBytes);
  const int64_t key_row[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
  device::mbar_wait(&kv_full, 0);

  for (int it = 0; it < ntiles; ++it) {
    const int st = it & 1;
    const int64_t i0 = i_first + int64_t(it) * kN;
    const float next = it + 1 < ntiles ? row_value(it + 1) : 0.0f;  // in flight during the tile
    const uint32_t q_off = st * 2 * Tiles::kTileBytes, dy_off = q_off + Tiles::kTileBytes;
    device::mbar_wait(&full[st], unsigned(it >> 1) & 1u);

    // Sᵀ = K Qᵀ and dPᵀ = V dYᵀ: k-steps of 16 dims, 32 bytes apart in a panel.
    float s[32], dp[32];
    pin(s), pin(dp);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t off = (kk >> 2) * kPanelBytes + (kk & 3) * 32;
      wgmma_ss64<0, 0>(s, smem_desc_at(d_k, off), smem_desc_at(d_q, q_off + off), kk > 0);
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t off = (kk >> 2) * kPanelBytes + (kk & 3) * 32;
      wgmma_ss64<0, 0>(dp, smem_desc_at(d_v, off), smem_desc_at(d_q, dy_off + off), kk > 0);
    }
    wg_commit();
    wg_wait0();
    pin(s), pin(dp);

    // Pᵀ and dSᵀ (before the scale): element e of column block nt is key row (e / 2), query
    // nt·8 + 2t + e mod 2.
    const bool diag = k0 + kN - 1 > a.pos0 + i0;  // some key of the block is past some query
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * t + (e & 1);
        float p = exp2f(fmaf(s[nt * 4 + e], sl2, -slse[st][qc]));
        if (diag && key_row[e >> 1] > a.pos0 + i0 + qc) p = 0.0f;
        s[nt * 4 + e] = p;
        dp[nt * 4 + e] = p * (dp[nt * 4 + e] - sdd[st][qc]);
      }
    unsigned pa[4][4], sa[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        pa[j][r] = pack_bf16(s[8 * j + 2 * r], s[8 * j + 2 * r + 1]);
        sa[j][r] = pack_bf16(dp[8 * j + 2 * r], dp[8 * j + 2 * r + 1]);
      }
    // dV += Pᵀ dY, dK += dSᵀ Q: 16 queries a k-step, the rows of dY and Q (MN-major B).
#pragma unroll
    for (int p = 0; p < kP; ++p) pin(dka[p]), pin(dva[p]);
    wg_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int p = 0; p < kP; ++p) {
        const uint32_t off = p * kPanelBytes + j * 16 * 128;
        wgmma_rs(dva[p], pa[j], smem_desc_at(d_q, dy_off + off));
        wgmma_rs(dka[p], sa[j], smem_desc_at(d_q, q_off + off));
      }
    wg_commit();
    // dSᵀ to shared memory as bf16, keys as rows (128-byte swizzled rows of 64 queries).
    const int ds_buf = Tiles::kDsBufs == 2 ? it & 1 : 0;
    if (Tiles::kDsBufs == 1 && it > 0) __syncthreads();  // every warp's dQ of the last tile is in
    __nv_bfloat16* tds = sds + ds_buf * kN * kN;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int kr = warp * 16 + g + 8 * r;
        *reinterpret_cast<unsigned*>(tds + kr * 64 + ((nt ^ (kr & 7)) << 3) + 2 * t) =
            pack_bf16(dp[nt * 4 + 2 * r], dp[nt * 4 + 2 * r + 1]);
      }
    if (it + 1 < ntiles) put_row_value(st ^ 1, next);
    device::fence_proxy_async();
    __syncthreads();
    // dQ = dS K: A = dSᵀ's rows MN-major (queries contiguous), B = K's rows MN-major; 16 keys a step.
    float dqa[kP][32];
#pragma unroll
    for (int p = 0; p < kP; ++p) pin(dqa[p]);
    wg_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int p = 0; p < kP; ++p)
        wgmma_ss64<1, 1>(dqa[p], smem_desc_at(d_ds, ds_buf * Tiles::kDsBytes + j * 16 * 128),
                         smem_desc_at(d_k, p * kPanelBytes + j * 16 * 128), j > 0);
    wg_commit();
    wg_wait0();
#pragma unroll
    for (int p = 0; p < kP; ++p) pin(dqa[p]), pin(dka[p]), pin(dva[p]);
    // Done with this stage's Q and dY: the last warp refills it with tile it + 2.
    if (lane == 0 && (count_release(&released[st]) & 3u) == 3u && it + 2 < ntiles) load_stage(it + 2);
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t qi = i0 + warp * 16 + g + 8 * r;
      if (qi >= a.Tq) continue;
      float* dqr = o.dq + ((int64_t(b) * a.Tq + qi) * a.H + h) * D + 2 * t;
#pragma unroll
      for (int p = 0; p < kP; ++p)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          atomicAdd(reinterpret_cast<float2*>(dqr + p * 64 + nt * 8),
                    make_float2(dqa[p][nt * 4 + 2 * r] * a.scale, dqa[p][nt * 4 + 2 * r + 1] * a.scale));
    }
  }
#pragma unroll
  for (int p = 0; p < kP; ++p)
#pragma unroll
    for (int i = 0; i < 32; ++i) dka[p][i] *= a.scale;
  if (o.dk_b) {  // bf16 rows of the packed gradient, written over
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (key_row[r] >= a.S) continue;
      const int64_t off = (int64_t(b) * a.S + key_row[r]) * o.ld_b + int64_t(h) * D + 2 * t;
#pragma unroll
      for (int p = 0; p < kP; ++p)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int c = p * 64 + nt * 8;
          *reinterpret_cast<unsigned*>(static_cast<__nv_bfloat16*>(o.dk_b) + off + c) =
              pack_bf16(dka[p][nt * 4 + 2 * r], dka[p][nt * 4 + 2 * r + 1]);
          *reinterpret_cast<unsigned*>(static_cast<__nv_bfloat16*>(o.dv_b) + off + c) =
              pack_bf16(dva[p][nt * 4 + 2 * r], dva[p][nt * 4 + 2 * r + 1]);
        }
    }
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (key_row[r] >= a.S) continue;
      const int64_t off = ((int64_t(b) * a.S + key_row[r]) * a.H + h) * D + 2 * t;
#pragma unroll
      for (int p = 0; p < kP; ++p)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          float2* pk = reinterpret_cast<float2*>(o.dk + off + p * 64 + nt * 8);
          float2* pv = reinterpret_cast<float2*>(o.dv + off + p * 64 + nt * 8);
          const float2 ok = o.accumulate_kv ? *pk : make_float2(0.0f, 0.0f),
                       ov = o.accumulate_kv ? *pv : make_float2(0.0f, 0.0f);
          *pk = make_float2(ok.x + dka[p][nt * 4 + 2 * r], ok.y + dka[p][nt * 4 + 2 * r + 1]);
          *pv = make_float2(ov.x + dva[p][nt * 4 + 2 * r], ov.y + dva[p][nt * 4 + 2 * r + 1]);
        }
    }
  }
  if (o.dbias_k) {  // the block's column sums of dK and dV (rows past S hold zeros: their P is 0)
#pragma unroll
    for (int p = 0; p < kP; ++p)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          // The warp's 16 rows: this thread's two, then the 8 lanes of the same t.
          float sk = dka[p][nt * 4 + e] + dka[p][nt * 4 + 2 + e], sv = dva[p][nt * 4 + e] + dva[p][nt * 4 + 2 + e];
#pragma unroll
          for (int x = 4; x < 32; x <<= 1)
            sk += __shfl_xor_sync(0xffffffffu, sk, x), sv += __shfl_xor_sync(0xffffffffu, sv, x);
          if (g == nt) {  // the 8 lanes of a t share the adds out
            const int c = h * D + p * 64 + nt * 8 + 2 * t + e;
            atomicAdd(o.dbias_k + c, sk), atomicAdd(o.dbias_v + c, sv);
          }
        }
  }
}

template <int D>
void launch_bwd(const void* q, const void* k, const void* v, const float* lse, const float* Drow, const void* dy,
                const AttnGrads& o, const AttnShape& a, const QkvRows& ld) {
  using Tiles = BwdTiles<D>;
  const BwdMaps maps{head_rows_map(q, a.B, a.Tq, a.H, D, kBwdRows, ld.q),
                     head_rows_map(k, a.B, a.S, a.H, D, kBwdRows, ld.k),
                     head_rows_map(v, a.B, a.S, a.H, D, kBwdRows, ld.v),
                     head_rows_map(dy, a.B, a.Tq, a.H, D, kBwdRows, a.H * D)};
  auto kernel = bwd_wgmma_kernel<D>;
  K3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Tiles::kSmem)));
  const int64_t blocks = (a.S + kBwdRows - 1) / kBwdRows * a.H * a.B;
  kernel<<<unsigned(blocks), 128, Tiles::kSmem, device::stream()>>>(maps, lse, Drow, o, a);
  K3_CUDA_LAUNCHED();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// The tensor copies want 16-byte-aligned bases and row strides; a flat grid must fit in 2^31 blocks.
bool fits(const AttnShape& a, const QkvRows& ld, int rows) {
  const int64_t tiles = (std::max(a.Tq, a.S) + rows - 1) / rows;
  return ld.q % 8 == 0 && ld.k % 8 == 0 && ld.v % 8 == 0 && a.H * a.B <= INT32_MAX / std::max<int64_t>(tiles, 1);
}

}  // namespace

bool attention_forward_mma(const void* q, const void* k, const void* v, void* y, float* lse, const AttnShape& a,
                           const QkvRows* rows) {
  const QkvRows ld = rows ? *rows : QkvRows{a.H * a.hd, a.H * a.hd, a.H * a.hdv};
  if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(y) || !fits(a, ld, 64)) return false;
  // hd 64 over short sequences (S ≤ kShortKeys): 64-key tiles, 108 registers, two blocks an SM
  // (GPT-2's B 8 × T 1024: 0.055 ms against 0.067 with 128-key tiles at one block an SM); longer
  // ones keep 128-key tiles (T 8192: 0.364 ms against 0.376).
  if (a.hd == 64 && a.hdv == 64 && a.S <= kShortKeys) return launch_wgmma<64, 64, 64>(q, k, v, y, lse, a, ld), true;
  if (a.hd == 64 && a.hdv == 64) return launch_wgmma<64, 64>(q, k, v, y, lse, a, ld), true;
  if (a.hd == 128 && a.hdv == 128) return launch_wgmma<128, 128>(q, k, v, y, lse, a, ld), true;
  if (a.hd == 192 && a.hdv == 128) return launch_wgmma<192, 128>(q, k, v, y, lse, a, ld), true;  // MLA prefill
  return false;
}

bool attention_backward_mma(const void* q, const void* k, const void* v, const float* lse, const float* D,
                            const void* dy, const AttnGrads& o, const AttnShape& a, const QkvRows* rows) {
  const QkvRows ld = rows ? *rows : QkvRows{a.H * a.hd, a.H * a.hd, a.H * a.hdv};
  if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(dy) || !aligned16(o.dq) || !fits(a, ld, 64))
    return false;
  if (o.dk_b ? !aligned16(o.dk_b) || !aligned16(o.dv_b) || o.ld_b % 8 != 0 : !aligned16(o.dk) || !aligned16(o.dv))
    return false;
  if (a.hd == 64 && a.hdv == 64) return launch_bwd<64>(q, k, v, lse, D, dy, o, a, ld), true;
  if (a.hd == 128 && a.hdv == 128) return launch_bwd<128>(q, k, v, lse, D, dy, o, a, ld), true;
  return false;
}

}  // namespace k3::cuda
