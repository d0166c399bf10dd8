// An fp32 device array as a GEMM operand of storage `st`: a bf16 copy, or the array itself. Host
// code of the CUDA forms only (linear_cuda.cc, cross_entropy_cuda.cc, attention's).
#pragma once

#include "core/tensor.h"
#include "ops/ops_cuda.h"

namespace k3::cuda {

struct Operand {
  Tensor copy;
  const void* ptr;
  Operand(const float* x, int64_t n, device::Storage st) : ptr(x) {
    if (st == device::Storage::F32) return;
    copy = Tensor::empty_on(Device::CUDA, {n}, DType::BF16);
    cast(x, copy.raw(), n, st);
    ptr = copy.raw();
  }
};

inline device::Storage gemm_storage(bool bf16) { return bf16 ? device::Storage::BF16 : device::Storage::F32; }

}  // namespace k3::cuda
