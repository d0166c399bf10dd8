// For k3's .cu files only: the one CUDA error check (ARCHITECTURE.md: "CUDA calls go through
// one"), the stream every kernel runs on, and small device helpers shared by the kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "core/device.h"
#include "core/error.h"

namespace k3::device {

[[noreturn]] void cuda_fail(cudaError_t e, const char* what, const char* file, int line);

#define K3_CUDA_CHECK(call)                                                            \
  do {                                                                                 \
    cudaError_t k3_cuda_err_ = (call);                                                 \
    if (k3_cuda_err_ != cudaSuccess) ::k3::device::cuda_fail(k3_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)
// After every kernel launch: catches bad launch configurations at once (faults inside a kernel
// surface at the next synchronising call, through the same check).
#define K3_CUDA_LAUNCHED() K3_CUDA_CHECK(cudaGetLastError())

cudaStream_t stream();  // k3's stream (non-blocking, created on first use)

// Launches `kernel` on k3's stream as a programmatic dependent of the work before it: its blocks
// may be scheduled while the previous grid drains, so the kernel must execute
// `griddepcontrol.wait` before it reads anything that work wrote (the instruction returns once the
// previous grid has finished and its writes are visible).
template <class... P, class... A>
void launch_dependent(void (*kernel)(P...), unsigned blocks, unsigned threads, A&&... args) {
  cudaLaunchConfig_t c{};
  c.gridDim = dim3(blocks);
  c.blockDim = dim3(threads);
  c.stream = stream();
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  c.attrs = &attr;
  c.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&c, kernel, std::forward<A>(args)...);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // not left pending for the next launch's check to blame
    cuda_fail(e, "cudaLaunchKernelEx", __FILE__, __LINE__);
  }
}

inline unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

// Loads and stores that read either fp32 or bf16 storage as fp32 arithmetic.
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// Four values at once, as fp32 arithmetic: loaded from a float4 or from four bf16 (8 bytes),
// stored as a float4 or rounded to four bf16 (16- and 8-byte aligned respectively).
__device__ __forceinline__ uint2 pack_bf16x4(float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  return make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi));
}
template <class T>
__device__ __forceinline__ float4 load4(const T* p);
template <>
__device__ __forceinline__ float4 load4<float>(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
template <>
__device__ __forceinline__ float4 load4<__nv_bfloat16>(const __nv_bfloat16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x)),
               hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}
template <class T>
__device__ __forceinline__ void store4(T* p, float4 v);
template <>
__device__ __forceinline__ void store4<float>(float* p, float4 v) {
  *reinterpret_cast<float4*>(p) = v;
}
template <>
__device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16* p, float4 v) {
  *reinterpret_cast<uint2*>(p) = pack_bf16x4(v);
}

// Runs the statement with T bound to the storage type of `st` (device::Storage: fp32 or bf16).
#define K3_DISPATCH_STORAGE(st, T, ...)      \
  do {                                       \
    if ((st) == ::k3::device::Storage::BF16) { \
      using T = __nv_bfloat16;               \
      __VA_ARGS__;                           \
    } else {                                 \
      using T = float;                       \
      __VA_ARGS__;                           \
    }                                        \
  } while (0)

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  x = warp_sum(x);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = lane < nwarps ? scratch[lane] : 0.0f;
  return warp_sum(x);
}

// acc += t · x per component, as fused multiply-adds (the rows of the register-tiled products).
__device__ __forceinline__ void axpy4(float (&acc)[4], float t, float4 x) {
  acc[0] = fmaf(t, x.x, acc[0]);
  acc[1] = fmaf(t, x.y, acc[1]);
  acc[2] = fmaf(t, x.z, acc[2]);
  acc[3] = fmaf(t, x.w, acc[3]);
}
__device__ __forceinline__ void axpy4(float4& acc, float t, float4 x) {
  acc.x = fmaf(t, x.x, acc.x);
  acc.y = fmaf(t, x.y, acc.y);
  acc.z = fmaf(t, x.z, acc.z);
  acc.w = fmaf(t, x.w, acc.w);
}

