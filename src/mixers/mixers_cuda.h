// The mixers' cached forward paths on the GPU: softmax attention, absorbed MLA, the short
// convolutions and the delta rule continuing each sequence's memory (KVCache, LatentCache,
// RecurrentState made on CUDA by a mixer whose weights are on the device). Inference only; fp32
// (latent caches fp32 or bf16). Built with K3_CUDA only.
#pragma once

#include <memory>
#include <vector>

#include "core/device.h"
#include "core/tensor.h"
#include "mixers/linear/delta_core.h"
#include "mixers/linear/delta_cuda.h"
#include "mixers/linear/delta_states.h"
#include "mixers/memory.h"
#include "mixers/mla/latent_attention.h"

namespace k3 {

namespace cuda {
// Kernels (conv/short_conv_cuda.cu, mla/mla_decode_cuda.cu, memory_blocks_cuda.cu), device pointers. For each of `count` streams s (channels start[s] to
// start[s + 1]): y_s [B·T, C_s] = the causal depthwise convolution (w_s [C_s, W]) of B sequences
// x_s,b [T, C_s], each continuing its tail (tails: B·count device pointers, tails[b·count + s] to
// [W − 1, C_s]; unused when W = 1), then y ← y·σ(y) when `silu`; every tail ← the last W − 1 rows
// of [tail ; x_s,b]. One launch for all streams.
constexpr int kMaxStreams = 3;
struct ConvStreams {
  const float* x[kMaxStreams] = {};
  const float* w[kMaxStreams] = {};
  float* y[kMaxStreams] = {};
  int64_t start[kMaxStreams + 1] = {};
  int count = 0;
};
void convs_with_tails(const ConvStreams& streams, float* const* tails, int64_t B, int64_t T, int64_t W, bool silu);
// Absorbed MLA attention over B sequences of T new tokens: for token t of sequence b (position
// p0s[b] + t) and head h, softmax over latent rows s ≤ p0s[b] + t of scale·(qt[b, t, h] ·
// lats[b][s]) (rows of width W), then ob[b, t, h] = Σ p_s lats[b][s, :R]. lats and p0s are device
// arrays of B entries; the rows are fp32 or bf16 (`storage`); longest = max p0s + T.
void latent_attention(const float* qt, const void* const* lats, device::Storage storage, const int64_t* p0s,
                      int64_t longest, float* ob, int64_t B, int64_t T, int64_t H, int64_t W, int64_t R, float scale);
// Which kernel takes bf16 latents of DeepSeek/K3's 512 + 64 shape: the warpgroup-MMA one (Auto,
// the default, and Warpgroup: faster at every batch measured) or the mma.sync one (MmaSync), for
// benchmarks, profiles and tests. Process-wide; other shapes are unaffected.
enum class LatentKernel { Auto, Warpgroup, MmaSync };
void set_latent_kernel(LatentKernel k);
// B sequences' T new rows each into their caches, one launch: row t of sequence b (src row b·T +
// t, leading dimension ld, width w) goes to row at[b] + t of dsts[b] ([rows, w], fp32 or bf16 as
// `storage`, bf16 rounded to nearest even). dsts and at are device arrays of B entries.
void append_rows(const float* src, int64_t ld, int64_t B, int64_t T, int64_t w, void* const* dsts, const int64_t* at,
                 device::Storage storage);
// B blocks of n floats between separate allocations (device pointer arrays) and one
// contiguous [B, n] array.
void gather_blocks(const float* const* srcs, int64_t B, int64_t n, float* dst);
void scatter_blocks(const float* src, int64_t B, int64_t n, float* const* dsts);
}  // namespace cuda

namespace gpu {

// Softmax attention of B sequences of T new tokens continuing their KV caches of Hkv heads: qkv
// [B*T, (H + 2·Hkv)·hd] (q | k | v) on the device; returns [B*T, H·hd] (mixers/attention/kv_cache.h).
Tensor cached_attention(const Tensor& qkv, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t hd, float scale,
                        Memory* const* memories);

// Absorbed MLA (spec §6) continuing latent caches: q [B*T, H·(nope+rope)] (rope applied), the new
// latent rows [B*T, R + rope] (normalised c, rotated k_rope), kv_b weight [H·(nope+v), R] on the
// device; returns [B*T, H·v].
Tensor latent_attention(const Tensor& q, const Tensor& rows, const Tensor& kv_b, const LatentShape& s,
                        Memory* const* memories);

// The forms on CUDA of the delta layer's ops (mixers/linear/delta_states.h).
std::vector<Tensor> convs_with_tails(const std::vector<Tensor>& xs, const std::vector<Tensor>& ws, int64_t B, int64_t T,
                                     int64_t W, bool silu, Memory* const* memories);
Tensor delta_with_states(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& g,
                         const linear::DeltaOptions& opts, const linear::DeltaBatch& s, Memory* const* memories,
                         const linear::DecodeActivations* act = nullptr);

}  // namespace gpu
}  // namespace k3
