// Causal softmax attention on the tensor cores (mma.sync m16n8k16, bf16 operands, fp32
// accumulation): FlashAttention-2's schedule for bf16 storage, forward and backward.
//
// Forward: a block takes 16·W queries of one (sequence, head), W warps of 16 rows each; keys and values
// stream through shared memory 64 at a time, double-buffered by cp.async (the next tile loads
// while this one is used). Each warp computes its [16, 64] scores S = Q Kᵀ with Q's fragments
// held in registers, updates the online softmax in the accumulator layout (a thread holds two
// rows, g and g + 8, of every 8-column tile: its quad of 4 lanes shares those rows), rounds
// P = exp(S − m) to bf16 in place (the accumulator layout of two adjacent 8-key tiles is the A
// operand's layout of one 16-key step) and accumulates O += P V. Rows of 16-byte chunks in shared
// memory are XOR-swizzled (chunk c of row r at c ^ (r mod 8)), so the 8 row addresses of an
// ldmatrix hit 8 different bank groups. The softmax runs in base 2 (exp2 of scores prescaled by
// scale·log2 e); lse is written in natural log as the SIMT kernel does.
#include <cfloat>

#include "core/cuda_util.cuh"
#include "ops/attention_mma_cuda.h"

namespace k3::cuda {
namespace {

constexpr int kKeys = 64;  // keys per tile
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ int64_t min64(int64_t x, int64_t y) { return x < y ? x : y; }

// 16 bytes global → shared; src_bytes 0 fills the chunk with zeros (rows past the sequence).
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  const unsigned a = unsigned(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
  const unsigned a = unsigned(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// c += a b: a the [16, 16] A fragment (row-major), b0/b1 the [16, 8] B fragment (k-major columns).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const unsigned*>(&v);
}

// Element offset of 16-byte chunk c of row r in a tile whose rows hold D bf16 values.
template <int D>
__device__ __forceinline__ int swz(int r, int c) {
  return r * D + ((c ^ (r & 7)) << 3);
}

// Rows [row0, row0 + n) of a [*, H, D] array (row stride H·D elements) into a swizzled tile;
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

template <int DK, int DV, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) fwd_mma_kernel(const __nv_bfloat16* __restrict__ q,
                                                             const __nv_bfloat16* __restrict__ k,
                                                             const __nv_bfloat16* __restrict__ v,
                                                             __nv_bfloat16* __restrict__ y, float* __restrict__ lse,
                                                             AttnShape a) {
  constexpr int kThreads = WARPS * 32, kRows = WARPS * 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* sq = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [kRows][DK]
  __nv_bfloat16* sk = sq + kRows * DK;                              // [2][kKeys][DK]
  __nv_bfloat16* sv = sk + 2 * kKeys * DK;                          // [2][kKeys][DV]

  // The heaviest query tiles (most keys under the causal mask) start first.
  const int64_t q0 = int64_t(gridDim.x - 1 - blockIdx.x) * kRows;
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t qstride = a.H * DK, vstride = a.H * DV;
  const __nv_bfloat16* kb = k + (int64_t(b) * a.S * a.H + h) * DK;
  const __nv_bfloat16* vb = v + (int64_t(b) * a.S * a.H + h) * DV;

  const int64_t last_key = a.pos0 + min64(q0 + kRows, a.Tq) - 1;  // the tile's last visible key
  const int ntiles = int(last_key / kKeys) + 1;
  auto load_kv = [&](int tile, int buf) {
    const int64_t k0 = int64_t(tile) * kKeys;
    const int valid = int(min64(kKeys, a.S - k0));
    load_tile<DK, kThreads>(sk + buf * kKeys * DK, kb + k0 * qstride, qstride, kKeys, valid);
    load_tile<DV, kThreads>(sv + buf * kKeys * DV, vb + k0 * vstride, vstride, kKeys, valid);
  };
  load_tile<DK, kThreads>(sq, q + ((int64_t(b) * a.Tq + q0) * a.H + h) * DK, qstride, kRows,
                          int(min64(kRows, a.Tq - q0)));
  load_kv(0, 0);
  device::cp_async_commit();

  unsigned qf[DK / 16][4];   // this warp's 16 query rows as A fragments, one per 16 dimensions
  float o[DV / 8][4] = {};   // output accumulator: 8-column tiles
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // rows g and g + 8 (log2 units for m)
  const float sl2 = a.scale * kLog2e;
  const int64_t row_q[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};

  for (int tile = 0; tile < ntiles; ++tile) {
    const int buf = tile & 1;
    if (tile + 1 < ntiles) {
      load_kv(tile + 1, buf ^ 1);  // the buffer the previous tile used: freed by its closing barrier
      device::cp_async_commit();
      device::cp_async_wait1();
    } else {
      device::cp_async_wait0();
    }
    __syncthreads();
    if (tile == 0) {
#pragma unroll
      for (int kk = 0; kk < DK / 16; ++kk)
        ldmatrix_x4(qf[kk], sq + swz<DK>(warp * 16 + (lane & 15), 2 * kk + (lane >> 4)));
    }
    const __nv_bfloat16* tk = sk + buf * kKeys * DK;
    const __nv_bfloat16* tv = sv + buf * kKeys * DV;

    // S = Q Kᵀ: 8 tiles of 8 keys; one ldmatrix.x4 gives the B fragments of two key tiles.
    float s[kKeys / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < DK / 16; ++kk) {
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; nt += 2) {
        unsigned bf[4];
        const int mi = lane >> 3;
        ldmatrix_x4(bf, tk + swz<DK>(nt * 8 + (mi >> 1) * 8 + (lane & 7), 2 * kk + (mi & 1)));
        mma_bf16(s[nt], qf[kk], bf[0], bf[1]);
        mma_bf16(s[nt + 1], qf[kk], bf[2], bf[3]);
      }
    }
    // The causal mask, on tiles that reach past the block's first query.
    const int64_t k0 = int64_t(tile) * kKeys;
    if (k0 + kKeys - 1 > a.pos0 + q0) {
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t key = k0 + nt * 8 + 2 * t + (e & 1);
          if (key > a.pos0 + row_q[e >> 1]) s[nt][e] = -INFINITY;
        }
    }
    // Online softmax, per row (quad-wide max).
    float mref[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[r], mx * sl2);
      mref[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet: p = 0, no NaN
      const float corr = exp2f(m[r] - mref[r]);
      m[r] = m_new;
      l[r] *= corr;
#pragma unroll
      for (int dt = 0; dt < DV / 8; ++dt) o[dt][2 * r] *= corr, o[dt][2 * r + 1] *= corr;
    }
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(fmaf(s[nt][e], sl2, -mref[e >> 1]));
        s[nt][e] = p;
        l[e >> 1] += p;
      }
    // O += P V: P's accumulator tiles 2j and 2j + 1 are the A fragment of keys [16j, 16j + 16).
#pragma unroll
    for (int j = 0; j < kKeys / 16; ++j) {
      const unsigned pa[4] = {pack_bf16(s[2 * j][0], s[2 * j][1]), pack_bf16(s[2 * j][2], s[2 * j][3]),
                              pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]),
                              pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3])};
