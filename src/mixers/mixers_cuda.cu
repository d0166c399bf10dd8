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
using namespace device;

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

// Absorbed MLA attention over B sequences' latent caches, split over the rows (flash-decoding),
// on the tensor cores. Block (b·T + t, split, head group) walks its chunk of the rows token t of
// sequence b sees, RT rows at a time, cp.async-staged in a two-stage ring (the next tile lands
// while this one is used). The heads of a group (≤ 16) are the products' M rows, so every latent
// row is read from memory once per group, not once per head:
//   scores [16, RT] = q [16, W] · tileᵀ: the 8 warps split W (k-steps w, w + 8, …; q's fragments
//     stay in registers for the whole chunk), their partial sums meet in shared memory;
//   softmax bookkeeping: 16 threads per head, RT / 16 scores each;
//   acc [16, R] += P · tile[:, :R]: the warps split R (n-tiles w, w + 8, …).
// Products are 3xTF32 (x = hi + lo, hi·hi + hi·lo + lo·hi): fp32 accuracy, which the decode's
// agreement with the full forward needs. Row strides ≡ 8 (mod 32) floats keep both products'
// fragment loads free of bank conflicts; columns past W and rows past the chunk are zeros.
// Partial (m, l, acc) per split go to scratch; latent_combine_kernel merges them.
constexpr int kMaxRank = 512;
constexpr int kHeadsPerBlock = 16;  // the products' M; more heads take more blocks
constexpr int kLatWarps = 8;
constexpr int kLatNt = kMaxRank / 8 / kLatWarps;  // value n-tiles per warp
constexpr int kMaxLatentWidth = 640;              // score k-steps per warp ≤ kMaxLatentWidth / 64
constexpr int kLatPad = 4;                        // P's row padding: RT + 4 ≡ 4 (mod 32)

struct LatentArgs {
  const float* qt;
  const float* const* lats;
  const int64_t* p0s;
  int64_t T, H, chunk;
  int W, R, stride, splits, groups;
  bool w4;  // W % 4 == 0: a 16-byte aligned cache is copied 16 bytes at a time
  float scale;
  float* part_ml;
  float* part_acc;
};

// Volatile, so that the splits of loop-invariant operands (q's fragments) are not hoisted out of
// the row loop: kept split they would take twice q's registers.
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  asm volatile("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(hi) : "f"(x));
  asm volatile("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(lo) : "f"(x - __uint_as_float(hi)));
}
// c += A·B in 3xTF32 from fp32 A fragments and the two fp32 B values.
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const float (&a)[4], float b0, float b1) {
  uint32_t ah[4], al[4], bh0, bl0, bh1, bl1;
#pragma unroll
  for (int i = 0; i < 4; ++i) split_tf32(a[i], ah[i], al[i]);
  split_tf32(b0, bh0, bl0);
  split_tf32(b1, bh1, bl1);
  mma_tf32(c, al, bh0, bh1);
  mma_tf32(c, ah, bl0, bl1);
  mma_tf32(c, ah, bh0, bh1);
}

