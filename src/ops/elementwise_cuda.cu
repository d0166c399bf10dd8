// Elementwise and row-wise ops on CUDA: GELU, SiTU/SiLU GLU, embedding, RoPE, cross-entropy,
// AdamW. Each mirrors its CPU function (ops/activation.cc, ops/situ.cc, ops/embedding.cc,
// ops/rope.cc, ops/ag.cc's cross_entropy_head, train/optimizer.cc).
#include <algorithm>
#include <cmath>

#include "core/cuda_util.cuh"
#include "ops/ops_cuda.h"

namespace k3::cuda {
namespace {

using device::from_f32;
using device::load4;
using device::pack_bf16x4;
using device::store4;
using device::to_f32;

constexpr int kThreads = 256;
constexpr float kSqrt2OverPi = 0.7978845608028654f;

__device__ __forceinline__ float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

// 0.5·(1 + tanh(u)) = σ(2u): GELU(v) = v·σ(2u) with u = √(2/π)(v + 0.044715 v³), one exp and one
// reciprocal instead of tanhf's longer sequence (tanhf made the bf16 GELU instruction-bound).
// exp(−2u) overflows to inf for large negative v, giving σ = 0 and GELU = −0, as the limit.
__device__ __forceinline__ float sig2u(float v) {
  const float u = kSqrt2OverPi * (v + 0.044715f * v * v * v);
  return __frcp_rn(1.0f + __expf(-2.0f * u));
}
__device__ __forceinline__ float gelu_tanh(float v) { return v * sig2u(v); }
template <class T>
__global__ void gelu_fwd(const T* x, T* y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  y[i] = from_f32<T>(gelu_tanh(to_f32(x[i])));
}

__device__ __forceinline__ float gelu_tanh_grad(float v) {  // d GELU(v) / dv = σ + 2v·σ(1 − σ)·du/dv
  const float sg = sig2u(v);
  const float du = kSqrt2OverPi * (1.0f + 3.0f * 0.044715f * v * v);
  return sg + 2.0f * v * sg * (1.0f - sg) * du;
}
template <class T>
__global__ void gelu_bwd(const T* x, const T* dy, T* dx, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  dx[i] = from_f32<T>(to_f32(dy[i]) * gelu_tanh_grad(to_f32(x[i])));
}
// gelu_fwd four values at a time (n % 4 == 0, aligned arrays), two quads a thread (the second
// kThreads quads on): two loads in flight per thread.
template <class T>
__global__ void gelu4_fwd(const T* x, T* y, int64_t n4) {
  const int64_t i = int64_t(blockIdx.x) * 2 * blockDim.x + threadIdx.x, i2 = i + blockDim.x;
  const float4 a = i < n4 ? load4<T>(x + 4 * i) : float4{}, b = i2 < n4 ? load4<T>(x + 4 * i2) : float4{};
  if (i < n4) store4<T>(y + 4 * i, make_float4(gelu_tanh(a.x), gelu_tanh(a.y), gelu_tanh(a.z), gelu_tanh(a.w)));
  if (i2 < n4) store4<T>(y + 4 * i2, make_float4(gelu_tanh(b.x), gelu_tanh(b.y), gelu_tanh(b.z), gelu_tanh(b.w)));
}
// Row-major [M, 4·n4] values made by a functor (value(m, c): the four values of row m, column
// group c), written as fp32 and/or bf16 (either may be null; the bf16 rows ld4 groups of 4
// apart) with their column sums added to dbias (when non-null): a block takes 32 column groups
// (one per lane) over a slice of rows (its warps interleaved), sums in registers, meets in shared
// memory, one atomic per column per block. The producers whose result feeds a bias gradient use
// it (the GELU's backward, the q/k/v merge, the attention's dq).
constexpr int kColSumRowLanes = 8;
template <class Value>
__global__ void __launch_bounds__(32 * kColSumRowLanes)
    rows_with_column_sums_kernel(Value value, float4* out, uint2* out_b, int64_t ld4, float* dbias, int64_t M,
                                 int n4, int64_t rows_per_block) {
  __shared__ float4 part[kColSumRowLanes][32];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int c = int(blockIdx.x) * 32 + tx;
  const int64_t m0 = int64_t(blockIdx.y) * rows_per_block, m1 = m0 + rows_per_block < M ? m0 + rows_per_block : M;
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (c < n4)
#pragma unroll 4
    for (int64_t m = m0 + ty; m < m1; m += kColSumRowLanes) {
      const float4 d = value(m, c);
      if (out) out[m * n4 + c] = d;
      if (out_b) out_b[m * ld4 + c] = pack_bf16x4(d);
      sum = make_float4(sum.x + d.x, sum.y + d.y, sum.z + d.z, sum.w + d.w);
    }
  if (!dbias) return;
  part[ty][tx] = sum;
  __syncthreads();
  if (ty != 0 || c >= n4) return;
#pragma unroll
  for (int r = 1; r < kColSumRowLanes; ++r)
    sum = make_float4(sum.x + part[r][tx].x, sum.y + part[r][tx].y, sum.z + part[r][tx].z, sum.w + part[r][tx].w);
  atomicAdd(dbias + 4 * c, sum.x), atomicAdd(dbias + 4 * c + 1, sum.y), atomicAdd(dbias + 4 * c + 2, sum.z),
      atomicAdd(dbias + 4 * c + 3, sum.w);
}
// y = x over [M, N] rows, ldx and ldy elements apart, converted from TI to TO through fp32.
template <class TI, class TO>
__global__ void convert_rows_kernel(const TI* x, int64_t ldx, TO* y, int64_t ldy, int64_t M, int64_t N) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < M * N; i += int64_t(gridDim.x) * blockDim.x)
    y[i / N * ldy + i % N] = from_f32<TO>(to_f32(x[i / N * ldx + i % N]));
}
template <class T>
struct GeluGrad4 {  // dy ∘ GELU'(x), [M, 4·n4], x and dy stored as T
  const T *x, *dy;
  int n4;
  __device__ __forceinline__ float4 operator()(int64_t m, int c) const {
    const float4 v = load4<T>(x + 4 * (m * n4 + c)), g = load4<T>(dy + 4 * (m * n4 + c));
    return make_float4(g.x * gelu_tanh_grad(v.x), g.y * gelu_tanh_grad(v.y), g.z * gelu_tanh_grad(v.z),
                       g.w * gelu_tanh_grad(v.w));
  }
};
struct MergeQkv4 {  // [q | k | v] rows from three [M, 4·d4] arrays
  const float4 *q, *k, *v;
  int d4;
  __device__ __forceinline__ float4 operator()(int64_t m, int c) const {
    const int part = c / d4, cc = c - part * d4;
    return (part == 0 ? q : part == 1 ? k : v)[m * d4 + cc];
  }
};

