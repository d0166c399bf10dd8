// The linear layer's block-format weights on CUDA (core/quant.h: F8B128, MXFP4), read packed and
// dequantised in registers: a streaming product for the decode's few rows, and for larger batches
// a bf16 copy of the weight made on the way to cuBLAS's tensor-core GEMM.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "core/quant.h"
#include "ops/kernels_cuda.cuh"

namespace k3::cuda {
namespace {

// Sixteen bytes of codes as values, each pair (lo, hi) a float2 of v[i]: F8B128's 16 codes, or
// MXFP4's 32 (two per byte; v holds 16 float2 then), before the block's scale.
__device__ __forceinline__ float2 f8x2(uint16_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}
// An E2M1 code placed in an fp16's exponent and top mantissa bit is its value · 2^-14 (codes with
// exponent 0 land on fp16 subnormals, exactly); the 2^14 is folded into the block's scale (so a
// scale above 2^113, far beyond any weight's, would overflow where the host's decode does not).
__device__ __forceinline__ float2 fp4x2(uint32_t byte) {
  const uint32_t lo = byte & 15u, hi = byte >> 4;
  const uint32_t bits = ((lo & 7u) << 9) | ((lo & 8u) << 12) | ((((hi & 7u) << 9) | ((hi & 8u) << 12)) << 16);
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}
__device__ __forceinline__ float e8m0(uint8_t s) {
  return s == 255 ? __int_as_float(0x7fc00000) : __int_as_float(s ? int(s) << 23 : 0x00400000);
}

constexpr int kGemvWarps = 4, kGemvRows = 2;  // rows per warp at once: their x loads are shared

// y[m, r] = beta·y[m, r] + Σ_i x[m, i] · W[r, i] (+ bias[r]) for M ≤ 8 rows of x: each warp takes
// kGemvRows weight rows, each lane 16 bytes of codes per step (coalesced 512-byte row pieces), and
// the lanes' sums meet by shuffles.
template <int M, bool Fp4>
__global__ void __launch_bounds__(32 * kGemvWarps)
    gemv_blocks_kernel(const float* __restrict__ x, const uint8_t* __restrict__ codes, const void* __restrict__ scales,
                       const float* __restrict__ bias, float* __restrict__ y, int in, int out, float beta) {
  const int lane = threadIdx.x & 31;
  const int r0 = (int(blockIdx.x) * kGemvWarps + int(threadIdx.x >> 5)) * kGemvRows;
  if (r0 >= out) return;
  const int row_bytes = Fp4 ? in / 2 : in, chunks = row_bytes / 16;
  float acc[M][kGemvRows] = {};
  for (int c = lane; c < chunks; c += 32) {
    uint4 w[kGemvRows];
    float s[kGemvRows];
#pragma unroll
    for (int j = 0; j < kGemvRows; ++j) {
      const int r = min(r0 + j, out - 1);
      w[j] = __ldg(reinterpret_cast<const uint4*>(codes + int64_t(r) * row_bytes) + c);
      s[j] = Fp4 ? e8m0(static_cast<const uint8_t*>(scales)[int64_t(r) * (in / kMxfp4Block) + c]) * 16384.0f
                 : static_cast<const float*>(scales)[int64_t(r) * (in / kF8Block) + c / 8];
    }
    const int col = c * (Fp4 ? 32 : 16);
    // Four bytes of each row at a time: 4 F8 values (one float4 of x per m) or 8 FP4 (two).
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float v[kGemvRows][Fp4 ? 8 : 4];
#pragma unroll
      for (int j = 0; j < kGemvRows; ++j) {
        const uint32_t word = (&w[j].x)[q];
        if constexpr (Fp4) {
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const float2 p = fp4x2((word >> (8 * b)) & 255u);
            v[j][2 * b] = p.x, v[j][2 * b + 1] = p.y;
          }
        } else {
          const float2 a = f8x2(uint16_t(word & 0xffffu)), b = f8x2(uint16_t(word >> 16));
          v[j][0] = a.x, v[j][1] = a.y, v[j][2] = b.x, v[j][3] = b.y;
        }
      }
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float4* xm = reinterpret_cast<const float4*>(x + int64_t(m) * in + col + q * (Fp4 ? 8 : 4));
#pragma unroll
        for (int h = 0; h < (Fp4 ? 2 : 1); ++h) {
          const float4 xv = __ldg(xm + h);
#pragma unroll
          for (int j = 0; j < kGemvRows; ++j)
            acc[m][j] += s[j] * (xv.x * v[j][4 * h] + xv.y * v[j][4 * h + 1] + xv.z * v[j][4 * h + 2] +
                                 xv.w * v[j][4 * h + 3]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int j = 0; j < kGemvRows; ++j) {
      float a = acc[m][j];
#pragma unroll
      for (int o = 16; o; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
      const int r = r0 + j;
      if (lane == 0 && r < out) {
        float* d = y + int64_t(m) * out + r;
        *d = (beta == 0.0f ? 0.0f : beta * *d) + a + (bias ? bias[r] : 0.0f);
      }
    }
}

template <bool Fp4>
__global__ void dequantize_bf16_kernel(const uint8_t* __restrict__ codes, const void* __restrict__ scales,
                                       __nv_bfloat16* __restrict__ out, int64_t chunks) {
  // One thread per 16 bytes of codes.
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= chunks) return;
  const uint4 w = __ldg(reinterpret_cast<const uint4*>(codes) + c);
  if constexpr (Fp4) {
    const float s = e8m0(static_cast<const uint8_t*>(scales)[c]) * 16384.0f;
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + c * 32);
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const float2 p = fp4x2(((&w.x)[q] >> (8 * b)) & 255u);
        o[q * 4 + b] = __floats2bfloat162_rn(p.x * s, p.y * s);
      }
  } else {
    const float s = static_cast<const float*>(scales)[c / 8];
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + c * 16);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t word = (&w.x)[q];
      const float2 a = f8x2(uint16_t(word & 0xffffu)), b = f8x2(uint16_t(word >> 16));
      o[2 * q] = __floats2bfloat162_rn(a.x * s, a.y * s);
      o[2 * q + 1] = __floats2bfloat162_rn(b.x * s, b.y * s);
    }
  }
}

