// Matrix products on the CPU (row-major, fp32) through the system BLAS.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace k3 {

enum class Trans : uint8_t { No, Yes };

// C[M,N] = alpha * op(A) op(B) + beta * C, all row-major; op(A) is [M,K], op(B) is [K,N].
// lda/ldb/ldc are row strides in elements (0: tight).
// The CUDA GEMMs' algorithm tuning (cuda::set_gemm_tuning in ops_cuda.h); the host's BLAS has none.
void set_device_gemm_tuning(bool on);

void gemm(Trans ta, Trans tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// How a linear layer's weight is stored: [out, in] (PyTorch nn.Linear) or [in, out] (GPT-2's
// Conv1D). Both are used zero-copy from the checkpoint.
enum class WeightLayout : uint8_t { OutIn, InOut };

// y[M, out] = x[M, in] W (+ bias) (+ beta * y). x and y contiguous.
void linear_forward(const float* x, int64_t M, int64_t in, int64_t out, const Tensor& w, WeightLayout layout,
                    const float* bias, float* y, float beta = 0.0f);
// Backward of linear_forward: dx[M,in] (+)= dy W; dw (+)= dyᵀ x (in w's layout); db (+)= Σ dy.
// Any of dx, dw, db may be null. Gradients accumulate (beta = 1) so several uses add up.
void linear_backward(const float* x, const float* dy, int64_t M, int64_t in, int64_t out, const Tensor& w,
                     WeightLayout layout, float* dx, float* dw, float* db);

}  // namespace k3
