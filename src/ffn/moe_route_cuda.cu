// Grouped top-k expert selection on the device (moe.h's select_experts, the same rule): one block
// per token. The choice scores (scores + bias) sit in shared memory; with groups, each group's
// score is the sum of its two best choices and the best topk_group groups stay; then k rounds of
// a block-wide argmax pick the experts in the host's order: higher score first, ties to the lower
// index, NaN as −inf. Only the [M, K] ids go back to the host (not the [M, E] scores).
#include <cmath>

#include "core/cuda_util.cuh"
#include "core/device.h"
#include "ffn/moe_cuda.h"
#include "ffn/moe_group_score.h"

namespace k3::gpu {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float key(float f) { return isnan(f) ? -INFINITY : f; }
// (score a, index ia) before (score b, index ib)?
__device__ __forceinline__ bool before(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

// The best (key, index) of the block; every thread gets it. idx −1 when no thread had one.
__device__ void block_best(float& v, int& i, float* sv, int* si) {
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
    if (i2 >= 0 && (i < 0 || before(v2, i2, v, i))) v = v2, i = i2;
  }
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  __syncthreads();  // the previous round's readers of sv / si are done
  if (threadIdx.x % 32 == 0) sv[warp] = v, si[warp] = i;
  __syncthreads();
  v = -INFINITY, i = -1;
  for (int w = 0; w < warps; ++w)
    if (si[w] >= 0 && (i < 0 || before(sv[w], si[w], v, i))) v = sv[w], i = si[w];
}

// The block-wide best x[j] (by key, ties to the lower j) among the j < n with !skip[j]; every
// thread gets it, −1 when there is none.
__device__ int best_candidate(const float* x, const unsigned char* skip, int n, float* sv, int* si) {
  float v = -INFINITY;
  int i = -1;
  for (int j = threadIdx.x; j < n; j += blockDim.x)
    if (!skip[j] && (i < 0 || before(key(x[j]), j, v, i))) v = key(x[j]), i = j;
  block_best(v, i, sv, si);
  return i;
}

__global__ void __launch_bounds__(kThreads) select_kernel(const float* scores, const float* bias, int E, int K,
                                                         int n_group, int topk_group, int64_t* out) {
  extern __shared__ float smem[];
  float* c = smem;                                        // [E] choice scores (NaN kept, as the host sees them)
  unsigned char* taken = reinterpret_cast<unsigned char*>(c + E);  // [E] 1: not a candidate (any more)
  __shared__ float sv[kThreads / 32];
  __shared__ int si[kThreads / 32];
  __shared__ float gscore[64];
  __shared__ unsigned char gsel[64];
  const int64_t m = blockIdx.x;
  const bool grouped = n_group > 1 && topk_group < n_group;
  const int gsize = E / n_group;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    c[e] = scores[m * E + e] + (bias ? bias[e] : 0.0f);
    taken[e] = grouped ? 1 : 0;
  }
  __syncthreads();
  if (grouped) {
    for (int g = threadIdx.x; g < n_group; g += kThreads) {
      gscore[g] = moe_group_score(c, g * gsize, (g + 1) * gsize);
      gsel[g] = 0;
    }
    __syncthreads();
    for (int round = 0; round < topk_group; ++round) {
      const int i = best_candidate(gscore, gsel, n_group, sv, si);
      __syncthreads();
      if (threadIdx.x == 0) gsel[i] = 1;
      for (int j = i * gsize + int(threadIdx.x); j < (i + 1) * gsize; j += kThreads) taken[j] = 0;
      __syncthreads();
    }
  }
  for (int k = 0; k < K; ++k) {
    const int i = best_candidate(c, taken, E, sv, si);
    if (threadIdx.x == 0) {
      out[m * K + k] = i;
      if (i >= 0) taken[i] = 1;
    }
    __syncthreads();
  }
}

}  // namespace

std::vector<int64_t> select_experts(const Tensor& scores, const Tensor& bias, int64_t K, int64_t n_group,
                                    int64_t topk_group) {
  const device::Buffer d_out = select_experts_on_device(scores, bias, K, n_group, topk_group);
  std::vector<int64_t> out(size_t(scores.dim(0) * K));
  device::download(out.data(), d_out.get(), out.size() * sizeof(int64_t));
  return out;
}

