// KDA gate parameterisations on CUDA (ops/gates.h has the math). One thread per element; the
// per-head A_log and per-channel dt_bias gradients are atomic sums.
#include "core/cuda_util.cuh"
#include "ops/ops_cuda.h"

namespace k3::cuda {
namespace {

__device__ __forceinline__ float softplus(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }
__device__ __forceinline__ float sigmoid(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
  const float e = expf(x);
  return e / (1.0f + e);
}

__global__ void softplus_fwd(const float* x, const float* A_log, const float* dt_bias, float* g, GateShape s) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= s.rows * s.H * s.K) return;
  const int64_t hk = i % (s.H * s.K), h = hk / s.K;
  g[i] = -expf(A_log[h]) * softplus(x[i] + dt_bias[hk]);
}

__global__ void softplus_bwd(const float* x, const float* A_log, const float* dt_bias, const float* dg, float* dx,
                             float* dA, float* db, GateShape s) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= s.rows * s.H * s.K) return;
  const int64_t hk = i % (s.H * s.K), h = hk / s.K;
  const float a = expf(A_log[h]), u = x[i] + dt_bias[hk];
  const float du = -a * sigmoid(u) * dg[i];
  if (dx) dx[i] += du;
  if (db) atomicAdd(&db[hk], du);
  if (dA) atomicAdd(&dA[h], dg[i] * (-a * softplus(u)));
}

__global__ void lowerbound_fwd(const float* x, const float* A_log, const float* dt_bias, float lb, float* g,
                               GateShape s) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= s.rows * s.H * s.K) return;
  const int64_t hk = i % (s.H * s.K), h = hk / s.K;
  g[i] = lb * sigmoid(expf(A_log[h]) * (x[i] + dt_bias[hk]));
}

__global__ void lowerbound_bwd(const float* x, const float* A_log, const float* dt_bias, float lb, const float* dg,
                               float* dx, float* dA, float* db, GateShape s) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= s.rows * s.H * s.K) return;
  const int64_t hk = i % (s.H * s.K), h = hk / s.K;
  const float a = expf(A_log[h]), u = x[i] + dt_bias[hk];
  const float sg = sigmoid(a * u);
  const float dz = dg[i] * lb * sg * (1.0f - sg);
  if (dx) dx[i] += dz * a;
  if (db) atomicAdd(&db[hk], dz * a);
  if (dA) atomicAdd(&dA[h], dz * a * u);
}

constexpr int kThreads = 256;

}  // namespace

void gate_softplus_forward(const float* x, const float* A_log, const float* dt_bias, float* g, GateShape s) {
  const int64_t n = s.rows * s.H * s.K;
  if (!n) return;
  softplus_fwd<<<device::blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(x, A_log, dt_bias, g, s);
  K3_CUDA_LAUNCHED();
}
void gate_softplus_backward(const float* x, const float* A_log, const float* dt_bias, const float* dg, float* dx,
                            float* dA_log, float* ddt_bias, GateShape s) {
  const int64_t n = s.rows * s.H * s.K;
  if (!n) return;
  softplus_bwd<<<device::blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(x, A_log, dt_bias, dg, dx, dA_log,
                                                                                    ddt_bias, s);
  K3_CUDA_LAUNCHED();
}
void gate_lowerbound_forward(const float* x, const float* A_log, const float* dt_bias, float lower_bound, float* g,
                             GateShape s) {
  const int64_t n = s.rows * s.H * s.K;
  if (!n) return;
  lowerbound_fwd<<<device::blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(x, A_log, dt_bias, lower_bound,
                                                                                      g, s);
  K3_CUDA_LAUNCHED();
}
void gate_lowerbound_backward(const float* x, const float* A_log, const float* dt_bias, float lower_bound,
                              const float* dg, float* dx, float* dA_log, float* ddt_bias, GateShape s) {
  const int64_t n = s.rows * s.H * s.K;
  if (!n) return;
  lowerbound_bwd<<<device::blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(
      x, A_log, dt_bias, lower_bound, dg, dx, dA_log, ddt_bias, s);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
