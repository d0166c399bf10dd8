// Attention Residuals on CUDA: one block per token row; per source two block sums (Σ v², Σ w·v)
// give the scores, then a softmax over the J sources (attnres.cc has the math and the backward's
// derivation). dquery/drmsw are per-row contributions added atomically.
#include "core/cuda_util.cuh"
#include "residual/attnres_cuda.h"

namespace k3::cuda {
namespace {

using device::block_sum;

constexpr int kThreads = 256;

struct Sources {
  const float* src[kAttnResMaxSources];
  float* dsrc[kAttnResMaxSources];
  int J;
};

// Scores of one row into shared arrays: inv_rms[j], u[j], p[j] (softmax). A warp per source (a
// source's two sums need no block barrier; a decode step's few rows each took 2·J block sums, 9 µs
// a call), then one warp's softmax over the J ≤ 32 sources, a lane each.
__device__ void row_scores(const Sources& S, const float* query, const float* rmsw, float eps, int64_t row, int64_t D,
                           float* inv_rms, float* u, float* p) {
  static_assert(kAttnResMaxSources <= 32, "one lane per source in the softmax");
  const int lane = int(threadIdx.x) & 31, warp = int(threadIdx.x) >> 5, nwarps = int(blockDim.x) >> 5;
  for (int j = warp; j < S.J; j += nwarps) {
    const float* v = S.src[j] + row * D;
    float ss = 0.0f, dot = 0.0f;
    for (int64_t d = lane; d < D; d += 32) {
      ss += v[d] * v[d];
      dot += rmsw[d] * query[d] * v[d];
    }
    ss = device::warp_sum(ss);
    dot = device::warp_sum(dot);
    if (lane == 0) {
      inv_rms[j] = rsqrtf(ss / float(D) + eps);
      u[j] = dot;
    }
  }
  __syncthreads();
  if (warp == 0) {
    const float score = lane < S.J ? inv_rms[lane] * u[lane] : -INFINITY;
    const float mx = device::warp_max(score);  // every lane takes part in the shuffles
    const float e = lane < S.J ? expf(score - mx) : 0.0f;
    const float tot = device::warp_sum(e);
    if (lane < S.J) p[lane] = e / tot;
  }
  __syncthreads();
}

__global__ void fwd_kernel(const __grid_constant__ Sources S, const float* query, const float* rmsw, float eps, float* o,
                           int64_t D) {
  __shared__ float inv_rms[kAttnResMaxSources], u[kAttnResMaxSources], p[kAttnResMaxSources];
  const int64_t row = blockIdx.x;
  row_scores(S, query, rmsw, eps, row, D, inv_rms, u, p);
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < S.J; ++j) acc += p[j] * S.src[j][row * D + d];
    o[row * D + d] = acc;
  }
}

__global__ void bwd_kernel(const __grid_constant__ Sources S, const float* query, const float* rmsw, float eps,
                           const float* dy, float* dquery, float* drmsw, int64_t D) {
  __shared__ float scratch[32], inv_rms[kAttnResMaxSources], u[kAttnResMaxSources], p[kAttnResMaxSources],
      c[kAttnResMaxSources];
  const int64_t row = blockIdx.x;
  row_scores(S, query, rmsw, eps, row, D, inv_rms, u, p);
  const float* g = dy + row * D;
  for (int j = 0; j < S.J; ++j) {
    const float* v = S.src[j] + row * D;
    float acc = 0.0f;
    for (int64_t d = threadIdx.x; d < D; d += blockDim.x) acc += g[d] * v[d];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) c[j] = acc;
  }
  __syncthreads();
  float mean_c = 0.0f;
  for (int j = 0; j < S.J; ++j) mean_c += p[j] * c[j];
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) {
    const float w = rmsw[d] * query[d];
    float dw = 0.0f;
    for (int j = 0; j < S.J; ++j) {
      const float vd = S.src[j][row * D + d];
      const float ds = p[j] * (c[j] - mean_c);
      const float du = ds * inv_rms[j];
      const float k = ds * u[j] * inv_rms[j] * inv_rms[j] * inv_rms[j] / float(D);
      if (S.dsrc[j]) S.dsrc[j][row * D + d] += p[j] * g[d] + du * w - k * vd;
      dw += du * vd;
    }
    if (dquery) atomicAdd(&dquery[d], dw * rmsw[d]);
    if (drmsw) atomicAdd(&drmsw[d], dw * query[d]);
  }
}

Sources pack(const std::vector<const float*>& sources, const std::vector<float*>* dsources) {
  if (sources.empty() || sources.size() > size_t(kAttnResMaxSources))
    throw error("attnres", "the CUDA kernel mixes 1 to ", kAttnResMaxSources, " sources, got ", sources.size());
  Sources S{};
  S.J = int(sources.size());
  for (size_t j = 0; j < sources.size(); ++j) {
    S.src[j] = sources[j];
    S.dsrc[j] = dsources ? (*dsources)[j] : nullptr;
  }
  return S;
}

}  // namespace

void attnres_forward(const std::vector<const float*>& sources, const float* query, const float* rmsw, float eps,
                     float* o, AttnResShape s) {
  const Sources S = pack(sources, nullptr);
  if (!s.rows) return;
  fwd_kernel<<<unsigned(s.rows), kThreads, 0, device::stream()>>>(S, query, rmsw, eps, o, s.D);
  K3_CUDA_LAUNCHED();
}

void attnres_backward(const std::vector<const float*>& sources, const float* query, const float* rmsw, float eps,
                      const float* d_o, const std::vector<float*>& dsources, float* dquery, float* drmsw,
                      AttnResShape s) {
  K3_CHECK(dsources.size() == sources.size());
  const Sources S = pack(sources, &dsources);
  if (!s.rows) return;
  bwd_kernel<<<unsigned(s.rows), kThreads, 0, device::stream()>>>(S, query, rmsw, eps, d_o, dquery, drmsw, s.D);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
