// Copies between sequences' separate device allocations and one contiguous batch array
// (mixers_cuda.h, cuda::gather_blocks / scatter_blocks).
#include <algorithm>
#include <cmath>

#include "core/cuda_util.cuh"
#include "mixers/mixers_cuda.h"

namespace k3::cuda {
namespace {

using namespace device;

constexpr int kThreads = 256;

// dst[b·n + i] = src[b][i] (gather), or the reverse (scatter), over B blocks of n floats.
__global__ void blocks_kernel(const float* const* srcs, const float* src, float* const* dsts, float* dst, int64_t n,
                              int64_t total) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t b = i / n, k = i % n;
  if (srcs)
    dst[i] = srcs[b][k];
  else
    dsts[b][k] = src[i];
}

}  // namespace

void gather_blocks(const float* const* srcs, int64_t B, int64_t n, float* dst) {
  if (!B || !n) return;
  blocks_kernel<<<blocks_for(B * n, kThreads), kThreads, 0, device::stream()>>>(srcs, nullptr, nullptr, dst, n, B * n);
  K3_CUDA_LAUNCHED();
}

void scatter_blocks(const float* src, int64_t B, int64_t n, float* const* dsts) {
  if (!B || !n) return;
  blocks_kernel<<<blocks_for(B * n, kThreads), kThreads, 0, device::stream()>>>(nullptr, src, dsts, nullptr, n, B * n);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
