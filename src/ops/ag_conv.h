// Causal depthwise short convolution (the "ShortConvolution" of the delta-rule family, spec §3
// and oracles.md §1.5): per channel c, y[t, c] = Σ_{i<W} w[c, i] · x[t − W + 1 + i, c] with zero
// left padding, no bias. x is [B*T, C] (B sequences of T tokens), w [C, 1, W] (or [C, W]).
#pragma once

#include "ops/autograd.h"

namespace k3 {

// Plain kernels. `tail` [W−1, C] holds the W−1 inputs before x (oldest first); null means zeros.
// y may not alias x.
void short_conv_forward(const float* x, const float* w, const float* tail, int64_t T, int64_t C, int64_t W, float* y);
// dx and dw accumulate (+=); either may be null. The tail gets no gradient.
void short_conv_backward(const float* x, const float* w, const float* dy, int64_t T, int64_t C, int64_t W, float* dx,
                         float* dw);
// Shifts the last W−1 rows of [tail ; x] into tail (the conv state after x).
void short_conv_update_tail(const float* x, int64_t T, int64_t C, int64_t W, float* tail);

namespace ag {

// Differentiable, every sequence starts from zero padding; grads to x and w.
Var short_conv(const Var& x, const Var& w, int64_t B, int64_t T);

}  // namespace ag
}  // namespace k3
