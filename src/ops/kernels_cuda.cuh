// Helpers shared by the stateless ops' CUDA kernels (ops/*_cuda.cu): the launch shapes, the
// alignment tests of the four-at-a-time paths, and the kernel that writes rows while summing their
// columns (a bias gradient in the same pass). Internal to the kernel files.
#pragma once

#include <algorithm>
#include <cstdint>

#include "core/cuda_util.cuh"
#include "ops/ops_cuda.h"

namespace k3::cuda {
namespace {

using device::block_sum;
using device::blocks_for;
using device::from_f32;
using device::load4;
using device::pack_bf16x4;
using device::store4;
using device::to_f32;

constexpr int kThreads = 256;

__device__ __forceinline__ float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }
// Threads for a block that walks rows of w values.
int threads_for(int64_t w) { return w >= 256 ? 256 : w > 64 ? 128 : 64; }

// Row-wise kernels on [M, N] arrays: blockIdx.x over column blocks, rows strided by gridDim.y (at
// most 65,535), so no thread divides a flat index by N (64-bit division per element cost the GPT-2
// step's bias adds and q/k/v splits several times their memory time).
// Each thread walks about four rows (its loads unrolled: four in flight rather than one).
dim3 row_grid(int64_t M, int64_t N) {
  return dim3(device::blocks_for(N, kThreads), unsigned(std::min<int64_t>((M + 3) / 4, 65535)));
}
// Whether p is n-byte aligned (n a power of two); four values stored as st take row4_bytes(st).
bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; }
uintptr_t row4_bytes(Storage st) { return st == Storage::BF16 ? 8 : 16; }
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
// The grid of the column-sum kernels: col_blocks × slices of `rows` rows, about 1,024 blocks in
// all, each slice at least 64 rows.
dim3 column_sum_grid(int64_t M, int64_t col_blocks, int64_t& rows) {
  const int64_t slices = std::max<int64_t>(1, std::min((1024 + col_blocks - 1) / col_blocks, (M + 63) / 64));
  rows = (M + slices - 1) / slices;
  return dim3(unsigned(col_blocks), unsigned((M + rows - 1) / rows));
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

}  // namespace
}  // namespace k3::cuda
