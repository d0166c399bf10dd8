// The chunked delta rule's output stage (delta_chunked_cuda.cu's opening comment, 3): every
// chunk at once, O = Qg S₀ + Aqk V_new from the entering states and V_new that recur stored, in
// an fp32 SIMT form and a TF32 tensor-core form.
#include "mixers/linear/delta_chunked_cuda.cuh"

namespace k3::linear::detail {
namespace {

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

size_t output_smem(int KS, bool tc = false) {
  return tc ? sizeof(float) * ((KS + kC) * (kOb + kPadB) + kC * (KS + kPadA) + kC * (kC + kPadA))
            : sizeof(float) * (KS * kOb + kC * KS + kC * kC + kC * kOb);
}

template <class T>
void launch_output_as(const ChunkDev& d, int64_t NHV) {
  static const bool configured = [] {
    K3_CUDA_CHECK(cudaFuncSetAttribute(output_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(output_smem(128))));
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      K3_CUDA_CHECK(cudaFuncSetAttribute(output_tc_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(output_smem(128, true))));
    return true;
  }();
  (void)configured;
  cudaStream_t st = device::stream();
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (d.tc) {  // a block per chunk walks the 64-column tiles (Qg and Aqk load once)
      const dim3 chunks(unsigned(NHV), unsigned(d.c_count));
      output_tc_kernel<T><<<chunks, kRecThreads, output_smem(d.KS, true), st>>>(d);
      K3_CUDA_LAUNCHED();
      return;
    }
  }
  const dim3 outs(unsigned(NHV), unsigned(d.c_count), unsigned((d.V + kOb - 1) / kOb));
  output_kernel<T><<<outs, kRecThreads, output_smem(d.KS), st>>>(d);
  K3_CUDA_LAUNCHED();
}

}  // namespace

void launch_output(const ChunkDev& d, int64_t NHV, DType io) {
  if (io == DType::BF16)
    launch_output_as<__nv_bfloat16>(d, NHV);
  else
    launch_output_as<float>(d, NHV);
}

}  // namespace k3::linear::detail
