// Kernels of the mixers' device memories (mixers_cuda.h): the short convolution continuing a conv
// tail, the tail update, and attention of absorbed MLA queries over a latent cache.
#include <algorithm>
#include <cmath>

#include "core/cuda_util.cuh"
#include "mixers/mixers_cuda.h"

namespace k3::cuda {
namespace {

using device::blocks_for;
using device::warp_sum;

constexpr int kThreads = 256;
constexpr int kMaxConv = 16;

// y[b, t, c] = Σ_i w[c, i] · [tail_b ; x_b][t + i, c] (tail_b holds the W − 1 rows before x_b).
__global__ void conv_tail_kernel(const float* x, const float* w, const float* const* tails, int64_t T, int64_t C,
                                 int64_t W, int64_t n, float* y) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t c = i % C, bt = i / C, b = bt / T, t = bt % T, P = W - 1;
  const float* tail = tails[b];
  float acc = 0.0f;
  for (int64_t k = 0; k < W; ++k) {
    const int64_t s = t - P + k;
    acc += w[c * W + k] * (s >= 0 ? x[(bt - t + s) * C + c] : tail[(P + s) * C + c]);
  }
  y[i] = acc;
}

// tail_b ← the last W − 1 rows of [tail_b ; x_b], one thread per (sequence, channel).
__global__ void tail_update_kernel(const float* x, float* const* tails, int64_t T, int64_t C, int64_t W, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t c = i % C, b = i / C, P = W - 1;
  float* tail = tails[b];
  const float* xb = x + b * T * C;
  float rows[kMaxConv];
  for (int64_t r = 0; r < P; ++r) {
    const int64_t s = T - P + r;  // row of [tail ; x] counted from x's start
    rows[r] = s >= 0 ? xb[s * C + c] : tail[(P + s) * C + c];
  }
  for (int64_t r = 0; r < P; ++r) tail[r * C + c] = rows[r];
}

// Absorbed MLA attention over B sequences' latent caches, split over the rows (flash-decoding).
// Block (b·T + t, split) walks its chunk of the rows token t of sequence b sees, 32 rows at a
// time staged in shared memory (padded rows: no bank conflicts); one warp per head, lane s
// scoring row s, so each row costs one dot product and the softmax bookkeeping is per 32 rows.
// Lanes own R/32 accumulator columns. Partial (m, l, acc) per split go to scratch;
// latent_combine_kernel merges them.
constexpr int kMaxRank = 512;
constexpr int kHeadsPerBlock = 16;  // head groups beyond that go to blockIdx.z
constexpr int kRows = 32;
template <int kPer>  // accumulator columns per lane: R ≤ 32·kPer
__global__ void __launch_bounds__(32 * kHeadsPerBlock) latent_split_kernel(const float* qt, const float* const* lats, const int64_t* p0s, int64_t T,
                                    int64_t H, int W, int64_t R, float scale, int64_t chunk, int splits,
                                    float* part_ml, float* part_acc) {
  extern __shared__ float smem[];  // tile [kRows, W + 1], then this group's q [G, W]
  float* tile = smem;
  float* qs = smem + kRows * (W + 1);
  const int64_t bt = blockIdx.x, b = bt / T, t = bt % T, split = blockIdx.y;
  const int64_t h0 = int64_t(blockIdx.z) * kHeadsPerBlock, G = min(int64_t(kHeadsPerBlock), H - h0);
  const int lane = threadIdx.x & 31, hw = threadIdx.x >> 5;
  const int64_t h = h0 + hw;
  const float* lat = lats[b];
  const int64_t n = p0s[b] + t + 1, s0 = split * chunk, s1 = min(n, s0 + chunk);
  for (int64_t i = threadIdx.x; i < G * W; i += blockDim.x) qs[i] = qt[(bt * H + h0) * W + i] * scale;
  float acc[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) acc[j] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const float* q = qs + hw * W;
  for (int64_t base = s0; base < s1; base += kRows) {
    const int64_t rows = min(int64_t(kRows), s1 - base);
    __syncthreads();
    const float* src = lat + base * W;
    for (int i = threadIdx.x; i < int(rows) * W; i += blockDim.x) tile[(i / W) * (W + 1) + i % W] = src[i];
    __syncthreads();
    if (hw >= G) continue;  // a warp past the last group's heads only helps load (warp-uniform)
    float d = -INFINITY;
    if (lane < rows) {
      const float* row = tile + lane * (W + 1);
      d = 0.0f;
      for (int64_t j = 0; j < W; ++j) d += q[j] * row[j];
    }
    const float m2 = fmaxf(m, device::warp_max(d));
    const float p = lane < rows ? expf(d - m2) : 0.0f, corr = expf(m - m2);
    l = l * corr + warp_sum(p);
#pragma unroll
    for (int j = 0; j < kPer; ++j) acc[j] *= corr;
    for (int r = 0; r < int(rows); ++r) {
      const float pr = __shfl_sync(0xffffffffu, p, r);
      const float* row = tile + r * (W + 1);
#pragma unroll
      for (int j = 0; j < kPer; ++j)
        if (lane + 32 * j < R) acc[j] += pr * row[lane + 32 * j];
    }
    m = m2;
  }
  if (hw >= G) return;
  const int64_t slot = (bt * splits + split) * H + h;
  if (lane == 0) {
    part_ml[2 * slot] = m;
    part_ml[2 * slot + 1] = l;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t c = lane + 32 * j;
    if (c < R) part_acc[slot * R + c] = acc[j];
  }
}

// One block per (row bt, head h): ob = Σ_split e^(m_i − M) acc_i / Σ_split e^(m_i − M) l_i.
__global__ void latent_combine_kernel(const float* part_ml, const float* part_acc, int64_t H, int64_t R, int splits,
                                      float* ob) {
  const int64_t bt = blockIdx.x / H, h = blockIdx.x % H;
  auto at = [&](int i) { return (bt * splits + i) * H + h; };
  float M = -INFINITY;
  for (int i = 0; i < splits; ++i) M = fmaxf(M, part_ml[2 * at(i)]);
  float L = 0.0f;
  for (int i = 0; i < splits; ++i) {
    const float mi = part_ml[2 * at(i)];
    if (mi != -INFINITY) L += part_ml[2 * at(i) + 1] * expf(mi - M);
  }
  for (int64_t c = threadIdx.x; c < R; c += blockDim.x) {
    float o = 0.0f;
    for (int i = 0; i < splits; ++i) {
      const float mi = part_ml[2 * at(i)];
      if (mi != -INFINITY) o += part_acc[at(i) * R + c] * expf(mi - M);
    }
    ob[(bt * H + h) * R + c] = o / L;
  }
}

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

void conv_with_tails(const float* x, const float* w, float* const* tails, int64_t B, int64_t T, int64_t C, int64_t W,
                     float* y) {
  if (!B || !T || !C) return;
  if (W - 1 > kMaxConv) throw error("short_conv", "conv size ", W, " exceeds the CUDA kernel's ", kMaxConv + 1);
  const int64_t n = B * T * C, m = B * C;
  conv_tail_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(x, w, tails, T, C, W, n, y);
  K3_CUDA_LAUNCHED();
  if (W <= 1) return;
  tail_update_kernel<<<blocks_for(m, kThreads), kThreads, 0, device::stream()>>>(x, tails, T, C, W, m);
  K3_CUDA_LAUNCHED();
}

void latent_attention(const float* qt, const float* const* lats, const int64_t* p0s, int64_t longest, float* ob,
                      int64_t B, int64_t T, int64_t H, int64_t W, int64_t R, float scale) {
  if (R > kMaxRank) throw error("mla", "kv_lora_rank ", R, " exceeds the CUDA decode kernel's ", kMaxRank);
  if (!B || !T || !H) return;
  // About 4 blocks per SM over all (sequence, token) rows, chunks of at least 128 latent rows.
  const int64_t rows = B * T;
  int splits = int(std::max<int64_t>(1, std::min<int64_t>((528 + rows - 1) / rows, (longest + 127) / 128)));
  const int64_t chunk = (longest + splits - 1) / splits;
  splits = int((longest + chunk - 1) / chunk);
  device::Buffer ml(size_t(rows * splits * H * 2) * 4), acc(size_t(rows * splits * H * R) * 4);
  const int64_t G = std::min<int64_t>(H, kHeadsPerBlock), groups = (H + kHeadsPerBlock - 1) / kHeadsPerBlock;
  const size_t smem = size_t(kRows * (W + 1) + G * W) * 4;
  constexpr size_t kMaxSmem = 200 * 1024;  // opted into below (Hopper allows 227 KiB per block)
  if (smem > kMaxSmem) throw error("mla", "latent width ", W, " with ", H, " heads exceeds the kernel's shared memory");
  static const bool opted = [] {
    for (auto* f : {latent_split_kernel<1>, latent_split_kernel<2>, latent_split_kernel<4>, latent_split_kernel<8>,
                    latent_split_kernel<16>})
      K3_CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kMaxSmem)));
    return true;
  }();
  (void)opted;
  const int per = int((R + 31) / 32);
  auto* kernel = per <= 1 ? latent_split_kernel<1> : per <= 2 ? latent_split_kernel<2> : per <= 4 ? latent_split_kernel<4>
               : per <= 8 ? latent_split_kernel<8> : latent_split_kernel<16>;
  kernel<<<dim3(unsigned(rows), unsigned(splits), unsigned(groups)), unsigned(32 * G), smem, device::stream()>>>(
      qt, lats, p0s, T, H, int(W), R, scale, chunk, splits, ml.as<float>(), acc.as<float>());
  K3_CUDA_LAUNCHED();
  latent_combine_kernel<<<unsigned(rows * H), 128, 0, device::stream()>>>(ml.as<float>(), acc.as<float>(), H, R,
                                                                          splits, ob);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
