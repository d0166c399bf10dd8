// The LM head's cross-entropy, logits = h Wᵀ never formed whole (ag::cross_entropy_head): on the
// host in vocabulary chunks with an online log-sum-exp, on CUDA in row chunks of at most 64 MiB of
// logits (cross_entropy_cuda.cc). Rows whose target is negative are ignored; z_loss adds
// c·lse² per row.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/device_ids.h"

namespace k3::cross_entropy {

// What the backward reuses: the rows' log-sum-exp (host) or the uploaded targets (CUDA).
struct Saved {
  std::vector<float> lse;
  DeviceIds targets;
};

// The summed loss over the rows with a target, on h's device (h [N, D], w [V, D] fp32).
// bf16: the CUDA GEMM's operands rounded to bf16 (ops/precision.h).
double forward(const Tensor& h, const Tensor& w, const std::vector<int64_t>& targets, int64_t vocab_chunk,
               float z_loss, bool bf16, Saved& saved);
// dh += g·∂L/∂h, dw += g·∂L/∂W where defined (g: the gradient of the summed loss).
void backward(const Tensor& h, const Tensor& w, const std::vector<int64_t>& targets, int64_t vocab_chunk,
              float z_loss, bool bf16, const Saved& saved, float g, const Tensor& dh, const Tensor& dw);

}  // namespace k3::cross_entropy

// The CUDA forms behind cross_entropy:: (built with CUDA only).
namespace k3::cross_entropy_cuda {
double forward(const Tensor& h, const Tensor& w, const std::vector<int64_t>& targets, float z_loss, bool bf16,
               cross_entropy::Saved& saved);
void backward(const Tensor& h, const Tensor& w, float z_loss, bool bf16, const cross_entropy::Saved& saved, float g,
              const Tensor& dh, const Tensor& dw);
}  // namespace k3::cross_entropy_cuda
