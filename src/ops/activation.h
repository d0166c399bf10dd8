// Elementwise activations, forward and backward side by side.
#pragma once

#include <cstdint>

namespace k3 {

// GELU, tanh approximation (HF "gelu_new", spec §1): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³))).
void gelu_tanh_forward(const float* x, float* y, int64_t n);
void gelu_tanh_backward(const float* x, const float* dy, float* dx, int64_t n);  // dx += ...

}  // namespace k3
