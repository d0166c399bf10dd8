// Elementwise kernels on tensors of either device, each behind one dispatch on the tensors' device
// (the host loops of ops/activation.h, or the CUDA kernels of ops_cuda.h): the differentiable ops
// (ag.h) call these and never ask where a tensor lives. Every tensor is a contiguous fp32 array of
// the same element count on one device; backward kernels accumulate (dx += ...).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace k3::elementwise {

// Scale: s·x; Sigmoid: σ(x); Silu: x·σ(x); Elu1: elu(x) + 1 (linear attention's feature map);
// GeluTanh: the tanh approximation of GELU (HF "gelu_new").
enum class Unary : uint8_t { Scale, Sigmoid, Silu, Elu1, GeluTanh };
const char* name(Unary f);

void unary(Unary f, const Tensor& x, const Tensor& y, float s = 1.0f);                               // y = f(x)
void unary_backward(Unary f, const Tensor& x, const Tensor& dy, const Tensor& dx, float s = 1.0f);  // dx += f'(x)·dy
void add(const Tensor& a, const Tensor& b, const Tensor& y);                                        // y = a + b
void mul(const Tensor& a, const Tensor& b, const Tensor& y);                                        // y = a · b
void accumulate(const Tensor& dx, const Tensor& dy);                                               // dx += dy
// da += dy·b and db += dy·a, each where given (an undefined tensor: not wanted).
void mul_backward(const Tensor& a, const Tensor& b, const Tensor& dy, const Tensor& da, const Tensor& db);

}  // namespace k3::elementwise
