// Absorbed MLA attention (spec §6) continuing each sequence's latent cache, on the device where
// the caches live: the new latent rows are appended, then for token t of sequence b and head h,
// softmax over the cache's rows s ≤ p0_b + t of scale·(q̃_h · lat_s) with q̃_h = [W_UK[h]ᵀ q_nope_h ;
// q_rope_h], and o_h = W_UV[h] Σ_s p_s c_s. Inference only: no graph through the caches.
#pragma once

#include "core/tensor.h"
#include "mixers/memory.h"

namespace k3 {

struct LatentShape {
  int64_t B, T, H, nope, rope, v, R;
  float scale;
};

// q [B·T, H·(nope+rope)] (rope applied), the new latent rows [B·T, R + rope] (normalised c, rotated
// k_rope), kv_b weight [H·(nope+v), R]; memories: B LatentCaches. Returns [B·T, H·v]. Every cache
// takes its rows, or (a shape refused, a cache full) none does.
Tensor attend_latents(const Tensor& q, const Tensor& rows, const Tensor& kv_b, const LatentShape& s,
                      Memory* const* memories);

}  // namespace k3
