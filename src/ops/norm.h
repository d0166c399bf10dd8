// Normalisations over the last dimension. Rows of x are [M, D] contiguous.
#pragma once

#include <cstdint>

#include "core/tensor.h"

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

// The same on tensors of either device, behind one dispatch on x's device (the loops above, or
// the CUDA kernels); rows of x are [M, D], everything contiguous fp32 on one device. stats ([2, M]:
// mean then rstd) and rstd ([M]) are written where defined, for the backward; gradients (dx, dw,
// db) accumulate where defined. w may be undefined for rmsnorm (no weight).
namespace norm {
void layernorm(const Tensor& x, const Tensor& w, const Tensor& b, float eps, const Tensor& y, const Tensor& stats);
void layernorm_backward(const Tensor& x, const Tensor& w, const Tensor& stats, const Tensor& dy, const Tensor& dx,
                        const Tensor& dw, const Tensor& db);
void rmsnorm(const Tensor& x, const Tensor& w, float eps, const Tensor& y, const Tensor& rstd);
void rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd, float eps, const Tensor& dy,
                      const Tensor& dx, const Tensor& dw);
}  // namespace norm

}  // namespace k3