template <int RT, int KQ>  // RT latent rows per tile; KQ score k-steps per warp (W ≤ 64·KQ)
__global__ void __launch_bounds__(kLatWarps * 32, 2) latent_tc_kernel(LatentArgs a) {
  extern __shared__ __align__(16) float smem[];
  const int W = a.W, R = a.R, stride = a.stride;
  float* tiles = smem;                                 // [2][RT][stride]
  float* red = tiles + 2 * RT * stride;                // [warp][16][RT]: partial scores
  float* P = red + kLatWarps * 16 * RT;                // [16][RT + kLatPad]
  float* corr = P + 16 * (RT + kLatPad);               // [16]: this tile's rescale per head
  const int64_t bt = blockIdx.x / (int64_t(a.splits) * a.groups);
  const int split = int(blockIdx.x / a.groups % a.splits), group = int(blockIdx.x % a.groups);
  const int64_t b = bt / a.T, t = bt % a.T, h0 = int64_t(group) * kHeadsPerBlock;
  const int G = int(min(int64_t(kHeadsPerBlock), a.H - h0));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const float* lat = a.lats[b];
  const bool vec = a.w4 && (reinterpret_cast<uintptr_t>(lat) & 15) == 0;
  const int64_t n = a.p0s[b] + t + 1, s0 = split * a.chunk, s1 = min(n, s0 + a.chunk);
  const int ntiles = s0 < s1 ? int((s1 - s0 + RT - 1) / RT) : 0;
  const int ksteps = (W + 7) / 8, Wp = ksteps * 8;

  // The columns W … Wp − 1 of both stages are zeros for the whole kernel (copies never reach them).
  for (int i = threadIdx.x; i < 2 * RT * (Wp - W); i += blockDim.x) {
    const int r = i / (Wp - W), c = W + i % (Wp - W);
    tiles[r * stride + c] = 0.0f;
  }
  // Rows of tile `it` into stage it & 1 (zeros past s1).
  auto load = [&](int it) {
    float* dst = tiles + (it & 1) * RT * stride;
    const int64_t base = s0 + int64_t(it) * RT;
    if (vec) {
      const int w4 = W / 4;
      for (int i = threadIdx.x; i < RT * w4; i += blockDim.x) {
        const int r = i / w4, c = 4 * (i % w4);
        const bool valid = base + r < s1;
        cp_async16_zfill(dst + r * stride + c, lat + (valid ? (base + r) * W + c : 0), valid);
      }
    } else {
      for (int i = threadIdx.x; i < RT * W; i += blockDim.x) {
        const int r = i / W, c = i % W;
        dst[r * stride + c] = base + r < s1 ? lat[(base + r) * W + c] : 0.0f;
      }
    }
    cp_async_commit();
  };
  if (ntiles > 0) load(0);

  // q's A fragments for this warp's k-steps (zeros past the group's heads and past W), scaled.
  float qa[KQ][4];
  {
    const float* q = a.qt + (bt * a.H + h0) * W;
#pragma unroll
    for (int i = 0; i < KQ; ++i) {
      const int k0 = (warp + kLatWarps * i) * 8;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = g + 8 * (e & 1), k = k0 + tq + 4 * (e >> 1);
        qa[i][e] = h < G && k < W ? q[int64_t(h) * W + k] * a.scale : 0.0f;
      }
    }
  }
  float acc[kLatNt][4];
#pragma unroll
  for (int i = 0; i < kLatNt; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  // Softmax state of head sh, kept alike by its 16 threads.
  const int sh = threadIdx.x >> 4, sc = threadIdx.x & 15;
  float m = -INFINITY, l = 0.0f;

  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait0();
    __syncthreads();  // tile it visible; every warp is past tile it − 1's products
    if (it + 1 < ntiles) load(it + 1);
    const float* tile = tiles + (it & 1) * RT * stride;
    {  // partial scores over this warp's k-steps
      float s[RT / 8][4];
#pragma unroll
      for (int j = 0; j < RT / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
      for (int i = 0; i < KQ; ++i) {
        const int k0 = (warp + kLatWarps * i) * 8;
        if (k0 >= Wp) break;
#pragma unroll
        for (int j = 0; j < RT / 8; ++j) {
          const float* row = tile + (j * 8 + g) * stride + k0 + tq;
          mma_3xtf32(s[j], qa[i], row[0], row[4]);
        }
      }
      float* rw = red + warp * 16 * RT;
#pragma unroll
      for (int j = 0; j < RT / 8; ++j) {
        *reinterpret_cast<float2*>(rw + g * RT + j * 8 + 2 * tq) = make_float2(s[j][0], s[j][1]);
        *reinterpret_cast<float2*>(rw + (g + 8) * RT + j * 8 + 2 * tq) = make_float2(s[j][2], s[j][3]);
      }
    }
    __syncthreads();
    {  // softmax bookkeeping: thread (sh, sc) takes rows sc, sc + 16, … of head sh
      const int64_t base = s0 + int64_t(it) * RT;
      float x[RT / 16], mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < RT / 16; ++j) {
        const int r = sc + 16 * j;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < kLatWarps; ++w) v += red[(w * 16 + sh) * RT + r];
        x[j] = base + r < s1 ? v : -INFINITY;
        mx = fmaxf(mx, x[j]);
      }
#pragma unroll
      for (int o = 1; o < 16; o *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m2 = fmaxf(m, mx), cf = expf(m - m2);  // a tile has a row below s1: m2 finite
      float ps = 0.0f;
#pragma unroll
      for (int j = 0; j < RT / 16; ++j) {
        const float p = expf(x[j] - m2);
        P[sh * (RT + kLatPad) + sc + 16 * j] = p;
        ps += p;
      }
#pragma unroll
      for (int o = 1; o < 16; o *= 2) ps += __shfl_xor_sync(0xffffffffu, ps, o);
      l = l * cf + ps;
      m = m2;
      if (sc == 0) corr[sh] = cf;
    }
    __syncthreads();
    {  // acc = corr · acc + P · tile[:, :R] over this warp's value n-tiles
      const float c0 = corr[g], c1 = corr[g + 8];
#pragma unroll
      for (int i = 0; i < kLatNt; ++i) acc[i][0] *= c0, acc[i][1] *= c0, acc[i][2] *= c1, acc[i][3] *= c1;
#pragma unroll
      for (int ks = 0; ks < RT / 8; ++ks) {
        const float* pr = P + g * (RT + kLatPad) + ks * 8 + tq;
        const float pa[4] = {pr[0], pr[8 * (RT + kLatPad)], pr[4], pr[8 * (RT + kLatPad) + 4]};
#pragma unroll
        for (int i = 0; i < kLatNt; ++i) {
          const int d0 = (warp + kLatWarps * i) * 8;
          if (d0 >= R) break;
          const float* col = tile + (ks * 8 + tq) * stride + d0 + g;
          mma_3xtf32(acc[i], pa, col[0], col[4 * stride]);
        }
      }
    }
  }
  const auto slot = [&](int h) { return (bt * a.splits + split) * a.H + h0 + h; };
  if (sc == 0 && sh < G) {
    a.part_ml[2 * slot(sh)] = m;
    a.part_ml[2 * slot(sh) + 1] = l;
  }