// SiTU factors (ops/situ.h); beta ≤ 0 means the cap is absent.
__device__ __forceinline__ float gate_f(float g, float beta) {
  const float s = sigm(g);
  return beta > 0.0f ? beta * tanhf(g / beta) * s : g * s;
}
__device__ __forceinline__ float gate_df(float g, float beta) {
  const float s = sigm(g);
  if (beta <= 0.0f) return s * (1.0f + g * (1.0f - s));
  const float t = tanhf(g / beta);
  return (1.0f - t * t) * s + beta * t * s * (1.0f - s);
}
__device__ __forceinline__ float up_f(float u, float bl) { return bl > 0.0f ? bl * tanhf(u / bl) : u; }
__device__ __forceinline__ float up_df(float u, float bl) {
  if (bl <= 0.0f) return 1.0f;
  const float t = tanhf(u / bl);
  return 1.0f - t * t;
}

template <class T>
__global__ void situ_fwd(const T* gate, const T* up, T* y, int64_t n, float beta, float bl) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  y[i] = from_f32<T>(gate_f(to_f32(gate[i]), beta) * up_f(to_f32(up[i]), bl));
}

template <class T>
__global__ void situ_bwd(const T* gate, const T* up, const T* dy, T* dgate, T* dup, int64_t n, float beta, float bl) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = to_f32(gate[i]), u = to_f32(up[i]), d = to_f32(dy[i]);
  if (dgate) dgate[i] = from_f32<T>(d * gate_df(g, beta) * up_f(u, bl));
  if (dup) dup[i] = from_f32<T>(d * gate_f(g, beta) * up_df(u, bl));
}

template <class T>
__global__ void embed_fwd(const float* table, int64_t vocab, const int64_t* ids, int64_t n, int64_t D, T* y,
                          int* bad) {
  const int64_t row = blockIdx.x;
  const int64_t id = ids[row];
  if (id < 0 || id >= vocab) {
    if (threadIdx.x == 0 && bad) atomicExch(bad, 1);
    return;
  }
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) y[row * D + d] = from_f32<T>(table[id * D + d]);
}

template <class T>
__global__ void embed_bwd(const int64_t* ids, int64_t D, const T* dy, float* dtable) {
  const int64_t row = blockIdx.x, id = ids[row];
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) atomicAdd(&dtable[id * D + d], to_f32(dy[row * D + d]));
}

template <class T>
__global__ void rope_kernel(T* x, int64_t H, int64_t hd, int64_t offset, int64_t half, const int64_t* positions,
                            const double* inv_freq, double factor, int direction) {
  const int64_t m = blockIdx.x;
  const double pos = double(positions[m]);
  for (int64_t e = threadIdx.x; e < H * half; e += blockDim.x) {
    const int64_t h = e / half, i = e % half;
    double sd, cd;
    sincos(pos * inv_freq[i], &sd, &cd);
    const float c = float(cd * factor), s = float(sd * factor) * float(direction > 0 ? 1 : -1);
    T* p = x + (m * H + h) * hd + offset;
    const float a = to_f32(p[2 * i]), b = to_f32(p[2 * i + 1]);
    p[2 * i] = from_f32<T>(a * c - b * s);
    p[2 * i + 1] = from_f32<T>(a * s + b * c);
  }
}

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

