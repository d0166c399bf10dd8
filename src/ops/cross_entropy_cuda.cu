// Softmax cross-entropy kernels (ops/cross_entropy.h and GPT-2's training step): the loss per row
// and, in the same pass, the logits' gradient.
#include <algorithm>
#include <cmath>

#include "ops/kernels_cuda.cuh"

namespace k3::cuda {
namespace {

// One block per row: loss = lse − logit[target] (+ c·lse²); dlogits = (p·(1 + 2c·lse) − onehot)·scale
// stored as T. Two passes over the row: a running (max, sum of exp) per thread, merged over the
// block, then the gradient. VEC: rows of whole float4s (ld % 4 == 0, aligned arrays), read and
// written four columns at a time; the gradient pass walks all ld columns, pad columns as zeros.
struct MaxSum {
  float m, s;  // the sum is of exp(x − m)
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}
__device__ __forceinline__ void add_value(MaxSum& a, float x) {
  if (x == -INFINITY) return;  // exp(−inf − m) = 0, also while m is still −inf
  if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.0f;  // expf(−inf) = 0 on the first value
    a.m = x;
  } else {
    a.s += expf(x - a.m);
  }
}
// Four values at once: one rescale of the running sum by the four's maximum, then four exp2s of
// prescaled differences (the per-value form's branch and exp per value made the loss
// instruction-bound at GPT-2's 50,304 columns).
constexpr float kLog2eX = 1.4426950408889634f;
__device__ __forceinline__ void add_four(MaxSum& a, float4 x) {
  const float m4 = fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w));
  if (m4 == -INFINITY) return;  // all four are −inf: nothing to add
  if (m4 > a.m) {
    a.s *= exp2f((a.m - m4) * kLog2eX);  // 0 while m is still −inf
    a.m = m4;
  }
  const float mb = a.m * kLog2eX;
  a.s += (exp2f(fmaf(x.x, kLog2eX, -mb)) + exp2f(fmaf(x.y, kLog2eX, -mb))) +
         (exp2f(fmaf(x.z, kLog2eX, -mb)) + exp2f(fmaf(x.w, kLog2eX, -mb)));
}
// Logits stored as TI (fp32, or bf16 from a bf16 GEMM: the row read twice is then half the bytes).
template <class TI, class T, bool VEC>
__global__ void __launch_bounds__(512) xent_kernel(const TI* logits, const int64_t* targets, int64_t vocab,
                                                   int64_t ld, float* loss, T* dlogits, float scale, float z_loss) {
  __shared__ MaxSum part[16];
  __shared__ float lse_shared;
  const int64_t row = blockIdx.x;
  const TI* z = logits + row * ld;
  const int64_t t = targets[row];
  const float zt = t >= 0 ? to_f32(z[t]) : 0.0f;  // read before dlogits may overwrite the logits in place
  MaxSum ms{-INFINITY, 0.0f};
  const int64_t v4 = VEC ? vocab / 4 : 0;
  // Unrolled: four loads in flight per thread (one at a time left the loss latency-bound).
#pragma unroll 4
  for (int64_t j = threadIdx.x; j < v4; j += blockDim.x) {
    add_four(ms, load4<TI>(z + 4 * j));
  }
  for (int64_t j = 4 * v4 + threadIdx.x; j < vocab; j += blockDim.x) add_value(ms, to_f32(z[j]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    ms = merge(ms, {__shfl_xor_sync(0xffffffffu, ms.m, o), __shfl_xor_sync(0xffffffffu, ms.s, o)});
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ms;
  __syncthreads();
  if (threadIdx.x == 0) {
    MaxSum all = part[0];
    for (int w = 1; w < int(blockDim.x >> 5); ++w) all = merge(all, part[w]);
    const float lse = all.m + logf(all.s);
    lse_shared = lse;
    loss[row] = t < 0 ? 0.0f : lse - zt + z_loss * lse * lse;
  }
  if (!dlogits) return;
  __syncthreads();
  const float lse = lse_shared;
  const float zs = 1.0f + 2.0f * z_loss * lse;  // d/dz of lse − z_t + c·lse² is softmax·(1 + 2c·lse) − onehot
  const float lse2 = lse * kLog2eX;
  auto grad = [&](int64_t j, float x) {  // an ignored row's and the pad columns' gradients are zero
    return t < 0 || j >= vocab ? 0.0f : (zs * exp2f(fmaf(x, kLog2eX, -lse2)) - (j == t ? 1.0f : 0.0f)) * scale;
  };
  T* d = dlogits + row * ld;
  if constexpr (VEC) {
#pragma unroll 4
    for (int64_t j = threadIdx.x; j < ld / 4; j += blockDim.x) {
      const float4 x = j < (vocab + 3) / 4 ? load4<TI>(z + 4 * j) : make_float4(0, 0, 0, 0);
      store4<T>(d + 4 * j,
                make_float4(grad(4 * j, x.x), grad(4 * j + 1, x.y), grad(4 * j + 2, x.z), grad(4 * j + 3, x.w)));
    }
  } else {
    for (int64_t j = threadIdx.x; j < ld; j += blockDim.x) d[j] = from_f32<T>(grad(j, j < vocab ? to_f32(z[j]) : 0.0f));
  }
}

// bf16 rows of up to kXentRowChunks · 8 · 1,024 columns (ld % 8 == 0, 16-byte aligned) read once:
// a block of 1,024 threads per row loads it in 16-byte chunks, keeps it in shared memory and
// takes the running max and sum of 8 values per rescale on the way; the gradient pass reads the
// row back from shared memory. Two blocks an SM (32 registers; two rows of GPT-2's 50,304
// columns fit the shared memory), so one row's loads run under the other's stores. The
// two-pass kernel reads the row from memory twice.
constexpr int kXentRowThreads = 1024, kXentRowChunks = 8, kXentRowGroup = 2;  // chunks per thread, loaded 2 at a time
__device__ __forceinline__ float bf_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
// The 8 values of a chunk starting at column col0, −inf past the vocabulary (and past the row).
__device__ __forceinline__ void unpack8(uint4 r, int col0, int vocab, float (&v)[8]) {
  v[0] = bf_lo(r.x), v[1] = bf_hi(r.x), v[2] = bf_lo(r.y), v[3] = bf_hi(r.y);
  v[4] = bf_lo(r.z), v[5] = bf_hi(r.z), v[6] = bf_lo(r.w), v[7] = bf_hi(r.w);
#pragma unroll
  for (int k = 0; k < 8; ++k)
    if (col0 + k >= vocab) v[k] = -INFINITY;
}
__global__ void __launch_bounds__(kXentRowThreads, 2)  // two rows an SM: one's loads under the other's stores
    xent_bf16_row_kernel(const __nv_bfloat16* logits, const int64_t* targets, int64_t vocab, int64_t ld, float* loss,
                         __nv_bfloat16* dlogits, float scale, float z_loss) {
  extern __shared__ uint4 row_s[];  // [ld / 8]
  __shared__ MaxSum part[32];
  __shared__ float lse_shared;
  const int64_t row = blockIdx.x;
  const int n8 = int(ld / 8), V = int(vocab), tgt = int(targets[row]);  // in-row offsets fit in 32 bits
  const uint4* z = reinterpret_cast<const uint4*>(logits + row * ld);
  const float zt = tgt >= 0 && threadIdx.x == 0 ? __bfloat162float(logits[row * ld + tgt]) : 0.0f;
  MaxSum ms{-INFINITY, 0.0f};
#pragma unroll
  for (int i0 = 0; i0 < kXentRowChunks; i0 += kXentRowGroup) {
    uint4 raw[kXentRowGroup];
#pragma unroll
    for (int i = 0; i < kXentRowGroup; ++i) {
      const int j = int(threadIdx.x) + (i0 + i) * kXentRowThreads;
      if (j < n8) raw[i] = z[j];
    }
#pragma unroll
    for (int i = 0; i < kXentRowGroup; ++i) {
      const int j = int(threadIdx.x) + (i0 + i) * kXentRowThreads;
      if (j >= n8) continue;
      row_s[j] = raw[i];
      float v[8];
      unpack8(raw[i], 8 * j, V, v);
      const float m8 = fmaxf(fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3])), fmaxf(fmaxf(v[4], v[5]), fmaxf(v[6], v[7])));
      if (m8 == -INFINITY) continue;
      if (m8 > ms.m) {
        ms.s *= exp2f((ms.m - m8) * kLog2eX);  // 0 while m is still −inf
        ms.m = m8;
      }
      const float mb = ms.m * kLog2eX;
#pragma unroll
      for (int k = 0; k < 8; ++k) ms.s += exp2f(fmaf(v[k], kLog2eX, -mb));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    ms = merge(ms, {__shfl_xor_sync(0xffffffffu, ms.m, o), __shfl_xor_sync(0xffffffffu, ms.s, o)});
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ms;
  __syncthreads();  // also orders the row's shared-memory stores before the gradient pass
  if (threadIdx.x < 32) {
    ms = part[threadIdx.x];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      ms = merge(ms, {__shfl_xor_sync(0xffffffffu, ms.m, o), __shfl_xor_sync(0xffffffffu, ms.s, o)});
    if (threadIdx.x == 0) {
      const float lse = ms.m + logf(ms.s);
      lse_shared = lse;
      loss[row] = tgt < 0 ? 0.0f : lse - zt + z_loss * lse * lse;
    }
  }
  if (!dlogits) return;
  __syncthreads();
  const float lse = lse_shared, zs = 1.0f + 2.0f * z_loss * lse, lse2 = lse * kLog2eX;
  uint4* d = reinterpret_cast<uint4*>(dlogits + row * ld);
  for (int j = int(threadIdx.x); j < n8; j += kXentRowThreads) {
    float v[8], g[8];
    unpack8(row_s[j], 8 * j, V, v);
#pragma unroll
    for (int k = 0; k < 8; ++k)  // an ignored row's and the pad columns' gradients are zero (exp2(−inf) = 0)
      g[k] = tgt < 0 ? 0.0f : (zs * exp2f(fmaf(v[k], kLog2eX, -lse2)) - (8 * j + k == tgt ? 1.0f : 0.0f)) * scale;
    const __nv_bfloat162 p0 = __floats2bfloat162_rn(g[0], g[1]), p1 = __floats2bfloat162_rn(g[2], g[3]),
                         p2 = __floats2bfloat162_rn(g[4], g[5]), p3 = __floats2bfloat162_rn(g[6], g[7]);
    d[j] = make_uint4(*reinterpret_cast<const unsigned*>(&p0), *reinterpret_cast<const unsigned*>(&p1),
                      *reinterpret_cast<const unsigned*>(&p2), *reinterpret_cast<const unsigned*>(&p3));
  }
}

}  // namespace

