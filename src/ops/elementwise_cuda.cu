// Elementwise ops on CUDA: the maps and products of ops/elementwise.h with their backward, adds,
// bias rows and their gradient (column sums), storage casts, the sum of squares, and the q/k/v
// column layouts of a fused attention projection.
#include <algorithm>
#include <cmath>

#include "ops/kernels_cuda.cuh"

namespace k3::cuda {
namespace {

__global__ void add_kernel(float* y, const float* x, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] += x[i];
}
// y = x over [M, N] rows, ldx and ldy elements apart, converted from TI to TO through fp32.
template <class TI, class TO>
__global__ void convert_rows_kernel(const TI* x, int64_t ldx, TO* y, int64_t ldy, int64_t M, int64_t N) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < M * N; i += int64_t(gridDim.x) * blockDim.x)
    y[i / N * ldy + i % N] = from_f32<TO>(to_f32(x[i / N * ldx + i % N]));
}
struct MergeQkv4 {  // [q | k | v] rows from three [M, 4·d4] arrays
  const float4 *q, *k, *v;
  int d4;
  __device__ __forceinline__ float4 operator()(int64_t m, int c) const {
    const int part = c / d4, cc = c - part * d4;
    return (part == 0 ? q : part == 1 ? k : v)[m * d4 + cc];
  }
};

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


__global__ void unary_kernel(const float* x, float* y, int64_t n, Unary op, float s) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  switch (op) {
    case Unary::Scale: y[i] = v * s; break;
    case Unary::Sigmoid: y[i] = sigm(v); break;
    case Unary::Silu: y[i] = v * sigm(v); break;
    case Unary::Elu1: y[i] = v > 0.0f ? v + 1.0f : expf(v); break;
  }
}

__global__ void binary_kernel(const float* a, const float* b, float* y, int64_t n, Binary op) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  y[i] = op == Binary::Add ? a[i] + b[i] : a[i] * b[i];
}

__global__ void unary_bwd_kernel(const float* x, const float* dy, float* dx, int64_t n, Unary op, float s) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  float d = 0.0f;
  switch (op) {
    case Unary::Scale: d = s; break;
    case Unary::Sigmoid: { const float q = sigm(v); d = q * (1.0f - q); break; }
    case Unary::Silu: { const float q = sigm(v); d = q * (1.0f + v * (1.0f - q)); break; }
    case Unary::Elu1: d = v > 0.0f ? 1.0f : expf(v); break;
  }
  dx[i] += dy[i] * d;
}

__global__ void mul_bwd_kernel(const float* a, const float* b, const float* dy, float* da, float* db, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = dy[i];
  if (da) da[i] += g * b[i];
  if (db) db[i] += g * a[i];
}

__global__ void sum_squares_kernel(const float* x, int64_t n, double* out) {
  __shared__ float scratch[32];
  float s = 0.0f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    s += x[i] * x[i];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) atomicAdd(out, double(s));
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

void unary(const float* x, float* y, int64_t n, Unary op, float s) {
  if (!n) return;
  unary_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(x, y, n, op, s);
  K3_CUDA_LAUNCHED();
}

void binary(const float* a, const float* b, float* y, int64_t n, Binary op) {
  if (!n) return;
  binary_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(a, b, y, n, op);
  K3_CUDA_LAUNCHED();
}

void unary_backward(const float* x, const float* dy, float* dx, int64_t n, Unary op, float s) {
  if (!n) return;
  unary_bwd_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(x, dy, dx, n, op, s);
  K3_CUDA_LAUNCHED();
}

void mul_backward(const float* a, const float* b, const float* dy, float* da, float* db, int64_t n) {
  if (!n || (!da && !db)) return;
  mul_bwd_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(a, b, dy, da, db, n);
  K3_CUDA_LAUNCHED();
}

void sum_squares(const float* x, int64_t n, double* acc) {
  if (!n) return;
  const int64_t blocks = std::min<int64_t>(blocks_for(n, kThreads), 1024);
  sum_squares_kernel<<<unsigned(blocks), kThreads, 0, device::stream()>>>(x, n, acc);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
