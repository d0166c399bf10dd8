// Gate parameterisations of the gated delta-rule family, forward and backward side by side
// (spec §4 "Gate parameterisation", §5.3, §5.4 "In-kernel gate options").
//
//   KDA softplus gate   g = −exp(A_log[h]) · softplus(x + dt_bias[h, k])        (log-decay ≤ 0)
//   KDA lower-bound     g = lb · sigmoid(exp(A_log[h]) · (x + dt_bias[h, k]))   (lb = −5 in K3)
//   GDN gate            the softplus gate with one channel per head (K = 1)
//   β                   sigmoid(x)
//
// x is [rows, H, K] (rows = B·T), A_log [H], dt_bias [H·K]. Backward functions accumulate (+=)
// into every non-null gradient.
#pragma once

#include <cstdint>

namespace k3 {

// Softplus as torch computes it in fp32 (threshold 20 is within rounding of the exact form).
float gate_softplus(float x);
float gate_sigmoid(float x);

struct GateShape {
  int64_t rows = 0;  // B·T
  int64_t H = 0;
  int64_t K = 1;  // channels per head (1 for the GDN gate)
};

void gate_softplus_forward(const float* x, const float* A_log, const float* dt_bias, float* g, GateShape s);
void gate_softplus_backward(const float* x, const float* A_log, const float* dt_bias, const float* dg, float* dx,
                            float* dA_log, float* ddt_bias, GateShape s);

void gate_lowerbound_forward(const float* x, const float* A_log, const float* dt_bias, float lower_bound, float* g,
                             GateShape s);
void gate_lowerbound_backward(const float* x, const float* A_log, const float* dt_bias, float lower_bound,
                              const float* dg, float* dx, float* dA_log, float* ddt_bias, GateShape s);

void beta_sigmoid_forward(const float* x, float* y, int64_t n);
void beta_sigmoid_backward(const float* y, const float* dy, float* dx, int64_t n);  // from the output y

}  // namespace k3