__global__ void adamw_kernel(float* w, const float* g, float* m, float* v, int64_t n, float lr, float b1, float b2,
                             float eps, float wd, double c1, double c2) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float gi = g[i];
  const float mi = b1 * m[i] + (1 - b1) * gi, vi = b2 * v[i] + (1 - b2) * gi * gi;
  m[i] = mi;
  v[i] = vi;
  const double mhat = mi / c1, vhat = vi / c2;
  w[i] -= lr * float(mhat / (sqrt(vhat) + eps) + wd * w[i]);
}

// One block per chunk (tensor index, chunk index within it) of kAdamChunk values; four values a
// thread (float4) where the tensor's four arrays are 16-byte aligned (chunks start at multiples
// of 4,096 values). Bias corrections as reciprocals in fp32: the step's rounding is that of the
// fp32 arrays it writes (the tests hold it to the double closed form within 1e-6).
constexpr int kAdamChunk = 4096;
struct AdamW1 {
  float lr, b1, b2, eps, wd, inv_c1, inv_c2;
  __device__ __forceinline__ void operator()(float& p, float g, float& m, float& v) const {
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    p -= lr * (m * inv_c1 / (sqrtf(v * inv_c2) + eps) + wd * p);
  }
};
__global__ void adamw_group_kernel(const AdamWTensor* tensors, const int2* chunks, float lr, float b1, float b2,
                                   float eps, float inv_c1, float inv_c2) {
  const int2 c = chunks[blockIdx.x];
  const AdamWTensor t = tensors[c.x];
  const AdamW1 step{lr, b1, b2, eps, t.weight_decay, inv_c1, inv_c2};
  const int64_t i0 = int64_t(c.y) * kAdamChunk, i1 = i0 + kAdamChunk < t.n ? i0 + kAdamChunk : t.n;
  int64_t i = i0;
  const uintptr_t addr_bits = reinterpret_cast<uintptr_t>(t.param) | reinterpret_cast<uintptr_t>(t.grad) |
                              reinterpret_cast<uintptr_t>(t.m) | reinterpret_cast<uintptr_t>(t.v);
  auto* pb = static_cast<__nv_bfloat16*>(t.param_bf16);
  if ((addr_bits & 15) == 0 && (reinterpret_cast<uintptr_t>(pb) & 7) == 0) {
    for (int64_t j = i0 / 4 + threadIdx.x; j < i1 / 4; j += blockDim.x) {
      float4 p = reinterpret_cast<float4*>(t.param)[j], m = reinterpret_cast<float4*>(t.m)[j],
             v = reinterpret_cast<float4*>(t.v)[j];
      const float4 g = reinterpret_cast<const float4*>(t.grad)[j];
      step(p.x, g.x, m.x, v.x), step(p.y, g.y, m.y, v.y), step(p.z, g.z, m.z, v.z), step(p.w, g.w, m.w, v.w);
      reinterpret_cast<float4*>(t.param)[j] = p, reinterpret_cast<float4*>(t.m)[j] = m,
                                     reinterpret_cast<float4*>(t.v)[j] = v;
      if (pb) reinterpret_cast<uint2*>(pb)[j] = pack_bf16x4(p);
    }
    i = i1 / 4 * 4;  // the tensor's last 0-3 values
  }
  for (i += threadIdx.x; i < i1; i += blockDim.x) {
    step(t.param[i], t.grad[i], t.m[i], t.v[i]);
    if (pb) pb[i] = __float2bfloat16(t.param[i]);
  }
}

__global__ void add_kernel(float* y, const float* x, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] += x[i];
}
// Row-wise kernels on [M, N] arrays: blockIdx.x over column blocks, rows strided by gridDim.y (at
// most 65,535), so no thread divides a flat index by N (64-bit division per element cost the GPT-2
// step's bias adds and q/k/v splits several times their memory time).
// Each thread walks about four rows (its loads unrolled: four in flight rather than one).
inline dim3 row_grid(int64_t M, int64_t N) {
  return dim3(device::blocks_for(N, kThreads), unsigned(std::min<int64_t>((M + 3) / 4, 65535)));
}
__global__ void bias_kernel(float* y, const float* b, int64_t M, int64_t N) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const float bn = b[n];
#pragma unroll 4
  for (int64_t m = blockIdx.y; m < M; m += gridDim.y) y[m * N + n] += bn;
}
template <class T>
__global__ void cast_kernel(const float* x, T* y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = from_f32<T>(x[i]);
}
// Four at a time (the GEMM operand casts of mixed precision move gigabytes per training step).
__global__ void cast_bf16x4_kernel(const float4* x, uint2* y, int64_t n4) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n4) return;
  y[i] = pack_bf16x4(x[i]);
}
template <class T>
__global__ void widen_kernel(const T* x, float* y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = to_f32(x[i]);
}
// The q/k/v column blocks of a fused [M, 3D] projection, its bias added (bias may be null), into
// three contiguous [M, D] arrays stored as T.
template <class TI, class T>
__global__ void split_qkv_to_kernel(const TI* qkv, const float* bias, T* q, T* k, T* v, int64_t M, int64_t D) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= 3 * D) return;
  const int64_t part = c / D, d = c - part * D;
  T* dst = part == 0 ? q : part == 1 ? k : v;
  const float bc = bias ? bias[c] : 0.0f;