device::Buffer select_experts_on_device(const Tensor& scores, const Tensor& bias, int64_t K, int64_t n_group,
                                        int64_t topk_group) {
  K3_CHECK(scores.device() == Device::CUDA && scores.ndim() == 2 && scores.is_contiguous() &&
               scores.dtype() == DType::F32,
           "moe: routing scores ", scores.describe(), " are not a contiguous fp32 [tokens, experts] device tensor");
  const int64_t M = scores.dim(0), E = scores.dim(1);
  K3_CHECK(!bias.defined() || (bias.device() == Device::CUDA && bias.numel() == E && bias.dtype() == DType::F32),
           "moe: selection bias ", bias.describe(), " does not fit ", E, " experts on the device");
  K3_CHECK(K >= 1 && n_group >= 1 && E % n_group == 0 && n_group <= 64 && topk_group >= 1 && topk_group <= n_group &&
               K <= (n_group > 1 && topk_group < n_group ? topk_group * (E / n_group) : E),
           "moe: cannot pick ", K, " of ", E, " experts in ", topk_group, " of ", n_group, " groups on the device");
  device::Buffer d_out(size_t(M * K) * sizeof(int64_t));
  if (M == 0) return d_out;
  const size_t smem = size_t(E) * (sizeof(float) + 1);
  select_kernel<<<unsigned(M), kThreads, smem, device::stream()>>>(scores.cuda_f32(), bias.defined() ? bias.cuda_f32() : nullptr,
                                                                   int(E), int(K), int(n_group), int(topk_group),
                                                                   d_out.as<int64_t>());
  K3_CUDA_LAUNCHED();
  return d_out;
}

namespace {
// One thread per token: w[m, k] = scores[m, idx] (+ offset[idx]), renormalised over k (÷ (Σ + eps),
// in k order as the host sums) and scaled; dense[m, :] zero but for the chosen columns.
__global__ void dense_weights_kernel(const float* scores, const int64_t* idx, const float* offset, int64_t M, int E,
                                     int K, bool renorm, float eps, float scaling, float* w, float* dense) {
  const int64_t m = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (m >= M) return;
  float sum = 0.0f;
  for (int k = 0; k < K; ++k) {
    const int64_t e = idx[m * K + k];
    const float x = scores[m * E + e] + (offset ? offset[e] : 0.0f);
    w[m * K + k] = x;
    sum += x;
  }
  const float den = sum + eps;
  for (int e = 0; e < E; ++e) dense[m * E + e] = 0.0f;
  for (int k = 0; k < K; ++k) {
    float x = w[m * K + k];
    if (renorm) x = x / den;
    if (scaling != 1.0f) x = x * scaling;
    w[m * K + k] = x;
    dense[m * E + idx[m * K + k]] += x;
  }
}

// out[m, c] = Σ_e dense[m, e] · y[e, m, c], skipping zero weights.
__global__ void dense_combine_kernel(const float* y, const float* dense, int64_t M, int E, int64_t C, float* out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= M * C) return;
  const int64_t m = i / C, c = i % C;
  float acc = 0.0f;
  for (int e = 0; e < E; ++e) {
    const float we = dense[m * E + e];
    if (we != 0.0f) acc += we * y[(int64_t(e) * M + m) * C + c];
  }
  out[i] = acc;
}
}  // namespace

void dense_weights(const Tensor& scores, const device::Buffer& idx, const Tensor& offset, int64_t K, bool renorm,
                   float eps, float scaling, Tensor& w, Tensor& dense) {
  K3_CHECK(scores.device() == Device::CUDA && scores.ndim() == 2 && scores.is_contiguous() &&
               scores.dtype() == DType::F32,
           "moe: routing scores ", scores.describe(), " are not a contiguous fp32 [tokens, experts] device tensor");
  const int64_t M = scores.dim(0), E = scores.dim(1);
  K3_CHECK(K >= 1 && K <= E && idx.bytes() >= size_t(M * K) * sizeof(int64_t), "moe: ", idx.bytes(),
           " bytes of expert ids for ", M, " tokens x top-", K);
  K3_CHECK(!offset.defined() || (offset.device() == Device::CUDA && offset.numel() == E), "moe: combine offset ",
           offset.describe(), " for ", E, " experts");
  w = Tensor::empty_on(Device::CUDA, {M, K});
  dense = Tensor::empty_on(Device::CUDA, {M, E});
  if (M == 0) return;
  dense_weights_kernel<<<unsigned((M + kThreads - 1) / kThreads), kThreads, 0, device::stream()>>>(
      scores.cuda_f32(), idx.as<int64_t>(), offset.defined() ? offset.cuda_f32() : nullptr, M, int(E), int(K), renorm,
      eps, scaling, w.cuda_f32(), dense.cuda_f32());
  K3_CUDA_LAUNCHED();
}

void dense_combine(const float* y, const Tensor& dense, int64_t C, float* out) {
  const int64_t M = dense.dim(0), E = dense.dim(1), n = M * C;
  if (!n) return;
  dense_combine_kernel<<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, device::stream()>>>(
      y, dense.cuda_f32(), M, int(E), C, out);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::gpu
