// The short convolution on the device (mixers_cuda.h, cuda::convs_with_tails): up to three
// streams' causal depthwise convolutions continuing each sequence's conv tail, and the tails'
// update, in one launch for a decode step or two for longer continuations.
#include <algorithm>
#include <cmath>

#include "core/cuda_util.cuh"
#include "mixers/mixers_cuda.h"

namespace k3::cuda {
namespace {

using namespace device;

constexpr int kThreads = 256;
constexpr int kMaxConv = 16;

// The short convolutions of up to kMaxStreams streams in one launch (T ≤ 16), a thread per
// (sequence, stream, channel) walking the sequence's T tokens: y[b, t, c] = Σ_i w[c, i] · [tail ; x_b][t + i,
// c] (the tail holds the W − 1 rows before x_b), optionally y ← y·σ(y); then the tail ← the last
// W − 1 rows of [tail ; x_b]. The thread reads its tail column before it rewrites it, so nothing
// waits on another thread.
__global__ void convs_kernel(ConvStreams st, float* const* tails, int64_t B, int64_t T, int64_t W, bool silu) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = st.start[st.count];
  if (i >= B * total) return;
  const int64_t b = i / total, r = i % total;
  int s = 0;
  while (r >= st.start[s + 1]) ++s;
  const int64_t C = st.start[s + 1] - st.start[s], c = r - st.start[s], P = W - 1;
  const float* x = st.x[s] + b * T * C + c;
  const float* w = st.w[s] + c * W;
  float* y = st.y[s] + b * T * C + c;
  float* tail = P > 0 ? tails[b * st.count + s] + c : nullptr;
  float win[kMaxConv + 1];  // the W rows ending at token t
  for (int64_t k = 0; k < P; ++k) win[k] = tail[k * C];
  for (int64_t t = 0; t < T; ++t) {
    win[P] = x[t * C];
    float acc = 0.0f;
    for (int64_t k = 0; k < W; ++k) acc += w[k] * win[k];
    y[t * C] = silu ? acc / (1.0f + __expf(-acc)) : acc;
    for (int64_t k = 0; k < P; ++k) win[k] = win[k + 1];
  }
  for (int64_t k = 0; k < P; ++k) tail[k * C] = win[k];
}

// Longer continuations (prefill through the memories): a thread per output (b, t, channel), then
// the tails in a second launch, once every output has read them.
__device__ __forceinline__ int stream_of(const ConvStreams& st, int64_t r) {
  int s = 0;
  while (r >= st.start[s + 1]) ++s;
  return s;
}
__global__ void convs_rows_kernel(ConvStreams st, const float* const* tails, int64_t B, int64_t T, int64_t W,
                                  bool silu) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = st.start[st.count];
  if (i >= B * T * total) return;
  const int64_t r = i % total, bt = i / total, b = bt / T, t = bt % T;
  const int s = stream_of(st, r);
  const int64_t C = st.start[s + 1] - st.start[s], c = r - st.start[s], P = W - 1;
  const float* x = st.x[s] + b * T * C + c;
  const float* tail = P > 0 ? tails[b * st.count + s] + c : nullptr;
  float acc = 0.0f;
  for (int64_t k = 0; k < W; ++k) {
    const int64_t u = t - P + k;  // token of [tail ; x_b] row t + k, counted from x_b's start
    acc += st.w[s][c * W + k] * (u >= 0 ? x[u * C] : tail[(P + u) * C]);
  }
  st.y[s][(b * T + t) * C + c] = silu ? acc / (1.0f + __expf(-acc)) : acc;
}
__global__ void convs_tails_kernel(ConvStreams st, float* const* tails, int64_t B, int64_t T, int64_t W) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = st.start[st.count];
  if (i >= B * total) return;
  const int64_t b = i / total, r = i % total;
  const int s = stream_of(st, r);
  const int64_t C = st.start[s + 1] - st.start[s], c = r - st.start[s], P = W - 1;
  const float* x = st.x[s] + b * T * C + c;
  float* tail = tails[b * st.count + s] + c;
  float rows[kMaxConv];
  for (int64_t k = 0; k < P; ++k) {
    const int64_t u = T - P + k;
    rows[k] = u >= 0 ? x[u * C] : tail[(P + u) * C];
  }
  for (int64_t k = 0; k < P; ++k) tail[k * C] = rows[k];
}

}  // namespace

void convs_with_tails(const ConvStreams& streams, float* const* tails, int64_t B, int64_t T, int64_t W, bool silu) {
  if (streams.count < 1 || streams.count > kMaxStreams)
    throw error("short_conv", "one launch convolves 1 to ", kMaxStreams, " streams, got ", streams.count);
  if (W < 1 || W - 1 > kMaxConv) throw error("short_conv", "conv size ", W, " outside the CUDA kernel's 1 to ", kMaxConv + 1);
  const int64_t n = B * streams.start[streams.count];
  if (!n || !T) return;
  if (T <= 16) {  // the decode: one thread walks a channel's few tokens and rewrites its tail
    convs_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(streams, tails, B, T, W, silu);
    K3_CUDA_LAUNCHED();
    return;
  }
  convs_rows_kernel<<<blocks_for(n * T, kThreads), kThreads, 0, device::stream()>>>(streams, tails, B, T, W, silu);
  K3_CUDA_LAUNCHED();
  if (W <= 1) return;
  convs_tails_kernel<<<blocks_for(n, kThreads), kThreads, 0, device::stream()>>>(streams, tails, B, T, W);
  K3_CUDA_LAUNCHED();
}

}  // namespace k3::cuda
