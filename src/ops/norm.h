// Normalisations over the last dimension. Rows of x are [M, D] contiguous.
#pragma once

#include <cstdint>

namespace k3 {

// GPT-2 LayerNorm: y = (x - mean) / sqrt(var + eps) * w + b (biased variance, as PyTorch).
// mean and rstd ([M], optional) are saved for the backward pass.
void layernorm_forward(const float* x, const float* w, const float* b, float eps, int64_t M, int64_t D, float* y,
                       float* mean = nullptr, float* rstd = nullptr);
void layernorm_backward(const float* x, const float* w, const float* mean, const float* rstd, const float* dy,
                        int64_t M, int64_t D, float* dx, float* dw, float* db);

// RMSNorm as Kimi/DeepSeek compute it (spec §0): y = w * x / sqrt(mean(x²) + eps).
void rmsnorm_forward(const float* x, const float* w, float eps, int64_t M, int64_t D, float* y,
                     float* rstd = nullptr);
void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, int64_t M, int64_t D,
                      float* dx, float* dw);

}  // namespace k3
