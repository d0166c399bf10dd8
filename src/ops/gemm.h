// Matrix products: on the CPU (row-major, fp32) through the system BLAS, and the linear layer on
// tensors of either device (the CUDA form in linear_cuda.cc, through cuBLASLt).
#pragma once

#include <cstdint>
#include <vector>

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

// y[M, out] = x[M, in] W (+ bias) (+ beta * y). x and y contiguous. W fp32, or a block format
// (F8B128, MXFP4: core/quant.h) in [out, in], multiplied without inflating it whole: batches of at
// most kBlockRowsFused rows stream each weight row once; larger ones go through dequantised tiles.
inline constexpr int64_t kBlockRowsFused = 8;
void linear_forward(const float* x, int64_t M, int64_t in, int64_t out, const Tensor& w, WeightLayout layout,
                    const float* bias, float* y, float beta = 0.0f);
// Backward of linear_forward: dx[M,in] (+)= dy W; dw (+)= dyᵀ x (in w's layout); db (+)= Σ dy.
// Any of dx, dw, db may be null. Gradients accumulate (beta = 1) so several uses add up.
void linear_backward(const float* x, const float* dy, int64_t M, int64_t in, int64_t out, const Tensor& w,
                     WeightLayout layout, float* dx, float* dw, float* db);

// The linear layer on tensors of either device, behind one dispatch on x's device: x [.., in]
// contiguous fp32, w fp32, a block format [out, in] (forward only), or bf16 on CUDA in `layout`, b [out] or undefined, y [.., out].
// bf16: GEMM operands rounded to bf16 with fp32 accumulation (ops/precision.h; the CPU computes in
// fp32). Gradients accumulate into dx, dw, db where defined.
namespace linear {
void forward(const Tensor& x, const Tensor& w, const Tensor& b, WeightLayout layout, const Tensor& y, bool bf16);
void backward(const Tensor& x, const Tensor& w, WeightLayout layout, const Tensor& dy, const Tensor& dx,
              const Tensor& dw, const Tensor& db, bool bf16);
// x · W_iᵀ for bias-free [out, in] CUDA weights of one dtype, in one grouped GEMM (inference).
std::vector<Tensor> grouped(const Tensor& x, const std::vector<const Tensor*>& weights);
}  // namespace linear

// The CUDA forms behind linear:: (linear_cuda.cc, built with CUDA only).
namespace linear_cuda {
void forward(const Tensor& x, const Tensor& w, const Tensor& b, WeightLayout layout, const Tensor& y, bool bf16);
void backward(const Tensor& x, const Tensor& w, WeightLayout layout, const Tensor& dy, const Tensor& dx,
              const Tensor& dw, const Tensor& db, bool bf16);
std::vector<Tensor> grouped(const Tensor& x, const std::vector<const Tensor*>& weights);
}  // namespace linear_cuda

}  // namespace k3