#pragma unroll
      for (int dt = 0; dt < DV / 8; dt += 2) {
        unsigned bf[4];
        const int mi = lane >> 3;
        ldmatrix_x4_trans(bf, tv + swz<DV>(16 * j + (mi & 1) * 8 + (lane & 7), dt + (mi >> 1)));
        mma_bf16(o[dt], pa, bf[0], bf[1]);
        mma_bf16(o[dt + 1], pa, bf[2], bf[3]);
      }
    }
    __syncthreads();  // every warp is done with this buffer before the next load overwrites it
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int64_t qi = row_q[r];
    if (qi >= a.Tq) continue;
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    __nv_bfloat16* yr = y + ((int64_t(b) * a.Tq + qi) * a.H + h) * DV;
#pragma unroll
    for (int dt = 0; dt < DV / 8; ++dt)
      *reinterpret_cast<__nv_bfloat162*>(yr + dt * 8 + 2 * t) =
          __floats2bfloat162_rn(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
    if (lse && t == 0) lse[(int64_t(b) * a.H + h) * a.Tq + qi] = m[r] / kLog2e + logf(l[r]);
  }
}

template <int DK, int DV, int WARPS>
void launch(const void* q, const void* k, const void* v, void* y, float* lse, const AttnShape& a) {
  constexpr int kRows = WARPS * 16;
  const size_t smem = (size_t(kRows) * DK + 2 * size_t(kKeys) * (DK + DV)) * sizeof(__nv_bfloat16);
  auto kernel = fwd_mma_kernel<DK, DV, WARPS>;
  K3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const dim3 grid(unsigned((a.Tq + kRows - 1) / kRows), unsigned(a.H), unsigned(a.B));
  kernel<<<grid, WARPS * 32, smem, device::stream()>>>(
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
  if (a.hd == 64 && a.hdv == 64) return launch<64, 64, 4>(q, k, v, y, lse, a), true;
  if (a.hd == 128 && a.hdv == 128) return launch<128, 128, 4>(q, k, v, y, lse, a), true;
  if (a.hd == 192 && a.hdv == 128) return launch<192, 128, 4>(q, k, v, y, lse, a), true;  // MLA prefill
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
