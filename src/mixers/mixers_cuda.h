// The mixers' memories on the GPU: device forms of the KV cache, the MLA latent cache and the
// recurrent state with its conv tails (same MemoryKinds, so contexts, prefix snapshots and the
// memory report treat them alike), and the cached forward paths that continue them. A mixer whose
// weights are on the device (models' move_to) makes these in new_memory and takes these paths
// when given memories. Inference only; fp32. Built with K3_CUDA only.
#pragma once

#include <memory>
#include <vector>

#include "core/tensor.h"
#include "mixers/linear/delta_core.h"
#include "mixers/memory.h"

namespace k3 {

namespace cuda {
// Kernels (mixers_cuda.cu), device pointers. y[T, C] = the causal depthwise convolution of x
// continuing `tail` [W−1, C]; then tail ← the last W−1 rows of [tail ; x].
void conv_with_tail(const float* x, const float* w, const float* tail, int64_t T, int64_t C, int64_t W, float* y);
void conv_tail_update(const float* x, int64_t T, int64_t C, int64_t W, float* tail);
// Absorbed MLA attention: for token t (position p0 + t) and head h, softmax over latent rows
// s ≤ p0 + t of scale·(qt[t, h] · lat[s]) (rows of width W), then ob[t, h] = Σ p_s lat[s, :R].
void latent_attention(const float* qt, const float* lat, float* ob, int64_t T, int64_t H, int64_t W, int64_t R,
                      int64_t p0, float scale);
}  // namespace cuda

namespace gpu {

// Preallocated for max_tokens (no growth on the device); bytes() is what is allocated.
std::unique_ptr<Memory> kv_cache(int64_t heads, int64_t head_dim, int64_t max_tokens);
std::unique_ptr<Memory> latent_cache(int64_t width, int64_t max_tokens);
std::unique_ptr<Memory> recurrent_state(int64_t HV, int64_t K, int64_t V, std::vector<int64_t> conv_channels,
                                        int64_t conv_size);
bool is_device_memory(const Memory* m);

// Softmax attention of B sequences of T new tokens continuing their KV caches: qkv [B*T, 3·H·hd]
// (q | k | v) on the device; returns [B*T, H·hd].
Tensor cached_attention(const Tensor& qkv, int64_t B, int64_t T, int64_t H, int64_t hd, float scale,
                        Memory* const* memories);

// Absorbed MLA (spec §6) continuing latent caches: q [B*T, H·(nope+rope)] (rope applied), the new
// latent rows [B*T, R + rope] (normalised c, rotated k_rope), kv_b weight [H·(nope+v), R] on the
// device; returns [B*T, H·v].
struct LatentShape {
  int64_t B, T, H, nope, rope, v, R;
  float scale;
};
Tensor latent_attention(const Tensor& q, const Tensor& rows, const Tensor& kv_b, const LatentShape& s,
                        Memory* const* memories);

// The delta layer's conv stream `stream` continuing each sequence's tail: x [B*T, C], w [C, W].
Tensor conv_with_tails(const Tensor& x, const Tensor& w, int64_t B, int64_t T, int64_t W, size_t stream,
                       Memory* const* memories);
// The delta rule continuing each sequence's state (and counting the tokens into its length).
struct DeltaBatch {
  int64_t B, T, H, HV, K, V;
};
Tensor delta_with_states(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& g,
                         const linear::DeltaOptions& opts, const DeltaBatch& s, Memory* const* memories);

}  // namespace gpu
}  // namespace k3
