// The chunked delta rule's gradient stage, `grads` (delta_chunked_cuda.cu's opening comment,
// backward): for every chunk at once, everything of the chunk's backward that the carried state
// adjoint does not need (dKd, dQg, dW, dT, the grams' backward, dβ, dg). One kernel, kept whole:
// its phases share the staged tiles in shared memory and their barriers.
#include "mixers/linear/delta_chunked_cuda.cuh"

namespace k3::linear::detail {
namespace {

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

size_t grads_smem(int K) { return sizeof(float) * (kStage + 3 * kC * (K + 1) + 3 * kC * (kC + 1) + 2 * kC + 128); }

template <class T>
void launch_grads_as(const ChunkDev& d, int64_t NHV) {
  static const bool configured = [] {
    K3_CUDA_CHECK(cudaFuncSetAttribute(grads_kernel<T, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(grads_smem(128))));
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      K3_CUDA_CHECK(cudaFuncSetAttribute(grads_kernel<T, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(grads_smem(128))));
    return true;
  }();
  (void)configured;
  const dim3 chunks(unsigned(NHV), unsigned(d.c_count));
  cudaStream_t st = device::stream();
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (d.tc) {
      grads_kernel<T, true><<<chunks, kGradThreads, grads_smem(d.K), st>>>(d);
      K3_CUDA_LAUNCHED();
      return;
    }
  }
  grads_kernel<T, false><<<chunks, kGradThreads, grads_smem(d.K), st>>>(d);
  K3_CUDA_LAUNCHED();
}

}  // namespace

void launch_grads(const ChunkDev& d, int64_t NHV, DType io) {
  if (io == DType::BF16)
    launch_grads_as<__nv_bfloat16>(d, NHV);
  else
    launch_grads_as<float>(d, NHV);
}

}  // namespace k3::linear::detail