void cross_entropy_to(const float* logits, const int64_t* targets, int64_t M, int64_t vocab, float* loss,
                      void* dlogits, Storage st, float scale, float z_loss, int64_t ld) {
  if (!M) return;
  if (!ld) ld = vocab;
  const bool vec = ld % 4 == 0 && aligned(logits, 16) && aligned(dlogits, row4_bytes(st));
  K3_DISPATCH_STORAGE(st, T, {
    T* d = static_cast<T*>(dlogits);
    if (vec)
      xent_kernel<float, T, true><<<unsigned(M), 512, 0, device::stream()>>>(logits, targets, vocab, ld, loss, d,
                                                                             scale, z_loss);
    else
      xent_kernel<float, T, false><<<unsigned(M), 512, 0, device::stream()>>>(logits, targets, vocab, ld, loss, d,
                                                                              scale, z_loss);
  });
  K3_CUDA_LAUNCHED();
}
void cross_entropy_bf16(const void* logits, const int64_t* targets, int64_t M, int64_t vocab, float* loss,
                        void* dlogits, float scale, float z_loss, int64_t ld) {
  if (!M) return;
  if (!ld) ld = vocab;
  using B16 = __nv_bfloat16;
  const B16* z = static_cast<const B16*>(logits);
  B16* d = static_cast<B16*>(dlogits);
  if (ld % 8 == 0 && ld <= int64_t(kXentRowChunks) * 8 * kXentRowThreads && aligned(logits, 16) &&
      aligned(dlogits, 16)) {
    const int smem = int(ld * 2);
    static const bool attr = [] {  // the largest row's shared memory, once
      K3_CUDA_CHECK(cudaFuncSetAttribute(xent_bf16_row_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         kXentRowChunks * 8 * kXentRowThreads * 2));
      return true;
    }();
    (void)attr;
    xent_bf16_row_kernel<<<unsigned(M), kXentRowThreads, size_t(smem), device::stream()>>>(z, targets, vocab, ld, loss,
                                                                                          d, scale, z_loss);
  } else if (ld % 4 == 0 && aligned(logits, 8) && aligned(dlogits, 8))
    xent_kernel<B16, B16, true><<<unsigned(M), 512, 0, device::stream()>>>(z, targets, vocab, ld, loss, d, scale,
                                                                           z_loss);
  else
    xent_kernel<B16, B16, false><<<unsigned(M), 512, 0, device::stream()>>>(z, targets, vocab, ld, loss, d, scale,
                                                                            z_loss);
  K3_CUDA_LAUNCHED();
}
void cross_entropy(const float* logits, const int64_t* targets, int64_t M, int64_t vocab, float* loss,
                   float* dlogits, float scale, float z_loss, int64_t ld) {
  cross_entropy_to(logits, targets, M, vocab, loss, dlogits, Storage::F32, scale, z_loss, ld);
}

}  // namespace k3::cuda
