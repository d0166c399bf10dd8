// Differentiable wrappers of the delta-rule core (delta_core.h) and of the family's gates and
// feature map, as autograd ops (ops/autograd.h). Rows are tokens of B sequences of T tokens:
// [B*T, H*K] is the same memory as the core's [B, T, H, K].
#pragma once

#include "mixers/linear/delta_core.h"
#include "ops/autograd.h"

namespace k3::ag {

struct DeltaShape {
  int64_t B = 1, T = 0;
  int64_t H = 1, HV = 1;  // q/k heads, value heads (HV a multiple of H)
  int64_t K = 0, V = 0;   // key and value head dims
};

// o [B*T, HV*V] of the core over B fresh sequences (chunked form; backward recomputes).
// q, k [B*T, H*K]; v [B*T, HV*V]; beta [B*T, HV] for Write::Delta (else null); g [B*T, HV]
// (Decay::Scalar) or [B*T, HV*K] (Decay::PerChannel), else null. Gradients to all five.
Var delta_rule(const Var& q, const Var& k, const Var& v, const Var& beta, const Var& g, const linear::DeltaOptions& opts,
               const DeltaShape& s);

enum class KdaGateForm : uint8_t { Softplus, LowerBound };

// Log-decay per (head, channel) from the gate logits x [M, H*K] (ops/gates.h):
//   Softplus    g = −exp(A_log[h]) · softplus(x + dt_bias[h*K + k])
//   LowerBound  g = lb · sigmoid(exp(A_log[h]) · (x + dt_bias[h*K + k]))
// A_log holds at least H values (any shape: [H], [1,1,H,1]; only the first H are read), dt_bias
// H*K. Gradients to x, A_log and dt_bias. With K = 1 this is Gated DeltaNet's gate.
Var kda_gate(const Var& x, const Var& A_log, const Var& dt_bias, int64_t H, int64_t K, KdaGateForm form,
             float lower_bound = -5.0f);

}  // namespace k3::ag
