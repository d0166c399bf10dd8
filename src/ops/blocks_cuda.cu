// Column-block copies on CUDA (ops/blocks.h): slices, concatenations and head layouts, and the
// adds of their backward.
#include <algorithm>
#include <cmath>

#include "ops/kernels_cuda.cuh"

namespace k3::cuda {
namespace {

// One block row per (m, h) pair; threads over the w columns.
__global__ void copy_blocks_kernel(const float* src, int64_t s_row, int64_t s_head, float* dst, int64_t d_row,
                                   int64_t d_head, int64_t H, int64_t w) {
  const int64_t mh = blockIdx.x, m = mh / H, h = mh % H;
  const float* s = src + m * s_row + h * s_head;
  float* d = dst + m * d_row + h * d_head;
  for (int64_t j = threadIdx.x; j < w; j += blockDim.x) d[j] = s[j];
}

__global__ void add_blocks_kernel(const float* src, int64_t s_row, int64_t s_head, float* dst, int64_t d_row,
                                  int64_t d_head, int64_t H, int64_t w) {
  const int64_t mh = blockIdx.x, m = mh / H, h = mh % H;
  const float* s = src + m * s_row + h * s_head;
  float* d = dst + m * d_row + h * d_head;
  for (int64_t j = threadIdx.x; j < w; j += blockDim.x) d[j] += s[j];
}

}  // namespace

void copy_blocks(const float* src, int64_t s_row, int64_t s_head, float* dst, int64_t d_row, int64_t d_head, int64_t M,
                 int64_t H, int64_t w) {
  if (!M || !H || !w) return;
  copy_blocks_kernel<<<unsigned(M * H), threads_for(w), 0, device::stream()>>>(src, s_row, s_head, dst, d_row, d_head,
                                                                                H, w);
  K3_CUDA_LAUNCHED();
}

void add_blocks(const float* src, int64_t s_row, int64_t s_head, float* dst, int64_t d_row, int64_t d_head, int64_t M,
                int64_t H, int64_t w) {
  if (!M || !H || !w) return;
  add_blocks_kernel<<<unsigned(M * H), threads_for(w), 0, device::stream()>>>(src, s_row, s_head, dst, d_row, d_head,
                                                                               H, w);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