#pragma unroll 4
  for (int64_t m = blockIdx.y; m < M; m += gridDim.y) dst[m * D + d] = from_f32<T>(to_f32(qkv[m * 3 * D + c]) + bc);
}
// x[m, n] += bias[n] in place (the pre-activation, kept for the backward), y = GELU(x) stored as T.
template <class T>
__global__ void bias_gelu_kernel(float* x, const float* bias, T* y, int64_t M, int64_t N) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const float bn = bias ? bias[n] : 0.0f;
#pragma unroll 4
  for (int64_t m = blockIdx.y; m < M; m += gridDim.y) {
    const float v = x[m * N + n] + bn;
    x[m * N + n] = v;
    y[m * N + n] = from_f32<T>(gelu_tanh(v));
  }
}

// Both four columns at a time when D % 4 == 0 (and the arrays are 16-byte aligned): a thread per
// (row, column quad), the part found by one 32-bit division per thread.
template <class TI, class T>
__global__ void split_qkv4_kernel(const TI* qkv, const float* bias, T* q, T* k, T* v, int64_t M, int D4) {
  const int c4 = int(blockIdx.x) * blockDim.x + threadIdx.x;  // column quad of [M, 3D]
  if (c4 >= 3 * D4) return;
  const int part = c4 / D4, d4 = c4 - part * D4;
  T* dst = part == 0 ? q : part == 1 ? k : v;
  const float4 b = bias ? reinterpret_cast<const float4*>(bias)[c4] : make_float4(0, 0, 0, 0);
#pragma unroll 4
  for (int64_t m = blockIdx.y; m < M; m += gridDim.y) {
    const float4 x = load4<TI>(qkv + (m * 3 * D4 + c4) * 4);
    store4<T>(dst + (m * D4 + d4) * 4, make_float4(x.x + b.x, x.y + b.y, x.z + b.z, x.w + b.w));
  }
}

// bias_gelu_kernel four columns at a time (N % 4 == 0, aligned arrays).
template <class T>
__global__ void bias_gelu4_kernel(float* x, const float* bias, T* y, int64_t M, int N4) {
  const int n4 = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n4 >= N4) return;
  const float4 b = bias ? reinterpret_cast<const float4*>(bias)[n4] : make_float4(0, 0, 0, 0);
#pragma unroll 4
  for (int64_t m = blockIdx.y; m < M; m += gridDim.y) {
    float4* xp = reinterpret_cast<float4*>(x) + m * N4 + n4;
    const float4 v0 = *xp, v = make_float4(v0.x + b.x, v0.y + b.y, v0.z + b.z, v0.w + b.w);
    *xp = v;
    store4<T>(y + (m * N4 + n4) * 4, make_float4(gelu_tanh(v.x), gelu_tanh(v.y), gelu_tanh(v.z), gelu_tanh(v.w)));
  }
}

__global__ void merge_qkv_kernel(const float* q, const float* k, const float* v, float* qkv, int64_t M, int64_t D) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= 3 * D) return;
  const int64_t part = c / D, d = c - part * D;
  const float* src = part == 0 ? q : part == 1 ? k : v;
#pragma unroll 4
  for (int64_t m = blockIdx.y; m < M; m += gridDim.y) qkv[m * 3 * D + c] = src[m * D + d];
}
// qkv_b (may be null) receives a bf16 copy.
__global__ void merge_qkv4_kernel(const float* q, const float* k, const float* v, float* qkv, uint2* qkv_b, int64_t M,
                                  int D4) {
  const int c4 = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c4 >= 3 * D4) return;
  const int part = c4 / D4, d4 = c4 - part * D4;
  const float4* src = reinterpret_cast<const float4*>(part == 0 ? q : part == 1 ? k : v);
