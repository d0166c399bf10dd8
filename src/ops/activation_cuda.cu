// GELU (tanh form) and SiTU-GLU on CUDA, forward and backward, with the fused forms of GPT-2's
// training step (bias + GELU, the GELU's backward with its bias gradient). The math of
// ops/activation.h and ops/situ.h; tested against them (ops_cuda_test.cc).
#include <algorithm>
#include <cmath>

#include "ops/kernels_cuda.cuh"

namespace k3::cuda {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;

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

}  // namespace

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

}  // namespace k3::cuda