#pragma unroll
  for (int i = 0; i < kLatNt; ++i) {
    const int d = (warp + kLatWarps * i) * 8 + 2 * tq;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int h = g + 8 * (e >> 1), c = d + (e & 1);
      if (h < G && c < R) a.part_acc[slot(h) * R + c] = acc[i][e];
    }
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
  if (W > kMaxLatentWidth || W < R)
    throw error("mla", "latent width ", W, " (kv_lora_rank ", R, " + rope) must lie between the rank and the CUDA ",
                "decode kernel's ", kMaxLatentWidth);
  if (!B || !T || !H) return;
  // Narrow latents take 64 rows per tile (a tile's barriers amortised over more bytes), wide ones 16.
  const bool narrow = W <= 128;
  const int RT = narrow ? 64 : 16;
  // About 4 blocks per SM over all (sequence, token, head group) rows, chunks of at least 128
  // latent rows, whole tiles.
  const int64_t rows = B * T, groups = (H + kHeadsPerBlock - 1) / kHeadsPerBlock;
  int splits = int(std::max<int64_t>(1, std::min<int64_t>((528 + rows * groups - 1) / (rows * groups), (longest + 127) / 128)));
  int64_t chunk = (longest + splits - 1) / splits;
  chunk = (chunk + RT - 1) / RT * RT;
  splits = int((longest + chunk - 1) / chunk);
  device::Buffer ml(size_t(rows * splits * H * 2) * 4), acc(size_t(rows * splits * H * R) * 4);
  LatentArgs a{};
  a.qt = qt, a.lats = lats, a.p0s = p0s, a.T = T, a.H = H, a.chunk = chunk;
  a.W = int(W), a.R = int(R), a.splits = splits, a.groups = int(groups), a.scale = scale;
  const int Wp = int((W + 7) / 8 * 8);
  a.stride = Wp + ((8 - Wp) % 32 + 32) % 32;  // ≥ Wp, ≡ 8 (mod 32)
  a.w4 = W % 4 == 0;
  a.part_ml = ml.as<float>(), a.part_acc = acc.as<float>();
  const size_t smem = size_t(2 * RT * a.stride + kLatWarps * 16 * RT + 16 * (RT + kLatPad) + 16) * 4;
  static const bool opted = [] {
    for (auto* f : {latent_tc_kernel<64, 2>, latent_tc_kernel<16, kMaxLatentWidth / 64>})
      K3_CUDA_CHECK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    return true;
  }();
  (void)opted;
  const int64_t blocks = rows * splits * groups;
  if (blocks > INT32_MAX) throw error("mla", "latent attention over ", blocks, " blocks exceeds the grid");
  auto* kernel = narrow ? latent_tc_kernel<64, 2> : latent_tc_kernel<16, kMaxLatentWidth / 64>;
  kernel<<<unsigned(blocks), kLatWarps * 32, smem, device::stream()>>>(a);
  K3_CUDA_LAUNCHED();
  latent_combine_kernel<<<unsigned(rows * H), 128, 0, device::stream()>>>(ml.as<float>(), acc.as<float>(), H, R,
                                                                          splits, ob);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