#pragma unroll 4
  for (int64_t m = blockIdx.y; m < M; m += gridDim.y) {
    const float4 x = src[m * D4 + d4];
    reinterpret_cast<float4*>(qkv)[m * 3 * D4 + c4] = x;
    if (qkv_b) qkv_b[m * 3 * D4 + c4] = pack_bf16x4(x);
  }
}
// Whether p is n-byte aligned (n a power of two); four values stored as st take row4_bytes(st).
bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; }
uintptr_t row4_bytes(Storage st) { return st == Storage::BF16 ? 8 : 16; }
// A block per 32 columns and a slice of the rows: 8 warps walk the slice's rows in turn (each
// warp's load coalesced over its 32 columns), their partial sums meet in shared memory and one
// atomic per column adds the slice's sum. Enough slices that every SM has work: one thread per
// column walking all M rows ran N / 256 blocks, latency-bound for milliseconds at M = 8192.
constexpr int kBiasRowLanes = 8;
__global__ void __launch_bounds__(32 * kBiasRowLanes) bias_grad_kernel(const float* dy, float* db, int64_t M,
                                                                       int64_t N, int64_t rows_per_block) {
  __shared__ float part[kBiasRowLanes][33];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int64_t n = int64_t(blockIdx.x) * 32 + tx;
  const int64_t m0 = int64_t(blockIdx.y) * rows_per_block, m1 = m0 + rows_per_block < M ? m0 + rows_per_block : M;
  float s = 0.0f;
  if (n < N)
#pragma unroll 4
    for (int64_t m = m0 + ty; m < m1; m += kBiasRowLanes) s += dy[m * N + n];
  part[ty][tx] = s;
  __syncthreads();
  if (ty != 0 || n >= N) return;
  float total = 0.0f;
#pragma unroll
  for (int r = 0; r < kBiasRowLanes; ++r) total += part[r][tx];
  atomicAdd(&db[n], total);
}

// The grid of the column-sum kernels: col_blocks × slices of `rows` rows, about 1,024 blocks in
// all, each slice at least 64 rows.
dim3 column_sum_grid(int64_t M, int64_t col_blocks, int64_t& rows) {
  const int64_t slices = std::max<int64_t>(1, std::min((1024 + col_blocks - 1) / col_blocks, (M + 63) / 64));
  rows = (M + slices - 1) / slices;
  return dim3(unsigned(col_blocks), unsigned((M + rows - 1) / rows));
}

}  // namespace

void merge_qkv(const float* q, const float* k, const float* v, float* qkv, int64_t M, int64_t D, void* qkv_bf16) {
  if (!M) return;
  if (D % 4 == 0 && 3 * D / 4 <= INT32_MAX && aligned(q, 16) && aligned(k, 16) && aligned(v, 16) &&
      aligned(qkv, 16) && aligned(qkv_bf16, 8)) {
    merge_qkv4_kernel<<<row_grid(M, 3 * D / 4), kThreads, 0, device::stream()>>>(
        q, k, v, qkv, static_cast<uint2*>(qkv_bf16), M, int(D / 4));
    K3_CUDA_LAUNCHED();
    return;
  }
  merge_qkv_kernel<<<row_grid(M, 3 * D), kThreads, 0, device::stream()>>>(q, k, v, qkv, M, D);
  K3_CUDA_LAUNCHED();
  if (qkv_bf16) cast(qkv, qkv_bf16, M * 3 * D, Storage::BF16);
}
void bias_grad(const float* dy, float* db, int64_t M, int64_t N) {
  if (!M || !N) return;
  int64_t rows = 0;
  const dim3 grid = column_sum_grid(M, (N + 31) / 32, rows);
  bias_grad_kernel<<<grid, 32 * kBiasRowLanes, 0, device::stream()>>>(dy, db, M, N, rows);
  K3_CUDA_LAUNCHED();
}

