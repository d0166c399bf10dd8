// Elementwise activations, forward and backward side by side. The array kernels use fastmath's
// branch-free exp/tanh/σ (within 4e-7 relative of the C library), are compiled per ISA level and
// split over the thread pool; backward kernels accumulate (dx += ...).
#pragma once

#include <cstdint>

namespace k3 {

// GELU, tanh approximation (HF "gelu_new", spec §1): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³))).
void gelu_tanh_forward(const float* x, float* y, int64_t n);
void gelu_tanh_backward(const float* x, const float* dy, float* dx, int64_t n);  // dx += ...

// σ(x) and SiLU(x) = x σ(x).
void sigmoid_forward(const float* x, float* y, int64_t n);
void sigmoid_backward(const float* x, const float* dy, float* dx, int64_t n);  // dx += dy σ(1 − σ)
void silu_forward(const float* x, float* y, int64_t n);
void silu_backward(const float* x, const float* dy, float* dx, int64_t n);  // dx += dy σ(1 + x(1 − σ))

// elu(x) + 1, linear attention's feature map: x + 1 for x > 0, else exp(x).
void elu1_forward(const float* x, float* y, int64_t n);
void elu1_backward(const float* x, const float* dy, float* dx, int64_t n);  // dx += dy φ'(x)

// SiTU-GLU (ops/situ.h, spec §9): y = [β tanh(g/β) σ(g)] · [β_lin tanh(u/β_lin)]; β ≤ 0 means
// no cap (SiLU(g)), β_lin ≤ 0 the plain up. The backward needs both dg and du.
void situ_glu_forward(const float* g, const float* u, float* y, int64_t n, float beta, float beta_lin);
void situ_glu_backward(const float* g, const float* u, const float* dy, float* dg, float* du, int64_t n, float beta,
                       float beta_lin);

}  // namespace k3