// Asynchronous 16-byte copies global → shared (cp.async, sm_80+): no register holds the data in
// flight, so a memory-bound kernel can keep as many bytes in flight as shared memory holds.
// `wait_group N` waits until at most N committed groups of this thread are in flight; copies not
// yet committed to a group are not covered by it (`cp.async.wait_all` waits for every copy).
// `dst` as a shared-memory address (a loop stepping it by adds avoids a conversion per copy).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  cp_async16(unsigned(__cvta_generic_to_shared(dst)), src);
}
// The same, writing 16 zero bytes instead when !valid (src is not read then).
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool valid) {
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void cp_async_wait2() { asm volatile("cp.async.wait_group 2;\n" ::); }
__device__ __forceinline__ void cp_async_wait0() { asm volatile("cp.async.wait_group 0;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// TF32 tensor-core products (mma.sync m16n8k8, sm_80+): fp32 operands rounded to TF32 (10-bit
// mantissa, round to nearest), fp32 accumulation. With g = lane / 4 and t = lane % 4 a lane holds
//   A (16 × 8, row-major): a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4];
//   B (8 × 8):             b0 = B[t][g], b1 = B[t+4][g];
//   C (16 × 8):            c0 = C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1].
__device__ __forceinline__ uint32_t tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
// x rounded to TF32 as an fp32 value (low 13 mantissa bits zero): an operand stored this way
// feeds mma_tf32 as its raw bits, with no conversion where it is read.
__device__ __forceinline__ float round_tf32(float x) { return __uint_as_float(tf32(x)); }
__device__ __forceinline__ uint32_t bits(float x) { return __float_as_uint(x); }
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8 × 8 matrices of 16-byte rows from shared memory (ldmatrix .x4): lane l gives the address of
// row l % 8 of matrix l / 8 and receives in r[m] the 4 bytes at (row l / 4, bytes 4·(l % 4)…) of
// matrix m. With 32-bit elements (TF32) that is element [l / 4][l % 4]: an m16n8k8 A fragment
// when matrices 0–3 are rows 0–7 / 8–15 × columns 0–3, then the same rows × columns 4–7.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const unsigned a = unsigned(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// The same, each matrix transposed (.trans): with 16-bit elements lane l receives in r[m] the pair
// (row 2·(l % 4), column l / 4), (row 2·(l % 4) + 1, column l / 4) of matrix m.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  const unsigned a = unsigned(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// BF16 tensor-core products (mma.sync m16n8k16, sm_80+), fp32 accumulation; each register holds
// two bf16, the lower-indexed one in the low half. With g = lane / 4 and t = lane % 4 a lane holds
//   A (16 × 16, row-major): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9],
//                           a3 = A[g+8][2t+8, 2t+9];
//   B (16 × 8):             b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g];
//   C (16 × 8):             as mma_tf32's.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Hopper's warpgroup MMA (wgmma, sm_90a) over shared-memory tiles in the 128-byte swizzle: a
// tile of `rows` rows is stored as 64-column panels (rows · 64 elements each, 1024-byte aligned),
// 16-byte chunk c of row r at c ^ (r mod 8). panel_off is the element offset of (r, c).
__device__ __forceinline__ int panel_off(int rows, int r, int c) {
  return (c >> 6) * rows * 64 + r * 64 + ((((c & 63) >> 3) ^ (r & 7)) << 3) + (c & 7);
}
// Shared-memory matrix descriptor for such a panel: start address, LBO (16-byte units; the
// stride between 64-column panels along M or N of an MN-major operand, unused for K-major), SBO
// (between 8-row groups: 1024 bytes), 128-byte swizzle. A K-major operand's k16-step s within a
// panel starts 32·s bytes further on; an MN-major one's, 16 rows (2048 bytes) further on.
// Its low word (start address, LBO) and the high word every panel here shares (SBO, swizzle) are
// apart so that a loop walking panels computes the low word once and adds constant byte offsets
// (multiples of 16): while address + offset stays below 256 KiB (shared memory is at most
// 228 KiB), the start address field (address / 16, 14 bits) never carries into the LBO.
constexpr uint32_t kSmemDescHi = (1024 >> 4) | (1u << 30);
__device__ __forceinline__ uint32_t smem_desc_lo(const void* p, uint32_t lbo_bytes) {
  return ((unsigned(__cvta_generic_to_shared(p)) & 0x3FFFF) >> 4) | ((lbo_bytes >> 4) << 16);
}
__device__ __forceinline__ uint64_t smem_desc_at(uint32_t lo, uint32_t byte_off) {
  return (uint64_t(kSmemDescHi) << 32) | (lo + (byte_off >> 4));
}
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo_bytes) {
  return smem_desc_at(smem_desc_lo(p, lbo_bytes), 0);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator registers across the asynchronous MMAs.
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared memory written by ordinary stores (or cp.async) that wgmma or a bulk copy reads next:
// each writing thread fences before the barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Hopper bulk copies (cp.async.bulk, the TMA's 1-D form): `bytes` (a multiple of 16; both
// addresses 16-byte aligned) from global to shared memory, counted against an mbarrier's
// transactions. A stage's barrier: init with one arrival, then per fill one arrive_expect_tx of
// the stage's bytes and the copies; consumers wait for the fill's phase parity (fills 0, 2, … of
// a barrier: parity 0; 1, 3, …: parity 1). Shared memory written by ordinary stores that a bulk
// copy later overwrites needs fence_proxy_async in between.
__device__ __forceinline__ unsigned smem_u32(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  unsigned done = 0;
  while (!done)
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
}

// Tensor copies (cp.async.bulk.tensor, the TMA): one box of a 4-D tensor map (a CUtensorMap
// kernel parameter, __grid_constant__) at element coordinates c0 (innermost) … c3 into shared
// memory, counted against an mbarrier as bulk_copy_g2s is. Elements outside the tensor are
// written as zeros and still count their bytes.
__device__ __forceinline__ void tma_load_4d(void* dst, const void* map, int c0, int c1, int c2, int c3,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_u32(bar))
      : "memory");
}

}  // namespace k3::device
