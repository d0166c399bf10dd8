// Attention Residuals: the depth-mixing operator of block AttnRes (spec §10.3, "The mixing
// operator"), forward and backward side by side.
//
//   o = Σ_j softmax_j(s_j) · v_j,   s_j = Σ_d w[d]·query[d]·v_j[d] / sqrt(mean(v_j²) + eps)
//
// per token, over J sources v_j (the completed blocks and the running partial sum). Keys are the
// RMS-normalised sources, values the raw sources; no temperature. Statistics in double.
#pragma once

#include <cstdint>
#include <vector>

namespace k3 {

struct AttnResShape {
  int64_t rows = 0;  // tokens (B·T)
  int64_t D = 0;     // model width
};

// sources: J pointers to [rows, D]; query, rmsw: [D] (the *_res_proj and *_res_norm weights);
// o: [rows, D].
void attnres_forward(const std::vector<const float*>& sources, const float* query, const float* rmsw, float eps,
                     float* o, AttnResShape s);

// Accumulates (+=) into dsources[j] [rows, D], dquery [D] and drmsw [D]; any may be null.
void attnres_backward(const std::vector<const float*>& sources, const float* query, const float* rmsw, float eps,
                      const float* d_o, const std::vector<float*>& dsources, float* dquery, float* drmsw,
                      AttnResShape s);

}  // namespace k3
