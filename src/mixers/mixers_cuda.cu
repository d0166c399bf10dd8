// Kernels of the mixers' device memories (mixers_cuda.h): the short convolution continuing a conv
// tail, the tail update, and attention of absorbed MLA queries over a latent cache.
#include <cmath>

#include "core/cuda_util.cuh"
#include "mixers/mixers_cuda.h"

namespace k3::cuda {
namespace {

using device::blocks_for;
using device::warp_sum;

constexpr int kThreads = 256;
constexpr int kMaxConv = 16;

// y[t, c] = Σ_i w[c, i] · [tail ; x][t + i, c] (tail holds the W − 1 rows before x).
__global__ void conv_tail_kernel(const float* x, const float* w, const float* tail, int64_t T, int64_t C, int64_t W,
                                 float* y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= T * C) return;
  const int64_t c = i % C, t = i / C, P = W - 1;
  float acc = 0.0f;
  for (int64_t k = 0; k < W; ++k) {
    const int64_t s = t - P + k;
    acc += w[c * W + k] * (s >= 0 ? x[s * C + c] : tail[(P + s) * C + c]);
  }
  y[i] = acc;
}

// tail ← the last W − 1 rows of [tail ; x], one thread per channel.
__global__ void tail_update_kernel(const float* x, int64_t T, int64_t C, int64_t W, float* tail) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t P = W - 1;
  float rows[kMaxConv];
  for (int64_t r = 0; r < P; ++r) {
    const int64_t s = T - P + r;  // row of [tail ; x] counted from x's start
    rows[r] = s >= 0 ? x[s * C + c] : tail[(P + s) * C + c];
  }
  for (int64_t r = 0; r < P; ++r) tail[r * C + c] = rows[r];
}

// One block of 4 warps per (token, head): each warp walks every 4th latent row with its own
// online softmax, lanes holding R/32 accumulator columns; the warps merge at the end.
constexpr int kLatentWarps = 4;
constexpr int kMaxRank = 512;
__global__ void latent_attention_kernel(const float* qt, const float* lat, float* ob, int64_t H, int64_t W, int64_t R,
                                        int64_t p0, float scale) {
  const int64_t t = blockIdx.x / H, h = blockIdx.x % H;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* q = qt + (t * H + h) * W;
  const int64_t n = p0 + t + 1;  // rows this token sees
  constexpr int kPer = kMaxRank / 32;
  float acc[kPer];
  for (int j = 0; j < kPer; ++j) acc[j] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int64_t s = warp; s < n; s += kLatentWarps) {
    const float* row = lat + s * W;
    float d = 0.0f;
    for (int64_t j = lane; j < W; j += 32) d += q[j] * row[j];
    d = warp_sum(d) * scale;
    const float m2 = fmaxf(m, d);
    const float corr = expf(m - m2), p = expf(d - m2);
    l = l * corr + p;
    for (int j = 0; j < kPer; ++j) {
      const int64_t r = lane + 32 * j;
      if (r < R) acc[j] = acc[j] * corr + p * row[r];
    }
    m = m2;
  }
  __shared__ float sm[kLatentWarps], sl[kLatentWarps];
  __shared__ float sacc[kLatentWarps][kMaxRank];
  if (lane == 0) {
    sm[warp] = m;
    sl[warp] = l;
  }
  for (int j = 0; j < kPer; ++j) {
    const int64_t r = lane + 32 * j;
    if (r < R) sacc[warp][r] = acc[j];
  }
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < kLatentWarps; ++w) M = fmaxf(M, sm[w]);
  float L = 0.0f;
  for (int w = 0; w < kLatentWarps; ++w) L += sm[w] == -INFINITY ? 0.0f : sl[w] * expf(sm[w] - M);
  for (int64_t r = threadIdx.x; r < R; r += blockDim.x) {
    float o = 0.0f;
    for (int w = 0; w < kLatentWarps; ++w)
      if (sm[w] != -INFINITY) o += sacc[w][r] * expf(sm[w] - M);
    ob[(t * H + h) * R + r] = o / L;
  }
}

}  // namespace

void conv_with_tail(const float* x, const float* w, const float* tail, int64_t T, int64_t C, int64_t W, float* y) {
  if (!T || !C) return;
  conv_tail_kernel<<<blocks_for(T * C, kThreads), kThreads, 0, device::stream()>>>(x, w, tail, T, C, W, y);
  K3_CUDA_LAUNCHED();
}

void conv_tail_update(const float* x, int64_t T, int64_t C, int64_t W, float* tail) {
  if (!T || !C || W <= 1) return;
  if (W - 1 > kMaxConv) throw error("short_conv", "conv size ", W, " exceeds the CUDA kernel's ", kMaxConv + 1);
  tail_update_kernel<<<blocks_for(C, kThreads), kThreads, 0, device::stream()>>>(x, T, C, W, tail);
  K3_CUDA_LAUNCHED();
}

void latent_attention(const float* qt, const float* lat, float* ob, int64_t T, int64_t H, int64_t W, int64_t R,
                      int64_t p0, float scale) {
  if (R > kMaxRank) throw error("mla", "kv_lora_rank ", R, " exceeds the CUDA decode kernel's ", kMaxRank);
  if (!T || !H) return;
  latent_attention_kernel<<<unsigned(T * H), 32 * kLatentWarps, 0, device::stream()>>>(qt, lat, ob, H, W, R, p0, scale);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
