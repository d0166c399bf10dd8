// Attention Residuals' depth mixing (residual/attnres.h) on CUDA, device pointers, fp32.
// At most kMaxSources sources.
#pragma once

#include <vector>

#include "residual/attnres.h"

namespace k3::cuda {

constexpr int kAttnResMaxSources = 32;

void attnres_forward(const std::vector<const float*>& sources, const float* query, const float* rmsw, float eps,
                     float* o, AttnResShape s);
// Accumulates (+=) into dsources[j], dquery and drmsw (any may be null).
void attnres_backward(const std::vector<const float*>& sources, const float* query, const float* rmsw, float eps,
                      const float* d_o, const std::vector<float*>& dsources, float* dquery, float* drmsw,
                      AttnResShape s);

}  // namespace k3::cuda