template <bool Fp4>
void gemv_launch(const float* x, int64_t M, const uint8_t* codes, const void* scales, const float* bias, float* y,
                 int in, int out, float beta) {
  const unsigned blocks = unsigned((out + kGemvWarps * kGemvRows - 1) / (kGemvWarps * kGemvRows));
  const dim3 b(blocks), t(32 * kGemvWarps);
  cudaStream_t s = device::stream();
  switch (M) {
    case 1: gemv_blocks_kernel<1, Fp4><<<b, t, 0, s>>>(x, codes, scales, bias, y, in, out, beta); break;
    case 2: gemv_blocks_kernel<2, Fp4><<<b, t, 0, s>>>(x, codes, scales, bias, y, in, out, beta); break;
    case 3: gemv_blocks_kernel<3, Fp4><<<b, t, 0, s>>>(x, codes, scales, bias, y, in, out, beta); break;
    case 4: gemv_blocks_kernel<4, Fp4><<<b, t, 0, s>>>(x, codes, scales, bias, y, in, out, beta); break;
    case 5: gemv_blocks_kernel<5, Fp4><<<b, t, 0, s>>>(x, codes, scales, bias, y, in, out, beta); break;
    case 6: gemv_blocks_kernel<6, Fp4><<<b, t, 0, s>>>(x, codes, scales, bias, y, in, out, beta); break;
    case 7: gemv_blocks_kernel<7, Fp4><<<b, t, 0, s>>>(x, codes, scales, bias, y, in, out, beta); break;
    default: gemv_blocks_kernel<8, Fp4><<<b, t, 0, s>>>(x, codes, scales, bias, y, in, out, beta); break;
  }
  K3_CUDA_LAUNCHED();
}

}  // namespace

void gemv_blocks(DType fmt, const float* x, int64_t M, const void* w, int64_t in, int64_t out, const float* bias,
                 float* y, float beta) {
  K3_CHECK(M >= 1 && M <= kGemvMaxRows && in % dtype_block(fmt) == 0 && in < (int64_t(1) << 30) && out < (int64_t(1) << 31),
           "gemv_blocks: ", M, " rows of ", in, " into ", out, " (", dtype_name(fmt), ")");
  K3_CHECK(aligned(x, 16) && aligned(w, 16), "gemv_blocks: unaligned operands");
  if (!out) return;
  const int64_t n = in * out;
  const uint8_t* codes = block_codes(w);
  const void* scales = block_scales(fmt, w, n);
  if (fmt == DType::MXFP4)
    gemv_launch<true>(x, M, codes, scales, bias, y, int(in), int(out), beta);
  else
    gemv_launch<false>(x, M, codes, scales, bias, y, int(in), int(out), beta);
}

void dequantize_to_bf16(DType fmt, const void* w, int64_t n, void* out) {
  K3_CHECK(is_block_dtype(fmt) && n % dtype_block(fmt) == 0, "dequantize_to_bf16: ", n, " values of ", dtype_name(fmt));
  const int64_t chunks = fmt == DType::MXFP4 ? n / 32 : n / 16;
  if (!chunks) return;
  const uint8_t* codes = block_codes(w);
  const void* scales = block_scales(fmt, w, n);
  auto* o = static_cast<__nv_bfloat16*>(out);
  if (fmt == DType::MXFP4)
    dequantize_bf16_kernel<true><<<device::blocks_for(chunks, kThreads), kThreads, 0, device::stream()>>>(codes, scales, o,
                                                                                                          chunks);
  else
    dequantize_bf16_kernel<false><<<device::blocks_for(chunks, kThreads), kThreads, 0, device::stream()>>>(codes, scales,
                                                                                                           o, chunks);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