void add_inplace(float* y, const float* x, int64_t n) {
  if (!n) return;
  add_kernel<<<device::blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(y, x, n);
  K3_CUDA_LAUNCHED();
}
void add_bias(float* y, const float* bias, int64_t M, int64_t N) {
  if (!M || !N) return;
  bias_kernel<<<row_grid(M, N), kThreads, 0, device::stream()>>>(y, bias, M, N);
  K3_CUDA_LAUNCHED();
}
void cast(const float* x, void* y, int64_t n, Storage st) {
  if (!n) return;
  if (st == Storage::BF16 && n % 4 == 0 && aligned(x, 16) && aligned(y, 8)) {  // 16-byte loads, 8-byte stores
    const int64_t n4 = n / 4;
    cast_bf16x4_kernel<<<device::blocks_for(n4, kThreads), kThreads, 0, device::stream()>>>(
        reinterpret_cast<const float4*>(x), reinterpret_cast<uint2*>(y), n4);
    K3_CUDA_LAUNCHED();
    return;
  }
  K3_DISPATCH_STORAGE(st, T,
                      cast_kernel<T><<<device::blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(
                          x, static_cast<T*>(y), n));
  K3_CUDA_LAUNCHED();
}
void widen(const void* x, float* y, int64_t n, Storage st) {
  if (!n) return;
  K3_DISPATCH_STORAGE(st, T,
                      widen_kernel<T><<<device::blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(
                          static_cast<const T*>(x), y, n));
  K3_CUDA_LAUNCHED();
}
void split_qkv_to(const float* qkv, const float* bias, void* q, void* k, void* v, int64_t M, int64_t D, Storage st) {
  if (!M) return;
  const uintptr_t out = row4_bytes(st);
  if (D % 4 == 0 && 3 * D / 4 <= INT32_MAX && aligned(qkv, 16) && (!bias || aligned(bias, 16)) && aligned(q, out) &&
      aligned(k, out) && aligned(v, out)) {
    K3_DISPATCH_STORAGE(st, T,
                        split_qkv4_kernel<float, T><<<row_grid(M, 3 * D / 4), kThreads, 0, device::stream()>>>(
                            qkv, bias, static_cast<T*>(q), static_cast<T*>(k), static_cast<T*>(v), M, int(D / 4)));
    K3_CUDA_LAUNCHED();
    return;
  }
  K3_DISPATCH_STORAGE(st, T,
                      split_qkv_to_kernel<float, T><<<row_grid(M, 3 * D), kThreads, 0, device::stream()>>>(
                          qkv, bias, static_cast<T*>(q), static_cast<T*>(k), static_cast<T*>(v), M, D));
  K3_CUDA_LAUNCHED();
}
void split_qkv_bf16(const void* qkv, void* q, void* k, void* v, int64_t M, int64_t D) {
  if (!M) return;
  using B16 = __nv_bfloat16;
  const B16* in = static_cast<const B16*>(qkv);
  B16 *qb = static_cast<B16*>(q), *kb = static_cast<B16*>(k), *vb = static_cast<B16*>(v);
  if (D % 4 == 0 && 3 * D / 4 <= INT32_MAX && aligned(qkv, 8) && aligned(q, 8) && aligned(k, 8) && aligned(v, 8))
    split_qkv4_kernel<B16, B16><<<row_grid(M, 3 * D / 4), kThreads, 0, device::stream()>>>(in, nullptr, qb, kb, vb, M,
                                                                                           int(D / 4));
  else
    split_qkv_to_kernel<B16, B16><<<row_grid(M, 3 * D), kThreads, 0, device::stream()>>>(in, nullptr, qb, kb, vb, M, D);
  K3_CUDA_LAUNCHED();
}
void bias_gelu_tanh_to(float* x, const float* bias, void* y, int64_t M, int64_t N, Storage st) {
  if (!M || !N) return;
  if (N % 4 == 0 && N / 4 <= INT32_MAX && aligned(x, 16) && (!bias || aligned(bias, 16)) &&
      aligned(y, row4_bytes(st))) {
    K3_DISPATCH_STORAGE(st, T,
                        bias_gelu4_kernel<T><<<row_grid(M, N / 4), kThreads, 0, device::stream()>>>(
                            x, bias, static_cast<T*>(y), M, int(N / 4)));
    K3_CUDA_LAUNCHED();
    return;
  }
  K3_DISPATCH_STORAGE(st, T,
                      bias_gelu_kernel<T><<<row_grid(M, N), kThreads, 0, device::stream()>>>(
                          x, bias, static_cast<T*>(y), M, N));
  K3_CUDA_LAUNCHED();
}

