// The chunked delta rule's sequential stage, the chunk-state chain (delta_chunked_cuda.cu's
// opening comment, 2 and the backward's `reverse`): `recur` walks the chunks in order carrying
// the state S, storing each chunk's entering state and V_new; `reverse` walks them backwards
// carrying the state's adjoint dS. Each has an fp32 SIMT form and a TF32 tensor-core form.
#include "mixers/linear/delta_chunked_cuda.cuh"

namespace k3::linear::detail {
namespace {

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

size_t recur_smem(int KS) { return sizeof(float) * (KS * kVb + 2 * kC * KS + KS + 2 * kC * kVb); }
size_t recur_tc_smem(int KS, int VB) {
  return sizeof(float) * (KS * (VB + kPadB) + 2 * (kC * (2 * KS + kPadA + kPadB + VB + kPadB) + KS));
}
size_t reverse_smem(int KS) { return sizeof(float) * (KS * kVb + 3 * kC * KS + kC * kC + 2 * kC * kVb + 2 * KS); }
size_t reverse_tc_smem(int KS, int VB) {
  return sizeof(float) * (KS * (VB + kPadB) + kC * (KS + kPadA) + kC * (kC + kPadB) + 2 * kC * (KS + kPadB) +
                          2 * kC * (VB + kPadB) + 2 * KS);
}

void configure() {
  static const bool configured = [] {
    K3_CUDA_CHECK(cudaFuncSetAttribute(recur_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(recur_smem(128))));
    K3_CUDA_CHECK(cudaFuncSetAttribute(reverse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(reverse_smem(128))));
    K3_CUDA_CHECK(cudaFuncSetAttribute(recur_tc_kernel<16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(recur_tc_smem(128, 16))));
    K3_CUDA_CHECK(cudaFuncSetAttribute(recur_tc_kernel<32>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(recur_tc_smem(128, 32))));
    K3_CUDA_CHECK(cudaFuncSetAttribute(reverse_tc_kernel<16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(reverse_tc_smem(128, 16))));
    K3_CUDA_CHECK(cudaFuncSetAttribute(reverse_tc_kernel<32>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(reverse_tc_smem(128, 32))));
    return true;
  }();
  (void)configured;
}

// The grids: a block per (sequence, value head, kVb columns); the tensor-core forms take 16-column
// tiles while they fit the SMs at one block each, else 32.
struct StateGrids {
  dim3 tiles, wide;
  bool narrow;
  explicit StateGrids(const ChunkDev& d, int64_t NHV)
      : tiles(unsigned(NHV), unsigned((d.V + kVb - 1) / kVb)), wide(unsigned(NHV), unsigned((d.V + 31) / 32)),
        narrow(int64_t(tiles.x) * tiles.y <= device::sm_count()) {}
};

// One pass of the chain, forward (recur) or reverse: the SIMT kernel, or the tensor-core one of
// 16 or 32 columns.
using ChainKernel = void (*)(ChunkDev);
void launch_chain(const ChunkDev& d, int64_t NHV, ChainKernel simt, size_t simt_smem, ChainKernel tc16,
                  ChainKernel tc32, size_t (*tc_smem)(int, int)) {
  configure();
  const StateGrids g(d, NHV);
  cudaStream_t st = device::stream();
  if (!d.tc)
    simt<<<g.tiles, kRecThreads, simt_smem, st>>>(d);
  else if (g.narrow)
    tc16<<<g.tiles, kRecThreads, tc_smem(d.KS, 16), st>>>(d);
  else
    tc32<<<g.wide, kRecThreads, tc_smem(d.KS, 32), st>>>(d);
  K3_CUDA_LAUNCHED();
}

}  // namespace

void launch_recur(const ChunkDev& d, int64_t NHV) {
  launch_chain(d, NHV, recur_kernel, recur_smem(d.KS), recur_tc_kernel<16>, recur_tc_kernel<32>, recur_tc_smem);
}

void launch_reverse(const ChunkDev& d, int64_t NHV) {
  launch_chain(d, NHV, reverse_kernel, reverse_smem(d.KS), reverse_tc_kernel<16>, reverse_tc_kernel<32>,
               reverse_tc_smem);
}

}  // namespace k3::linear::detail
