// The CPU product with a block-format weight (core/quant.h), behind linear_forward (ops/gemm.h).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/gemm.h"

namespace k3 {

// y[M, out] = beta·y + x[M, in] · Wᵀ for a block-format W [out, in], never inflated whole: up to
// kBlockRowsFused rows of x stream each weight row once (AVX2 + F16C kernels where the CPU has
// them); more go through tiles of W dequantised for the BLAS.
void linear_blocks(const float* x, int64_t M, int64_t in, int64_t out, const Tensor& w, float* y, float beta);

}  // namespace k3