void gelu_tanh_forward(const void* x, void* y, int64_t n, Storage st) {
  if (!n) return;
  if (n % 4 == 0 && aligned(x, row4_bytes(st)) && aligned(y, row4_bytes(st))) {
    K3_DISPATCH_STORAGE(st, T,
                        gelu4_fwd<T><<<device::blocks_for(n / 4, 2 * kThreads), kThreads, 0, device::stream()>>>(
                            static_cast<const T*>(x), static_cast<T*>(y), n / 4));
    K3_CUDA_LAUNCHED();
    return;
  }
  K3_DISPATCH_STORAGE(st, T,
                      gelu_fwd<T><<<device::blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(
                          static_cast<const T*>(x), static_cast<T*>(y), n));
  K3_CUDA_LAUNCHED();
}
void gelu_tanh_backward(const void* x, const void* dy, void* dx, int64_t n, Storage st, void* dx_bf16) {
  if (!n) return;
  if (dx_bf16 && st != Storage::F32) throw error("gelu_tanh_backward", "a bf16 copy of dx needs fp32 storage");
  K3_DISPATCH_STORAGE(st, T,
                      gelu_bwd<T><<<device::blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(
                          static_cast<const T*>(x), static_cast<const T*>(dy), static_cast<T*>(dx), n));
  K3_CUDA_LAUNCHED();
  if (dx_bf16) cast(static_cast<const float*>(dx), dx_bf16, n, Storage::BF16);
}
template <class Value>
void launch_rows_with_column_sums(Value value, float* out, void* out_b, float* dbias, int64_t M, int64_t n4,
                                  int64_t ld4 = 0) {
  int64_t rows = 0;
  const dim3 grid = column_sum_grid(M, (n4 + 31) / 32, rows);
  rows_with_column_sums_kernel<<<grid, 32 * kColSumRowLanes, 0, device::stream()>>>(
      value, reinterpret_cast<float4*>(out), static_cast<uint2*>(out_b), ld4 ? ld4 : n4, dbias, M, int(n4), rows);
  K3_CUDA_LAUNCHED();
}
template <class T>
struct Rows4 {  // the rows of an array stored as T, ld4 groups of 4 apart
  const T* x;
  int64_t ld4;
  __device__ __forceinline__ float4 operator()(int64_t m, int c) const { return load4<T>(x + 4 * (m * ld4 + c)); }
};
void column_sums(const void* x, int64_t M, int64_t N, int64_t ldx, Storage st, float* dbias) {
  if (!M || !N) return;
  if (ldx < N) throw error("column_sums", "rows of ", N, " values cannot be ", ldx, " apart");
  if (st == Storage::BF16 && N % 4 == 0 && ldx % 4 == 0 && N / 4 <= INT32_MAX && aligned(x, 8))
    return launch_rows_with_column_sums(Rows4<__nv_bfloat16>{static_cast<const __nv_bfloat16*>(x), ldx / 4},
                                        nullptr, nullptr, dbias, M, N / 4);
  if (st == Storage::F32 && ldx == N) return bias_grad(static_cast<const float*>(x), dbias, M, N);
  // Other layouts: the rows widened into a contiguous fp32 array first.
  device::Buffer f(size_t(M * N) * sizeof(float));
  K3_DISPATCH_STORAGE(st, T,
                      convert_rows_kernel<<<device::blocks_for(M * N, kThreads), kThreads, 0, device::stream()>>>(
                          static_cast<const T*>(x), ldx, f.as<float>(), N, M, N));
  K3_CUDA_LAUNCHED();
  bias_grad(f.as<float>(), dbias, M, N);
}
void to_bf16_with_column_sums(const float* x, int64_t M, int64_t N, void* y, int64_t ldy, float* dbias) {
  if (!M || !N) return;
  if (ldy < N) throw error("to_bf16_with_column_sums", "rows of ", N, " values cannot be ", ldy, " apart");
  if (N % 4 == 0 && ldy % 4 == 0 && N / 4 <= INT32_MAX && aligned(x, 16) && aligned(y, 8))
    return launch_rows_with_column_sums(Rows4<float>{x, N / 4}, nullptr, y, dbias, M, N / 4, ldy / 4);
  // Other shapes: one value a thread, then the sums.
  convert_rows_kernel<<<device::blocks_for(M * N, kThreads), kThreads, 0, device::stream()>>>(
      x, N, static_cast<__nv_bfloat16*>(y), ldy, M, N);
  K3_CUDA_LAUNCHED();
  if (dbias) bias_grad(x, dbias, M, N);
}
void gelu_tanh_backward_bias(const float* x, const float* dy, int64_t M, int64_t N, float* dx, void* dx_bf16,
                             float* dbias) {
  if (!M || !N) return;
  if (N % 4 == 0 && N / 4 <= INT32_MAX && aligned(x, 16) && aligned(dy, 16) && aligned(dx, 16) &&
      aligned(dx_bf16, 8)) {
    const GeluGrad4<float> value{x, dy, int(N / 4)};
    return launch_rows_with_column_sums(value, dx, dx_bf16, dbias, M, N / 4);
  }
  // Other shapes: the composed ops (dx through an fp32 array of its own if none was given).
  device::Buffer own;
  if (!dx) own = device::Buffer(size_t(M * N) * sizeof(float)), dx = own.as<float>();
  gelu_tanh_backward(x, dy, dx, M * N, Storage::F32, dx_bf16);
  bias_grad(dx, dbias, M, N);
}
void gelu_tanh_backward_bias_bf16(const void* x, const void* dy, int64_t M, int64_t N, void* dx_bf16, float* dbias) {
  if (!M || !N) return;
  using B16 = __nv_bfloat16;
  if (N % 4 == 0 && N / 4 <= INT32_MAX && aligned(x, 8) && aligned(dy, 8) && aligned(dx_bf16, 8)) {
    const GeluGrad4<B16> value{static_cast<const B16*>(x), static_cast<const B16*>(dy), int(N / 4)};
    return launch_rows_with_column_sums(value, nullptr, dx_bf16, dbias, M, N / 4);
  }
  // Other shapes: widened to fp32 and the fp32 form's composed path.
  device::Buffer xf(size_t(M * N) * sizeof(float)), dyf(size_t(M * N) * sizeof(float));
  widen(x, xf.as<float>(), M * N, Storage::BF16);
  widen(dy, dyf.as<float>(), M * N, Storage::BF16);
  gelu_tanh_backward_bias(xf.as<float>(), dyf.as<float>(), M, N, nullptr, dx_bf16, dbias);
}
void merge_qkv_bias(const float* q, const float* k, const float* v, int64_t M, int64_t D, float* qkv, void* qkv_bf16,
                    float* dbias) {
  if (!M || !D) return;
  if (D % 4 == 0 && 3 * D / 4 <= INT32_MAX && aligned(q, 16) && aligned(k, 16) && aligned(v, 16) &&
      aligned(qkv, 16) && aligned(qkv_bf16, 8)) {
    const MergeQkv4 value{reinterpret_cast<const float4*>(q), reinterpret_cast<const float4*>(k),
                          reinterpret_cast<const float4*>(v), int(D / 4)};
    return launch_rows_with_column_sums(value, qkv, qkv_bf16, dbias, M, 3 * D / 4);
  }
  device::Buffer own;
  if (!qkv) own = device::Buffer(size_t(M * 3 * D) * sizeof(float)), qkv = own.as<float>();
  merge_qkv(q, k, v, qkv, M, D, qkv_bf16);
  if (dbias) bias_grad(qkv, dbias, M, 3 * D);
}
void situ_glu_forward(const void* gate, const void* up, void* y, int64_t n, float beta, float beta_lin, Storage st) {
  if (!n) return;
  K3_DISPATCH_STORAGE(st, T,
                      situ_fwd<T><<<device::blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(
                          static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(y), n, beta,
                          beta_lin));
  K3_CUDA_LAUNCHED();
}
void situ_glu_backward(const void* gate, const void* up, const void* dy, void* dgate, void* dup, int64_t n,
                       float beta, float beta_lin, Storage st) {
  if (!n) return;
  K3_DISPATCH_STORAGE(st, T,
                      situ_bwd<T><<<device::blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(
                          static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<const T*>(dy),
                          static_cast<T*>(dgate), static_cast<T*>(dup), n, beta, beta_lin));
  K3_CUDA_LAUNCHED();
}

void embedding_forward(const float* table, int64_t vocab, const int64_t* ids, int64_t n, int64_t D, void* y,
                       Storage st, bool check_ids) {
  if (!n) return;
  if (!check_ids) {  // the caller validated the ids on the host: no flag, no synchronisation
    K3_DISPATCH_STORAGE(st, T,
                        embed_fwd<T><<<unsigned(n), kThreads, 0, device::stream()>>>(table, vocab, ids, n, D,
                                                                                     static_cast<T*>(y), nullptr));
    K3_CUDA_LAUNCHED();
    return;
  }
  device::Buffer bad(sizeof(int));
  device::zero(bad.get(), sizeof(int));
  K3_DISPATCH_STORAGE(st, T,
                      embed_fwd<T><<<unsigned(n), kThreads, 0, device::stream()>>>(table, vocab, ids, n, D,
                                                                                   static_cast<T*>(y), bad.as<int>()));
  K3_CUDA_LAUNCHED();
  int flag = 0;
  device::download(&flag, bad.get(), sizeof(int));
  if (flag) throw error("embedding", "a token id is outside the vocabulary [0, ", vocab, ")");
}
void embedding_backward(const int64_t* ids, int64_t n, int64_t D, const void* dy, float* dtable, Storage st) {
  if (!n) return;
  K3_DISPATCH_STORAGE(st, T,
                      embed_bwd<T><<<unsigned(n), kThreads, 0, device::stream()>>>(ids, D, static_cast<const T*>(dy),
                                                                                   dtable));
  K3_CUDA_LAUNCHED();
}

void rope_apply(void* x, int64_t M, int64_t H, int64_t hd, int64_t offset, int64_t rot, const int64_t* positions,
                const double* inv_freq, double attn_factor, int direction, Storage st) {
  if (!M || rot <= 0) return;
  K3_DISPATCH_STORAGE(st, T,
                      rope_kernel<T><<<unsigned(M), 128, 0, device::stream()>>>(
                          static_cast<T*>(x), H, hd, offset, rot / 2, positions, inv_freq, attn_factor, direction));
  K3_CUDA_LAUNCHED();
}

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

AdamWGroup::AdamWGroup(const std::vector<AdamWTensor>& tensors) {
  std::vector<int2> chunks;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t count = (tensors[t].n + kAdamChunk - 1) / kAdamChunk;
    if (count > INT32_MAX || t > size_t(INT32_MAX))
      throw error("adamw", "a tensor of ", tensors[t].n, " values is too large");
    for (int64_t c = 0; c < count; ++c) chunks.push_back(make_int2(int(t), int(c)));
  }
  chunks_count_ = int64_t(chunks.size());
  if (chunks_count_ > INT32_MAX) throw error("adamw", chunks_count_, " chunks are more than one launch takes");
  if (!chunks.empty()) {
    tensors_ = device::upload_new(tensors.data(), tensors.size() * sizeof(AdamWTensor));
    chunks_ = device::upload_new(chunks.data(), chunks.size() * sizeof(int2));
  }
}
void AdamWGroup::step(const AdamWStep& s) const {
  if (!chunks_count_) return;
  const double c1 = 1.0 - std::pow(double(s.beta1), double(s.step));
  const double c2 = 1.0 - std::pow(double(s.beta2), double(s.step));
  adamw_group_kernel<<<unsigned(chunks_count_), kThreads, 0, device::stream()>>>(
      tensors_.as<AdamWTensor>(), chunks_.as<int2>(), s.lr, s.beta1, s.beta2, s.eps, float(1.0 / c1), float(1.0 / c2));
  K3_CUDA_LAUNCHED();
}

void adamw(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& s) {
  if (!n) return;
  const double c1 = 1.0 - std::pow(double(s.beta1), double(s.step));
  const double c2 = 1.0 - std::pow(double(s.beta2), double(s.step));
  adamw_kernel<<<device::blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(
      param, grad, m, v, n, s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, c1, c2);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
